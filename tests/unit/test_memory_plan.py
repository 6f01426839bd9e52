"""The memory plan's terms (rollhpc.placement.memory_plan, activation_model), each proven once without building a
model: activations against the bytes bench/activation_bytes.py measured, the MoE dispatcher, the forward-only
logits, vLLM's buffers that sleep keeps, the start-up in turns, and a weight sync's buckets."""

from __future__ import annotations

import json

import pytest

from rollhpc.placement import activation_model as am
from rollhpc.placement.memory_plan import (
    GIB,
    KNOWN_MODELS,
    ModelShape,
    estimate,
    forward_activation_bytes,
    startup_bytes,
    startup_order,
)

from tests.support.processes import REPO

QWEN3_30B = ModelShape.from_hf(KNOWN_MODELS["qwen3-30b-a3b"])
QWEN25_7B = ModelShape.from_hf(KNOWN_MODELS["qwen2.5-7b"])


def test_the_activation_model_matches_measured_saved_bytes_within_15pct():
    """bench/results/activation_bytes.json: megatron's local spec measured on CPU at 256, 1024 and 4096 tokens for the
    0.5B and 7B shapes (SwiGLU, GELU, MHA; recompute none / selective / full). The model as the code computes it
    now, not as recorded, must stay within 15% of each measurement."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "activation_bench", REPO / "bench" / "activation_bytes.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = json.loads((REPO / "bench" / "results" / "activation_bytes.json").read_text())["rows"]
    seen = {(r["shape"], r["tokens"]) for r in rows}
    assert seen >= {(s, t) for s in ("0.5b", "7b") for t in (256, 1024, 4096)}
    assert {r["variant"] for r in rows} == {"swiglu", "gelu", "mha"}
    assert {r["recompute"] for r in rows} == set(am.RECOMPUTE_MODES)
    for r in rows:
        model = bench.planned(r["shape"], r["variant"], r["tokens"], r["recompute"])[r["part"]]
        assert model == pytest.approx(r["measured_bytes"], rel=0.15), r


def test_moe_layers_count_routed_tokens_and_the_all_gather_dispatcher():
    """Qwen3-30B-A3B at 4096 tokens with ep 8: each rank keeps its experts' share of the gathered tokens (T·k on
    average: input, six FFN-wide tensors, index and probability each), the local columns of the gathered routing
    map and probabilities, the router's top-k; the dispatcher's gather buffers once. A dense model has none of
    these; ep 1 gathers nothing."""
    t, e = 4096, 2
    layer = am.layer_bytes(QWEN3_30B, 1, 1, t, e, "selective", ep=8, etp=1)
    assert layer["experts"] == t * 8 * (8 + 2 + e * 2048 + 6 * e * 768)
    assert layer["dispatch"] == 3 * t * 8 * (128 // 8) and layer["router"] == 12 * t * 8
    moe = sum(layer[k] for k in ("experts", "dispatch", "router")) * QWEN3_30B.layers
    # what selective recompute keeps of the MoE alone over the 48 layers, per row
    assert 20 < moe / 1e9 < 22
    assert am.dispatch_buffer_bytes(QWEN3_30B, t, e, 8, 1) == 2 * e * t * 8 * 2048
    assert am.dispatch_buffer_bytes(QWEN3_30B, t, e, 1, 1) == 0
    # one rank: its own map only
    assert am.layer_bytes(QWEN3_30B, 1, 1, t, e, ep=1)["dispatch"] == 3 * t * 128
    assert "experts" not in am.layer_bytes(QWEN25_7B, 1, 1, t, e)


def test_a_moe_model_at_tp2_holds_half_the_sequence_outside_attention_and_the_mlp():
    """Sequence parallelism (a MoE model at tp > 1): the norms, the linears' inputs, the router, the dispatcher's
    gathered tokens and a full-recompute checkpoint are per token of the rank's half; the attention between the
    column- and row-parallel linears is split by heads as without it; the logits are whole sequences. A dense
    model at tp 2 keeps its norms whole."""
    t, e = 4096, 2
    one = am.layer_bytes(QWEN3_30B, 1, 1, t, e, ep=8, etp=1)
    two = am.layer_bytes(QWEN3_30B, 2, 1, t, e, ep=8, etp=2)
    for key in ("norms", "linear_inputs", "router"):
        assert two[key] == one[key] / 2, key
    # T/2 tokens gathered over twice the ranks: T·k routed tokens as at tp 1, their FFN width split by etp
    assert two["experts"] == t * 8 * (8 + 2 + e * 2048 + 6 * e * 768 // 2)
    assert two["scores"] == one["scores"] / 2  # heads split
    full = am.layer_bytes(QWEN3_30B, 2, 1, t, e, "full")["layer_input"]
    assert full == e * t // 2 * 2048 + 4 * t * 128
    head1, head2 = am.head_bytes(QWEN3_30B, 1, 1, t, e), am.head_bytes(QWEN3_30B, 2, 1, t, e)
    logits = 6 * t * QWEN3_30B.vocab
    assert head2 == pytest.approx((head1 - logits) / 2 + logits / 2)
    dense = am.layer_bytes(QWEN25_7B, 2, 1, t, e)
    assert dense["norms"] == am.layer_bytes(QWEN25_7B, 1, 1, t, e)["norms"]


def test_a_forward_only_role_counts_its_whole_logits():
    """The reference's forward holds one layer at a time but the whole head: the 7B at tp 2, 8 rows of 4096 tokens
    has ~14 GiB of logits (16-bit and the float32 copy over 152064 / 2 columns), not a layer's share of them."""
    rows, seq, tp = 8, 4096, 2
    fwd = forward_activation_bytes(QWEN25_7B, tp, rows, seq, 2)
    logits = 6 * rows * seq * QWEN25_7B.vocab // tp
    assert logits / GIB == pytest.approx(13.9, abs=0.1) and fwd > logits
    layer = sum(am.layer_bytes(QWEN25_7B, tp, rows, seq, 2).values())
    assert fwd == pytest.approx(layer + am.head_bytes(QWEN25_7B, tp, rows, seq, 2))


