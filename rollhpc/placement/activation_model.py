"""Activation bytes of megatron-core's local layer spec, op by op, as the memory plan counts them.

Why op by op: Korthikanti et al.'s 34·s·b·h + 5·a·s²·b describes a GELU MLP of width 4h with fused kernels and
16-bit softmax. The trainer builds megatron's *local* spec (plain PyTorch ops, no Transformer Engine), whose
RMSNorm keeps two float32 copies of its input, whose softmax runs in float32, whose SwiGLU MLP keeps five
16-bit tensors of the FFN width, and whose attention repeats the KV heads of a GQA model to every query head
before the score matmul. Each term below is a tensor autograd keeps, read off megatron-core 0.16.1 and
checked against the bytes ``bench/activation_bytes.py`` counts with saved-tensor hooks (bench/results/
activation_bytes.json: within 1.1% at 256-4096 tokens for the Qwen2.5-0.5B and 7B shapes, with SwiGLU and
GELU, GQA and full multi-head attention, each recompute mode, and Qwen3-30B-A3B's MoE layer).

Notation: T = s·b tokens of a micro-batch, e the activation dtype's bytes, q = heads·head_dim (the query
width), kv = kv_heads·head_dim, tp the tensor-parallel size. Everything between a column- and a row-parallel
linear is split by tp. A dense model runs without sequence parallelism: the norms and the inputs of the
column-parallel linears are whole on every TP rank. A MoE model at tp > 1 runs with it (megatron-core's MoE
layers need it, rollhpc.models.megatron_gpt): those, the router, the dispatcher's inputs and a full-recompute
checkpoint hold T/tp tokens (``local_tokens``); the logits are whole sequences again.
"""

from __future__ import annotations

from typing import Protocol

RECOMPUTE_MODES = ("none", "selective", "full")
NORM_FP32_COPIES = 8  # bytes per element: RMSNorm's float32 input and its float32 normalized input
LOGITS_BYTES = 6  # per token and vocabulary column: the 16-bit logits and the loss head's float32 copy (in place)


class LayerShape(Protocol):
    """The model dimensions the activations depend on (``memory_plan.ModelShape`` has them)."""

    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # a dense MLP's width
    gated: bool  # a SwiGLU MLP; False: a plain GELU MLP
    qk_norm: bool
    experts: int  # routed experts per MoE layer (0: dense)
    topk: int
    moe_intermediate: int
    shared_intermediate: int


