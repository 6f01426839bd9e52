"""megatron-core's own DDP and optimizer on CPU (gloo, rollhpc.models.megatron_cpu): the stack the trainer moves to
(issue 33), proven on a real megatron GPTModel before the worker uses it.

- DP=2 with the distributed optimizer (gradients reduce-scattered in DDP's buckets, fp32 main parameters and Adam
  moments sharded over the two ranks, parameters all-gathered after the step) against DP=1: the same losses, grad
  norms and weights after 3 steps, and half the optimizer-state bytes per rank.
- Activation recomputation (selective, full) gives the gradients computed without it.
- Why bf16 needs fp32 main parameters: at lr 1e-6, 20 steps of bf16 parameters with megatron's fp32 main
  parameters follow an all-fp32 run, while torch's AdamW on the bf16 parameters themselves leaves nearly every
  weight where it was (each update is below half a bf16 step and rounds away).

Each world is real processes (torch.multiprocessing, gloo).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")
mp = pytest.importorskip("torch.multiprocessing")

TINY = dict(
    model_type="qwen2",
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    tie_word_embeddings=False,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
)
ROWS, LEN = 4, 16


def _batch() -> "torch.Tensor":
    return torch.randint(
        0, TINY["vocab_size"], (ROWS, LEN), generator=torch.Generator().manual_seed(1)
    )


def _model(dtype: "torch.dtype", start: dict | None = None):
    from rollhpc.models.megatron_gpt import build_gpt_model

    torch.manual_seed(0)
    # calculate_per_token_loss: the loss is already divided by the global token count, so DDP sums gradients
    # over ranks instead of averaging them (the trainer's losses are normalised the same way)
    model = build_gpt_model(
        TINY,
        params_dtype=dtype,
        parallel_output=False,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
    )
    if start is not None:
        model.load_state_dict(
            {k: v.to(dtype) if v.is_floating_point() else v for k, v in start.items()}, strict=False
        )
    return model


def _loss(model, ids: "torch.Tensor") -> "torch.Tensor":
    vocab = TINY["vocab_size"]
    logits = model(ids, torch.arange(LEN).expand_as(ids), None)[..., :vocab].float()
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum"
    )
    return per_token / (ROWS * (LEN - 1))  # global token count: each rank holds a share of the rows


def _megatron_stack(model, dtype: "torch.dtype", lr: float):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=0.0,
            clip_grad=1.0,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=True,
        ),
        [ddp],
    )
    return ddp, optimizer


def _train(
    ddp, optimizer, ids: "torch.Tensor", steps: int, main_params: list | None = None
) -> dict:
    import torch.distributed as dist

    losses, norms, moved = [], [], []
    for _ in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _loss(ddp, ids)
        loss.backward()
        ddp.finish_grad_sync()
        before = [p.detach().clone() for p in main_params] if main_params else None
        _, norm, _ = optimizer.step()
        if before is not None:  # share of this rank's fp32 main-parameter elements the step changed
            changed = sum(int((p.detach() != b).sum()) for p, b in zip(main_params, before))
            moved.append(changed / sum(b.numel() for b in before))
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
        norms.append(float(norm))
    return {"losses": losses, "norms": norms, "main_moved": moved}


def _state_bytes(optimizer) -> int:
    inner = getattr(optimizer, "optimizer", optimizer)
    return sum(
        v.numel() * v.element_size()
        for s in inner.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )


def _dp_run(rank: int, world: int) -> dict:
    """fp32, distributed optimizer, 3 steps; each rank trains on its share of the rows."""
    model = _model(torch.float32)
    ddp, optimizer = _megatron_stack(model, torch.float32, lr=1e-3)
    share = ROWS // world
    out = _train(ddp, optimizer, _batch()[rank * share : (rank + 1) * share], steps=3)
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["state_bytes"] = _state_bytes(optimizer)
    return out


def _bf16_runs() -> dict:
    """20 steps at lr 1e-6 from the same bf16-representable start: fp32 throughout; bf16 parameters with fp32
    main parameters (megatron); bf16 parameters under torch's AdamW (no main parameters)."""
    start = {
        k: v.to(torch.bfloat16).float()
        for k, v in _model(torch.float32).state_dict().items()
        if torch.is_tensor(v) and v.is_floating_point()
    }
    ids, lr, steps = _batch(), 1e-6, 20
    out = {"start": start}
    for name, dtype in (("fp32", torch.float32), ("bf16_main_fp32", torch.bfloat16)):
        model = _model(dtype, start)
        ddp, optimizer = _megatron_stack(model, dtype, lr=lr)
        main = [g["params"] for g in optimizer.optimizer.param_groups]
        out[name] = _train(
            ddp, optimizer, ids, steps, main_params=[p for group in main for p in group]
        )
        out[name]["weights"] = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        out[name]["bf16_params"] = [
            n for n, p in model.named_parameters() if p.dtype == torch.bfloat16
        ]
        # at DP=1 each parameter's main shard is all of it
        out[name]["main"] = {
            n: (p.main_param if getattr(p, "main_param", None) is not None else p)
            .detach()
            .float()
            .reshape(p.shape)
            .clone()
            for n, p in model.named_parameters()
        }
    model = _model(torch.bfloat16, start)
    adamw = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        adamw.zero_grad()
        _loss(model, ids).backward()
        adamw.step()
    out["bf16_adamw"] = {
        "weights": {n: p.detach().float().clone() for n, p in model.named_parameters()}
    }
    return out