def test_routing_replay_counts_its_routes_beside_each_forward():
    """r2/r3 keep a micro-batch's routes (int16, every MoE layer) and each local layer's int64 targets until the
    backward: at pp 2 and one row of 8192 tokens, 2 x 8192 x 8 x (2 x 48 + 8 x 24) bytes, ~38 MB."""
    from rollhpc.parallel import ParallelLayout
    from rollhpc.workers.megatron_policy_spec import MegatronTrainWorkerSpec

    layout = ParallelLayout(world=16, tp=1, pp=2, ep=8)
    memory = {
        replay: MegatronTrainWorkerSpec.gpu_memory(
            MegatronTrainWorkerSpec.Options(model_dir="", micro_batch_size=1, router_replay=replay),
            layout,
            QWEN3_30B,
            seq_len=8192,
            gpu_bytes=80e9,
        )
        for replay in ("none", "r3")
    }
    routes = 2 * 8192 * 8 * (2 * 48 + 8 * 24)
    for part in ("activations", "forward_activations"):
        assert memory["r3"][part] - memory["none"][part] == routes


def test_vllm_keeps_its_tp_buffers_and_cuda_graphs_asleep():
    """At TP > 1 the engine's communication buffers, and with CUDA graphs their pool, are parts of their own that the
    plan keeps in every stage (sleep frees only weights and KV cache); the awake engine still fills its share."""
    from rollhpc.workers.vllm_generate import VllmGenerateWorker

    def parts(**kw):
        options = VllmGenerateWorker.Options(
            model_dir="unused", dtype="bfloat16", gpu_memory_utilization=0.5, **kw
        )
        return VllmGenerateWorker.gpu_memory(options, None, QWEN25_7B, seq_len=4096, gpu_bytes=80e9)

    tp2, tp1, eager = parts(tensor_parallel_size=2), parts(), parts(enforce_eager=True)
    assert tp2["driver_buffers"] > 0 and "driver_buffers" not in tp1 and "cuda_graphs" not in eager
    # all of it inside gpu_memory_utilization
    assert sum(tp2.values()) == pytest.approx(0.5 * 80e9 * 2)


def test_startup_builds_generators_first_beside_what_earlier_roles_keep():
    """Roles build in turns (controller.startup's order: vLLM, which measures the free memory, first, then the
    config's order): the engine with its whole budget; the trainer then loads beside what the sleeping engine keeps;
    the reference after the trainer offloaded. Activations are not held at start."""
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.controller.startup import startup_turns

    cfg = load_experiment("qwen2.5-7b_grpo", [])
    order = startup_order(cfg)
    assert (
        [r for r in order if r != "reward"]
        == [r for turn in startup_turns(cfg.roles) for r in turn if r != "reward"]
        == ["generate", "train", "reference"]
    )
    parts = {
        "train": {"parameters": 10.0, "gradients": 20.0, "optimizer": 30.0, "activations": 99.0},
        "reference": {"parameters": 10.0, "activations": 99.0},
        "generate": {"weights": 10.0, "kv_cache": 40.0, "driver_buffers": 1.0, "cuda_graphs": 0.5},
    }
    order = ["generate", "train", "reference"]
    # the trainer's build beside the asleep engine
    assert startup_bytes(parts, order, base=2.0) == 2.0 + 1.5 + 60.0
    assert startup_bytes(parts, ["generate"], base=2.0) == 2.0 + 51.5


def test_plan_counts_weight_sync_buckets_and_the_startup_stage(tmp_path):
    """qwen2.5-7b_grpo at its shipped settings (the shape from rollhpc's table): trainer rank 0's GPU holds two
    slots, each the largest tensor (the 1 GiB embedding, above the 512 MiB buckets), the tensor being packed and
    generator 0's copy over CUDA IPC; each NCCL receiver's first GPU two buckets; every colocated GPU has a
    start-up stage; the shipped config fits its 80 GB GPUs."""
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.placement.device_mapping import plan_world

    cfg = load_experiment("qwen2.5-7b_grpo", [])
    memory = estimate(cfg, plan_world(cfg))
    memory.check()
    assert any("from rollhpc's table" in line for line in memory.unknown)
    embedding = 2.0 * QWEN25_7B.vocab * QWEN25_7B.hidden
    by_bytes = {g.sync_buckets: g for g in memory.groups if g.parts}
    assert set(by_bytes) == {0.0, 4 * embedding, 2 * embedding}
    home, receivers, plain = by_bytes[4 * embedding], by_bytes[2 * embedding], by_bytes[0.0]
    assert [gpu[1:] for gpu in home.gpus] == [(0, 0)]
    assert {gpu[1:] for gpu in receivers.gpus} == {(n, p) for n in (0, 1) for p in (0, 2, 4, 6)} - {
        (0, 0)
    }
    assert home.stages["weight_sync"] - plain.stages["weight_sync"] == pytest.approx(4 * embedding)
    assert list(home.stages)[0] == "startup" and home.stages["startup"] < home.resident
