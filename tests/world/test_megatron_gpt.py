"""megatron-core GPTModel built from a Hugging Face Qwen2 config: same logits as HF at TP=1 and TP=2.

Two tiny Qwen2 checkpoints (GQA, vocab 100: padded to 128 at TP=1 and 256 at TP=2; tied and untied
embeddings) are saved with transformers; two real processes (torch.multiprocessing.spawn, gloo) build
the megatron model at TP=1 then TP=2, load the HF weights, and write logits and the loss before and
after one AdamW step; the test compares them with the HF model's (and with one AdamW step on it).
After the step, ``export_hf_weights`` gathers the trained weights back into HF tensors on TP rank 0;
loaded into a fresh HF model (``strict=True``) they give the trained megatron model's logits.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed" and the like
    pytest.importorskip("megatron.core")

from rollhpc.models.hf_weight_map import (  # noqa: E402
    Arch,
    padded_vocab_size,
    shard_hf_weight,
    weight_map,
)

VOCAB = 100
WORLD = 2
LR = 1e-2


def _batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    # the last real vocab rows, next to the padding
    ids[0, :4] = torch.tensor([VOCAB - 1, 0, VOCAB - 2, 1])
    return ids


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over the real vocab (padded logit columns left out)."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1, :VOCAB].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)
    )


def _worker(rank: int, rendezvous: str, model_dirs: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    from safetensors.torch import load_file

    from rollhpc.models import megatron_cpu
    from rollhpc.models.megatron_gpt import build_gpt_model
    from rollhpc.models.megatron_hf import export_hf_weights, load_hf_weights

    # On a (pretend) CUDA machine enable_cpu_megatron touches nothing.
    real_available, current_device = torch.cuda.is_available, torch.cuda.current_device
    torch.cuda.is_available = lambda: True
    assert (
        megatron_cpu.enable_cpu_megatron() is False and torch.cuda.current_device is current_device
    )
    torch.cuda.is_available = real_available
    assert megatron_cpu.enable_cpu_megatron() is True and megatron_cpu.enable_cpu_megatron() is True

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ids = _batch()
    results = {}
    for model_dir in model_dirs:
        hf_state = load_file(str(Path(model_dir) / "model.safetensors"))
        for tp in (1, 2):
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
            model_parallel_cuda_manual_seed(1234)
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            model = build_gpt_model(model_dir, parallel_output=False)
            load_hf_weights(model, hf_state, tp_rank, tp)
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            logits = model(ids, positions, None)  # [b, s, padded vocab], gathered over TP
            assert logits.shape == (*ids.shape, padded_vocab_size(VOCAB, tp))
            loss = _loss(logits, ids)
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
            loss.backward()
            opt.step()
            with torch.no_grad():
                logits_after = model(ids, positions, None)
                loss_after = _loss(logits_after, ids)
            # Every rank iterates the export (it all-gathers); only TP rank 0 gets tensors.
            exported = {name: t.clone() for name, t in export_hf_weights(model, VOCAB)}
            assert bool(exported) == (tp_rank == 0), (rank, tp, sorted(exported)[:3])
            results[Path(model_dir).name, tp] = dict(
                logits=logits.detach()[..., :VOCAB],
                loss=loss.item(),
                loss_after=loss_after.item(),
                padded_logits=logits.detach()[..., VOCAB:].abs().max().item(),
                logits_after=logits_after[..., :VOCAB],
                exported=exported,
            )
            parallel_state.destroy_model_parallel()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")
    dist.destroy_process_group()


def _hf_qwen2(tied: bool):
    torch.manual_seed(int(tied))
    config = transformers.Qwen2Config(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        rope_theta=50000.0,
        tie_word_embeddings=tied,
    )
    hf = transformers.Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # non-zero q/k/v biases and norm weights, so their mapping is checked
        for name, p in hf.named_parameters():
            if name.endswith(("proj.bias", "norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


def test_megatron_gpt_matches_hf_qwen2_tp1_tp2(tmp_path: Path) -> None:
    hfs = {"untied": _hf_qwen2(False), "tied": _hf_qwen2(True)}
    for name, hf in hfs.items():
        hf.save_pretrained(tmp_path / name)
    dirs = [str(tmp_path / name) for name in hfs]
    # One world for both checkpoints and both TP sizes: process start and imports dominate the time.
    torch.multiprocessing.spawn(
        _worker, args=(f"file://{tmp_path}/rendezvous", dirs, str(tmp_path)), nprocs=WORLD
    )
    results = torch.load(tmp_path / "results.pt")

    ids = _batch()
    for name, hf in hfs.items():
        ref = hf(ids).logits.detach()
        loss = _loss(hf(ids).logits, ids)
        loss.backward()
        torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0).step()
        with torch.no_grad():
            loss_after = _loss(hf(ids).logits, ids).item()
        for tp in (1, 2):
            r = results[name, tp]
            diff = (r["logits"] - ref).abs().max().item()
            print(
                f"{name} tp={tp}: max |logit - HF| = {diff:.2e}, loss {r['loss']:.6f} -> {r['loss_after']:.6f}"
            )
            assert diff < 1e-4, f"{name} tp={tp}: logits differ from HF by {diff}"
            assert r["padded_logits"] == 0.0  # padded vocab rows are zero
            assert r["loss"] == pytest.approx(loss.item(), abs=1e-5)
            assert r["loss_after"] == pytest.approx(loss_after, abs=1e-4)
            assert r["loss_after"] < r["loss"]
            # The trained megatron weights, exported to HF names, are the trained megatron model.
            exported = dict(r["exported"])
            if hf.config.tie_word_embeddings:
                assert "lm_head.weight" not in exported
                exported["lm_head.weight"] = exported["model.embed_tokens.weight"]
            fresh = transformers.Qwen2ForCausalLM(hf.config).float().eval()
            fresh.load_state_dict(exported, strict=True)
            with torch.no_grad():
                diff = (fresh(ids).logits - r["logits_after"]).abs().max().item()
            print(f"{name} tp={tp}: exported HF vs trained megatron max |logit diff| = {diff:.2e}")
            assert diff < 1e-4, f"{name} tp={tp}: exported weights give logits off by {diff}"
        assert results[name, 2]["loss"] == pytest.approx(results[name, 1]["loss"], abs=1e-5)
        assert results[name, 2]["loss_after"] == pytest.approx(
            results[name, 1]["loss_after"], abs=1e-5
        )


def test_qkv_and_gate_up_layouts() -> None:
    """Megatron's fused layouts, spelled out on labelled rows: QKV grouped per query group, fc1 = [gate; up]
    per shard, vocab padded with zero rows then split."""
    nh, ng, d = 4, 2, 1
    q = torch.arange(nh * d).float()[:, None]  # q heads 0..3
    k = 10 + torch.arange(ng * d).float()[:, None]
    v = 20 + torch.arange(ng * d).float()[:, None]
    full = shard_hf_weight("qkv", [q, k, v], 0, 1, num_query_groups=ng)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert shard_hf_weight("qkv", [q, k, v], 1, 2, num_query_groups=ng).flatten().tolist() == [
        2,
        3,
        11,
        21,
    ]
    gate, up = torch.arange(4.0)[:, None], 10 + torch.arange(4.0)[:, None]
    assert shard_hf_weight("gate_up", [gate, up], 1, 2).flatten().tolist() == [2, 3, 12, 13]
    emb = torch.ones(5, 2)
    shard = shard_hf_weight("vocab", [emb], 1, 2, padded_vocab=8)
    assert shard.tolist() == [[1, 1], [0, 0], [0, 0], [0, 0]]
    assert shard_hf_weight("row", [torch.arange(4.0)[None]], 1, 2).tolist() == [[2, 3]]
    with pytest.raises(ValueError, match="multiple of tp"):
        shard_hf_weight("qkv", [q, k, v], 0, 4, num_query_groups=ng)

    table = weight_map(Arch(num_layers=2, tie_word_embeddings=True))
    assert len(table) == 2 + 7 * 2 and "output_layer.weight" not in {w.megatron for w in table}
    assert weight_map(Arch(2, False))[-1].hf == ("lm_head.weight",)