def local_tokens(shape: LayerShape, tp: int, tokens: int) -> int:
    """A TP rank's share of ``tokens`` outside attention and the MLP: 1/tp of them for a MoE model (which runs
    sequence parallelism at tp > 1), all of them for a dense one."""
    return -(-tokens // tp) if shape.experts else tokens


def _kv_local(shape: LayerShape, tp: int) -> int:
    """KV width on one TP rank: megatron replicates KV heads when tp exceeds them."""
    return max(shape.kv_heads, tp) * shape.head_dim // tp


def _mlp_bytes(
    shape: LayerShape, tokens: int, e: int, tp: int, ep: int, etp: int
) -> dict[str, float]:
    """The MLP's saved tensors: a dense gated MLP keeps fc1's output (2f), silu's output and the product (fc2's
    input) = 5·e·T·f; a GELU MLP keeps fc1's output and GELU's = 2·e·T·f. A MoE layer: the router's top-k, the
    dispatcher's routing map, each routed token's expert tensors (``moe_bytes``), the shared expert as a dense
    MLP."""
    per_f = 5 if shape.gated else 2
    if not shape.experts:
        return {"mlp": float(per_f * e * tokens * shape.intermediate // tp)}
    out = moe_bytes(shape, local_tokens(shape, tp, tokens), e, ep, etp)
    if shape.shared_intermediate:
        # + its gate
        out["mlp"] = float(per_f * e * tokens * shape.shared_intermediate // tp + e * tokens)
    return out


def moe_bytes(shape: LayerShape, tokens: int, e: int, ep: int, etp: int) -> dict[str, float]:
    """A MoE layer with megatron's all-gather token dispatcher (``moe_token_dispatcher_type="allgather"``, the one
    rollhpc.models.megatron_gpt builds: the all-to-all one needs CUDA streams). The dispatcher all-gathers the
    tokens, routing map and probabilities of the expert-TP x EP group (n = etp·ep ranks) and keeps the tokens
    routed to this rank's E/ep experts: on average T·k·etp of them (T·n gathered, k of E experts each). Kept:

    * router: per token its top-k indices (int64) and scores (float32), 12·T·k (its input is ``linear_inputs``);
    * dispatch: the local experts' columns of the gathered routing map (bool) and probabilities (16-bit),
      3·T·n·E/ep;
    * experts: per routed token its index (int64), its probability (16-bit), its input (e·h) and the FFN's
      tensors: fc1's output, the activation's, the product, and the product scaled by the probability (megatron
      applies the probabilities inside the experts), (5 + 1)·e·f/etp gated, (2 + 1)·e·f/etp with GELU.

    At n = 1 (one process, bench/activation_bytes.py's Qwen3-30B-A3B layer) these are the measured bytes; the
    gathered sizes at n > 1 follow the dispatcher's code (no multi-rank measurement)."""
    n = etp * ep
    routed = tokens * shape.topk * etp
    ffn = ((5 if shape.gated else 2) + 1) * e * shape.moe_intermediate // etp
    return {
        "router": float(12 * tokens * shape.topk),
        "dispatch": float(3 * tokens * n * (shape.experts // ep)),
        "experts": float(routed * (8 + 2 + e * shape.hidden + ffn)),
    }


def dispatch_buffer_bytes(shape: LayerShape, tokens: int, e: int, ep: int, etp: int) -> float:
    """The all-gather dispatcher's transients, once per stage (one layer runs at a time): the gathered hidden
    states (megatron's global buffer, reused by every layer) and the unpermuted output of the same size that is
    reduce-scattered back, 2·e·T·n·h. Nothing without experts or with n = 1."""
    n = etp * ep
    return float(2 * e * tokens * n * shape.hidden) if shape.experts and n > 1 else 0.0


def layer_bytes(
    shape: LayerShape,
    tp: int,
    rows: int,
    seq: int,
    e: int,
    recompute: str = "none",
    *,
    ep: int = 1,
    etp: int = 1,
) -> dict[str, float]:
    """One transformer layer's kept activations on a TP rank, op by op (bytes), for a micro-batch of ``rows``
    rows of ``seq`` tokens with ``e``-byte activations. ``recompute``: "selective" keeps the core attention's
    inputs (rotated q and k, the fused qkv output v is a view of) instead of its tensors and scores; "full"
    keeps only the layer's input (megatron checkpoints each layer whole)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    t = rows * seq
    local = local_tokens(shape, tp, t)  # tokens outside attention and the MLP
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, _kv_local(shape, tp) * tp
    # the checkpoint keeps the layer's input and the float32 rotary frequencies
    if recompute == "full":
        return {"layer_input": float(e * local * h + 4 * seq * shape.head_dim)}
    out = {
        "norms": float(2 * (NORM_FP32_COPIES * local * h + 4 * local)),
        # qkv's input and fc1's (or the router's); under sequence parallelism the rank's part, gathered again in
        # the backward
        "linear_inputs": float(2 * e * local * h),
        "rope": float(4 * e * seq * shape.head_dim),
    }  # cos and sin for q and k, one row's worth
    if shape.qk_norm:  # Qwen3: per-head RMSNorm of q and k, the same float32 copies
        out["qk_norm"] = float(NORM_FP32_COPIES * t * (q + kv) // tp)
    qkv_out = e * t * (q + 2 * kv) // tp
    # rotated q, rotated (unrepeated) k, the qkv output; the proj's input
    if recompute == "selective":
        out["attention"] = float(
            e * t * q // tp + e * t * _kv_local(shape, tp) + qkv_out + e * t * q // tp
        )
    else:
        out.update(core_attention_bytes(shape, tp, rows, seq, e))
    out.update(_mlp_bytes(shape, t, e, tp, ep, etp))
    return out


def core_attention_bytes(
    shape: LayerShape, tp: int, rows: int, seq: int, e: int
) -> dict[str, float]:
    """The unfused core attention and the output projection's input: q, k and v at every query head (GQA's KV
    heads repeated; without GQA v stays a view of the fused qkv output, which is then kept whole), the proj's
    input, and the scores: softmax's float32 output and its 16-bit copy the value matmul keeps, (4 + e)·a·s²·b."""
    t = rows * seq
    q, kv = shape.heads * shape.head_dim, _kv_local(shape, tp) * tp
    v = e * t * q // tp if shape.kv_heads < shape.heads else e * t * (q + 2 * kv) // tp
    return {
        "attention": float(3 * e * t * q // tp + v),
        "scores": float((4 + e) * (shape.heads // tp) * seq * seq * rows),
    }


def head_bytes(shape: LayerShape, tp: int, rows: int, seq: int, e: int) -> float:
    """The last stage's head: the final norm's float32 copies, the output layer's input, and the logits (16-bit,
    then the loss head's float32 copy, reused in place for the gradient: rollhpc.models.vocab_parallel), the
    vocabulary split over TP."""
    t = rows * seq
    local = local_tokens(shape, tp, t)
    return float(
        NORM_FP32_COPIES * local * shape.hidden
        + 4 * local
        + e * local * shape.hidden
        + LOGITS_BYTES * t * -(-shape.vocab // tp)
    )


def transient_bytes(
    shape: LayerShape,
    tp: int,
    rows: int,
    seq: int,
    e: int,
    recompute: str,
    *,
    ep: int = 1,
    etp: int = 1,
) -> float:
    """What a backward re-materializes one layer at a time beyond what is kept: "full" recomputes a whole layer,
    "selective" its core attention; plus the MoE dispatcher's buffers."""
    extra = dispatch_buffer_bytes(shape, local_tokens(shape, tp, rows * seq), e, ep, etp)
    if recompute == "full":
        extra += sum(layer_bytes(shape, tp, rows, seq, e, "none", ep=ep, etp=etp).values())
    elif recompute == "selective":
        extra += sum(core_attention_bytes(shape, tp, rows, seq, e).values())
    return extra
