"""vLLM at tensor_parallel_size=2 on CPU (two worker processes over gloo): weight updates travel through vLLM's
weight-transfer protocol with rollhpc's shared-memory backend (rollhpc.engines.vllm_weight_transfer), not pickled.

One probe (tests/support/vllm_tp_probe.py): an engine starts on checkpoint a (loaded from disk by vLLM itself: the
reference), receives b's weights in chunks of 16 KiB (dozens of chunks, a chunk per tensor or several), then a's
again. Each TP worker's parameter shards must then be a's, bit for bit, and greedy generation what it was at the
start; b's generation must equal transformers' on b. The chunking and packing are tested without an engine.
"""

from __future__ import annotations

import json
import logging

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("vllm")

from rollhpc.engines import vllm_weight_transfer as wt  # noqa: E402
from tests.support.processes import run_probe  # noqa: E402
from tests.world.test_vllm_engine import MAX_TOKENS, PROMPTS, assert_matches, hf_greedy, tiny_qwen2  # noqa: E402


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm_tp")
    refs = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_qwen2(seed)
        refs[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        model.save_pretrained(work / name, safe_serialization=True)
    spec = {
        "model_a": str(work / "a"),
        "model_b": str(work / "b"),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "chunk_bytes": 16 << 10,
    }
    res = run_probe("vllm_tp_probe.py", spec, work)
    print(json.dumps({k: res[k] for k in ("start_s", "update_1_s", "update_2_s", "update_bytes")}))
    return res, refs


@pytest.mark.slow
def test_tp2_update_goes_through_shared_memory(probe):
    res, _ = probe
    assert res["weight_transfer"] == wt.SHM_BACKEND
    assert res["version"] == 2
    assert res["shm_left"] == []  # every chunk file unlinked once loaded


@pytest.mark.slow
def test_tp2_weights_exact_after_update(probe):
    res, _ = probe
    assert len(res["digests_a"]) == 2  # one entry per TP worker, each its own shards
    assert res["digests_a"][0] != res["digests_a"][1]
    # b's update changed every worker's shards
    assert all(a != b for a, b in zip(res["digests_a"], res["digests_b"]))
    # and a's put back exactly what vLLM loaded from disk
    assert res["digests_a_again"] == res["digests_a"]


@pytest.mark.slow
def test_tp2_generation_after_update(probe):
    res, refs = probe
    assert_matches(res["b"], refs["b"])  # b's weights generate as transformers does with b
    assert res["a_again"] == res["a"]  # a's generate as the engine that loaded a from disk did
    assert_matches(res["a"], refs["a"])


def test_chunks_align_split_and_keep_order():
    tensors = [
        ("a", torch.zeros(3, dtype=torch.bfloat16)),
        ("b", torch.zeros(5)),
        ("big", torch.zeros(100)),
        ("c", torch.zeros(2, dtype=torch.int64)),
    ]
    got = [[(n, o) for n, _, o in c] for c in wt.chunks(iter(tensors), chunk_bytes=128)]
    # b starts at the next 64-byte boundary after a's 6 bytes; big (400 B) exceeds a chunk and gets its own
    assert got == [[("a", 0), ("b", 64)], [("big", 0)], [("c", 0)]]
    packed = [[(n, o) for n, _, o in c] for c in wt.chunks(iter(tensors), chunk_bytes=128, align=1)]
    assert packed == [[("a", 0), ("b", 6)], [("big", 0)], [("c", 0)]]
    with pytest.raises(ValueError):
        next(wt.chunks(iter(tensors), chunk_bytes=0))


def test_packed_chunk_reads_back_bit_exact():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("w", torch.randn(4, 6, generator=g).to(torch.bfloat16)),
        ("t", torch.randn(6, 4, generator=g).t()),  # not contiguous
        ("i", torch.arange(7, dtype=torch.int64)),
        ("h", torch.randn(3, generator=g).half()),
    ]
    (chunk,) = wt.chunks(iter(tensors), chunk_bytes=1 << 20)
    data = torch.zeros(wt.chunk_nbytes(chunk), dtype=torch.uint8)
    info = wt.ShmUpdateInfo(
        path="-", nbytes=data.numel(), offsets=[o for _, _, o in chunk], **wt._pack(chunk, data)
    )
    back = dict(wt._views(data, info))
    for name, t in tensors:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with pytest.raises(ValueError, match="as many"):
        wt.ShmUpdateInfo(path="-", nbytes=1, names=["x"], dtype_names=[], shapes=[[1]], offsets=[0])


def test_without_the_plugin_the_pickled_fallback_warns(monkeypatch, caplog):
    from rollhpc.engines import vllm_engine

    monkeypatch.setattr(wt, "shm_backend_registered", lambda: False)
    with caplog.at_level(logging.WARNING, logger=vllm_engine.__name__):
        assert vllm_engine._weight_transfer_backend(on_cpu=True) is None
    assert "pickled whole" in caplog.text
    # vLLM's own, no plugin needed
    assert vllm_engine._weight_transfer_backend(on_cpu=False) == "ipc"