def _recompute_grads() -> dict[str, dict]:
    """Loss and gradients of one forward-backward with each kind of activation recomputation."""
    from rollhpc.models.megatron_gpt import build_gpt_model, recompute_overrides

    out = {}
    for kind in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = build_gpt_model(
            TINY, params_dtype=torch.float32, parallel_output=False, **recompute_overrides(kind)
        )
        model.train()
        loss = _loss(model, _batch())
        loss.backward()
        out[kind] = {
            "loss": float(loss),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            "granularity": model.config.recompute_granularity,
        }
    return out


def _rank(rank: int, world: int, rendezvous: str, path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rollhpc.models import megatron_cpu

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    megatron_cpu.enable_cpu_megatron()
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        out = {"dp": _dp_run(rank, world)}
        if world == 1:
            out["bf16"] = _bf16_runs()
            out["recompute"] = _recompute_grads()
        torch.save(out, f"{path}.{rank}")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _world(world: int, tmp_path) -> list[dict]:
    path = str(tmp_path / f"world{world}")
    mp.spawn(_rank, args=(world, f"file://{path}.rendezvous", path), nprocs=world, join=True)
    return [torch.load(f"{path}.{r}") for r in range(world)]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron_optimizer")
    return _world(1, tmp), _world(2, tmp)


@pytest.mark.slow
def test_dp2_distributed_optimizer_matches_dp1(worlds):
    (one,), two = worlds
    a, b = one["dp"], two[0]["dp"]
    assert b["losses"] == two[1]["dp"]["losses"]
    torch.testing.assert_close(
        torch.tensor(b["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        torch.tensor(b["norms"]), torch.tensor(a["norms"]), rtol=1e-5, atol=0
    )
    assert a["norms"][0] > 1.0  # the clip (1.0) acts, on both
    # every rank holds the whole model again after the distributed optimizer's all-gather
    for rank in (
        0,
        1,
    ):
        for name, w in a["weights"].items():
            torch.testing.assert_close(
                two[rank]["dp"]["weights"][name], w, rtol=0, atol=2e-6, msg=name
            )
    halves = [two[r]["dp"]["state_bytes"] / a["state_bytes"] for r in (0, 1)]
    # fp32 main parameters + 2 moments, sharded
    assert all(0.45 <= h <= 0.55 for h in halves), halves


@pytest.mark.slow
def test_bf16_learns_at_small_lr_only_with_fp32_main_parameters(worlds):
    (one,), _ = worlds
    runs = one["bf16"]
    fp32, mixed, plain = runs["fp32"], runs["bf16_main_fp32"], runs["bf16_adamw"]
    assert min(mixed["main_moved"]) > 0.9  # every update moves (nearly) every fp32 main parameter
    torch.testing.assert_close(
        torch.tensor(mixed["losses"]), torch.tensor(fp32["losses"]), rtol=2e-2, atol=0
    )
    moved32 = {n: (w - runs["start"][n]).abs() for n, w in fp32["weights"].items()}
    # the matrices (megatron keeps some norms in fp32)
    assert len(mixed["bf16_params"]) >= len(mixed["main"]) // 2
    for name in mixed["bf16_params"]:  # the bf16 weights are their fp32 main parameters, rounded
        assert torch.equal(
            mixed["weights"][name], mixed["main"][name].to(torch.bfloat16).float()
        ), name
    # the fp32 main parameters follow the all-fp32 run: apart by a small part of how far that run moved
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(moved32)])  # noqa: E731
    apart = float((flat(mixed["main"]) - flat(fp32["weights"])).norm() / flat(moved32).norm())
    print(f"main parameters apart from the fp32 run: {apart:.3f} of its movement")
    assert apart < 0.2, apart
    fp32_moved = sum(int((m > 0).sum()) for m in moved32.values()) / sum(
        m.numel() for m in moved32.values()
    )
    plain_moved = sum(
        int((plain["weights"][n] != runs["start"][n]).sum())
        for n in runs["start"]
        if n in plain["weights"]
    ) / sum(m.numel() for m in moved32.values())
    assert fp32_moved > 0.9  # lr 1e-6 moves nearly every weight in fp32 ...
    print(f"weights moved: fp32 {fp32_moved:.3f}, bf16 AdamW {plain_moved:.4f}")
    # ... and nearly none when bf16 weights take the updates themselves
    assert plain_moved < 0.05, plain_moved


@pytest.mark.slow
def test_recomputed_activations_give_the_same_gradients(worlds):
    """Selective (attention's scores) and full (each layer from its input) recomputation through megatron's
    TransformerConfig, on CPU through the shim's RNG tracker: the loss and every gradient as without."""
    (one,), _ = worlds
    runs = one["recompute"]
    assert runs["none"]["granularity"] is None
    for kind in ("selective", "full"):
        assert runs[kind]["granularity"] == kind  # megatron was asked to recompute
        assert runs[kind]["loss"] == runs["none"]["loss"]
        for name, g in runs["none"]["grads"].items():
            torch.testing.assert_close(
                runs[kind]["grads"][name], g, rtol=0, atol=0, msg=f"{kind}: {name}"
            )
