"""The Hugging Face <-> megatron weight map of a Qwen2-family checkpoint, as plain data: no megatron import, so
the checkpoint converter, the model loader and the exporter share it.

Supported ``model_type``: ``qwen2`` (dense), ``qwen2_moe`` (routed experts plus one shared expert with a
sigmoid gate), ``qwen3`` and ``qwen3_moe`` (q/k RMSNorm per head, no qkv bias, no shared expert) and
``llama`` (no biases); ``check_hf_config`` names what else is refused.

``weight_map`` gives one ``WeightMapping`` per megatron parameter, naming its HF source tensors and a layout;
``shard_hf_weight`` cuts one TP rank's shard for a layout and ``unshard_to_hf`` is its inverse. Layouts:

=============  ==============================================  ===========================================
layout         HF source                                       megatron tensor on TP rank r of t
=============  ==============================================  ===========================================
replicated     RMSNorm weights, q/k norms, MoE router          the whole tensor
               (``mlp.gate``), shared-expert gate
vocab          embed_tokens / lm_head ``[V, H]``               rows ``[r*Vp/t, (r+1)*Vp/t)`` of the vocab
                                                               padded with zero rows to ``Vp``
qkv            q_proj, k_proj, v_proj weight (or bias)         megatron's fused QKV: per query group
                                                               ``[its nh/ng q heads; its k head; its v
                                                               head]``; rank r holds groups
                                                               ``[r*ng/t, (r+1)*ng/t)``
gate_up        gate_proj, up_proj ``[F, H]``                   ``[gate rows of shard r; up rows of shard r]``
row            o_proj ``[H, nh*d]``, down_proj ``[H, F]``      columns ``[r*K/t, (r+1)*K/t)`` (row-parallel)
=============  ==============================================  ===========================================

Routed experts (``mlp.experts.{e}.gate_proj/up_proj/down_proj``) use ``gate_up`` / ``row`` over the
expert-tensor-parallel group (``WeightMapping.expert``) instead of TP; expert-parallel rank k of ep
holds experts ``[k*E/ep, (k+1)*E/ep)``, named ``local_experts.{e - k*E/ep}`` in megatron. The shared
expert (``mlp.shared_expert.*`` -> ``mlp.shared_experts.*``) is an ordinary TP-sharded MLP.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

import torch

LAYOUTS = ("replicated", "vocab", "qkv", "gate_up", "row")


SUPPORTED_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
# a critic's scalar value head, a submodule of its last stage's chunk (rollhpc.workers.megatron_policy): trained and
# checkpointed with the model, but without a Hugging Face name (not loaded from, nor exported to, HF weights)
VALUE_HEAD = "value_head"
LORA_ATTRIBUTE = "lora"  # a transformer layer's LoRA adapters (rollhpc.models.lora): layer.lora


class _HasToDict(Protocol):
    """A transformers ``PretrainedConfig`` (or anything else that gives its config.json as a dict)."""

    def to_dict(self) -> dict[str, Any]: ...


# a config.json: as a dict, a transformers config, the file's path or its folder
HfConfigSource = Union[Mapping[str, object], str, Path, _HasToDict]


@dataclass(frozen=True)
class WeightMapping:
    megatron: str  # parameter name in megatron's GPTModel (local layer spec)
    hf: tuple[str, ...]  # source tensors in the HF checkpoint, in the order the layout fuses them
    layout: str  # one of LAYOUTS
    expert: bool = False  # a routed expert's weight: sharded over the expert-TP group instead of TP


@dataclass(frozen=True)
class Arch:
    """What the weight map depends on, read from ``config.json`` by ``hf_arch``."""

    num_layers: int
    tie_word_embeddings: bool
    qkv_bias: bool = True
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head
    num_experts: int = 0  # 0: a dense MLP in every layer
    shared_expert: bool = False  # Qwen2-MoE: one always-on expert scaled by a sigmoid gate


def _hf_dict(hf_config: HfConfigSource) -> dict[str, Any]:
    """config.json as a dict, from a dict, a transformers config, a config.json path or its folder."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        return json.loads((path / "config.json" if path.is_dir() else path).read_text())
    return hf_config.to_dict()


def hf_arch(hf_config: HfConfigSource) -> Arch:
    """The ``Arch`` of a config.json; raises ``NotImplementedError`` naming what is not supported."""
    cfg = _hf_dict(hf_config)
    kind = cfg.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if kind == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise NotImplementedError(
            "llama with attention_bias or mlp_bias is not supported (biases on o_proj/MLP)"
        )
    experts = 0
    if kind in MOE_MODEL_TYPES:
        # transformers 5 writes either
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        if experts < 1:
            raise NotImplementedError(
                f"{kind} with num_experts={experts}: a MoE config without experts"
            )
        if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
            raise NotImplementedError(
                f"{kind}: layers mixing dense MLPs and experts (mlp_only_layers="
                f"{cfg.get('mlp_only_layers')}, decoder_sparse_step="
                f"{cfg.get('decoder_sparse_step')}) are not supported"
            )
    qkv_bias = (
        bool(cfg.get("qkv_bias", True))
        if kind in ("qwen2", "qwen2_moe")
        else bool(cfg.get("attention_bias"))
    )
    return Arch(
        num_layers=int(cfg["num_hidden_layers"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        num_experts=experts,
        shared_expert=kind == "qwen2_moe"
        and int(cfg.get("shared_expert_intermediate_size") or 0) > 0,
    )


def weight_map(
    arch: Arch,
    *,
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | None = None,
    embedding: bool = True,
    output: bool = True,
) -> list[WeightMapping]:
    """Every megatron GPTModel parameter of ``arch`` and where it comes from in HF. By default the whole model; a
    pipeline stage / expert-parallel rank holds global ``layers`` (named ``decoder.layers.{position}``),
    global ``experts`` (named ``local_experts.{position}``), the word embeddings when ``embedding``
    (first stage) and the final norm (+ output layer) when ``output`` (last stage)."""
    layers = range(arch.num_layers) if layers is None else layers
    experts = range(arch.num_experts) if experts is None else experts
    m = []
    if embedding:
        m.append(
            WeightMapping(
                "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"
            )
        )
    for local, i in enumerate(layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{local}."
        m += _attention_weights(hf, mc, qkv_bias=arch.qkv_bias, qk_norm=arch.qk_norm)
        if arch.num_experts:
            m += _moe_weights(hf + "mlp.", mc + "mlp.", experts, shared_expert=arch.shared_expert)
        else:
            m += _mlp_weights(hf + "mlp.", mc + "mlp.")
    if output:
        m += _output_weights(arch.tie_word_embeddings, embedding)
    return m


def _attention_weights(hf: str, mc: str, *, qkv_bias: bool, qk_norm: bool) -> list[WeightMapping]:
    """A layer's input norm, attention and pre-MLP norm (``hf``/``mc``: the layer's HF / megatron prefix)."""
    attn = hf + "self_attn."
    m = [
        WeightMapping(
            mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"
        ),
        WeightMapping(
            mc + "self_attention.linear_qkv.weight",
            tuple(f"{attn}{p}_proj.weight" for p in "qkv"),
            "qkv",
        ),
    ]
    if qkv_bias:
        m.append(
            WeightMapping(
                mc + "self_attention.linear_qkv.bias",
                tuple(f"{attn}{p}_proj.bias" for p in "qkv"),
                "qkv",
            )
        )
    if qk_norm:
        m += [
            WeightMapping(
                f"{mc}self_attention.{p}_layernorm.weight",
                (f"{attn}{p}_norm.weight",),
                "replicated",
            )
            for p in "qk"
        ]
    return m + [
        WeightMapping(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        WeightMapping(
            mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "replicated"
        ),
    ]


def _mlp_weights(src: str, dst: str, expert: bool = False) -> list[WeightMapping]:
    """One SwiGLU MLP: HF's gate/up/down projections under ``src``, megatron's fc1/fc2 under ``dst``."""
    return [
        WeightMapping(
            dst + "linear_fc1.weight",
            (src + "gate_proj.weight", src + "up_proj.weight"),
            "gate_up",
            expert=expert,
        ),
        WeightMapping(dst + "linear_fc2.weight", (src + "down_proj.weight",), "row", expert=expert),
    ]


def _moe_weights(
    mlp: str, mc: str, experts: Sequence[int], *, shared_expert: bool
) -> list[WeightMapping]:
    """A MoE layer's router, its routed ``experts`` (global indices, named by position) and shared expert."""
    m = [WeightMapping(mc + "router.weight", (mlp + "gate.weight",), "replicated")]
    for le, e in enumerate(experts):
        m += _mlp_weights(f"{mlp}experts.{e}.", f"{mc}experts.local_experts.{le}.", expert=True)
    if shared_expert:
        m += _mlp_weights(mlp + "shared_expert.", mc + "shared_experts.")
        m.append(
            WeightMapping(
                mc + "shared_experts.gate_weight",
                (mlp + "shared_expert_gate.weight",),
                "replicated",
            )
        )
    return m


def _output_weights(tie_word_embeddings: bool, embedding: bool) -> list[WeightMapping]:
    """The last stage's final norm and output layer (``embedding``: the stage also holds the embedding)."""
    m = [WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")]
    if not tie_word_embeddings:
        m.append(WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    # tied, on a last pipeline stage without the embedding: megatron's copy of it
    elif not embedding:
        m.append(WeightMapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab"))
    return m


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def shard_hf_weight(
    layout: str,
    tensors: list[torch.Tensor],
    tp_rank: int,
    tp_size: int,
    *,
    num_query_groups: int = 0,
    padded_vocab: int = 0,
) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of the megatron tensor fused from ``tensors`` (the ``hf`` sources of
    one ``WeightMapping``, in order). ``qkv`` needs ``num_query_groups``; ``vocab`` needs ``padded_vocab``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")
    if layout == "replicated":
        return tensors[0]
    if layout == "row":
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if layout == "vocab":
        (w,) = tensors
        if padded_vocab < w.shape[0] or padded_vocab % tp_size:
            raise ValueError(
                f"padded vocab {padded_vocab} must be >= {w.shape[0]} and a multiple of tp={tp_size}"
            )
        # only this rank's rows, zero-padded past the real vocab (the padded whole is never built)
        start, end = tp_rank * padded_vocab // tp_size, (tp_rank + 1) * padded_vocab // tp_size
        real = w[min(start, w.shape[0]) : min(end, w.shape[0])]
        if real.shape[0] == end - start:
            return real
        return torch.cat([real, w.new_zeros(end - start - real.shape[0], *w.shape[1:])])
    if layout == "gate_up":
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    q, k, v = tensors  # [nh*d, ...], [ng*d, ...], [ng*d, ...]
    ng = num_query_groups
    if ng < 1 or ng % tp_size:
        raise ValueError(f"num_query_groups={ng} must be a positive multiple of tp={tp_size}")
    rest = q.shape[1:]
    # this rank's query groups only
    groups = slice(tp_rank * ng // tp_size, (tp_rank + 1) * ng // tp_size)
    fused = torch.cat([t.reshape(ng, -1, *rest)[groups] for t in (q, k, v)], dim=1)
    return fused.reshape(-1, *rest)


def unshard_to_hf(
    layout: str,
    shards: list[torch.Tensor],
    hf_names: tuple[str, ...] | list[str],
    *,
    num_query_groups: int = 0,
    num_attention_heads: int = 0,
    vocab_size: int = 0,
) -> dict[str, torch.Tensor]:
    """The inverse of ``shard_hf_weight``: the HF tensors ``{hf_name: tensor}`` of one megatron parameter,
    from its shards on every TP rank (``shards[r]`` from rank r; ``hf_names``: the mapping's ``hf``).
    ``qkv`` needs ``num_query_groups`` and ``num_attention_heads``; ``vocab`` needs ``vocab_size`` (the
    unpadded HF size: padding rows are dropped). ``replicated`` raises if the shards differ."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; layouts are {', '.join(LAYOUTS)}")
    names = tuple(hf_names)
    expected = 3 if layout == "qkv" else 2 if layout == "gate_up" else 1
    if len(names) != expected:
        raise ValueError(f"layout {layout!r} has {expected} HF tensor(s), got names {names}")
    if not shards:
        raise ValueError("no shards")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"shards differ in shape: {[tuple(s.shape) for s in shards]}")
    if layout == "replicated":
        if not all(torch.equal(shards[0], s) for s in shards[1:]):
            raise ValueError(f"{names[0]}: replicated shards differ across TP ranks")
        return {names[0]: shards[0]}
    if layout == "row":
        return {names[0]: torch.cat(shards, dim=1)}
    if layout == "vocab":
        full = torch.cat(shards, dim=0)
        if not 0 < vocab_size <= full.shape[0]:
            raise ValueError(
                f"vocab_size={vocab_size} must be in [1, padded vocab {full.shape[0]}]"
            )
        return {names[0]: full[:vocab_size]}
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {
            names[0]: torch.cat([g for g, _ in halves]),
            names[1]: torch.cat([u for _, u in halves]),
        }
    return _unshard_qkv(shards, names, num_query_groups, num_attention_heads)


def _unshard_qkv(
    shards: list[torch.Tensor], names: tuple[str, ...], ng: int, nh: int
) -> dict[str, torch.Tensor]:
    """q, k and v (``names``) from the shards of megatron's fused QKV (``ng`` query groups, ``nh`` heads)."""
    if ng < 1 or nh < 1 or nh % ng:
        raise ValueError(
            f"num_attention_heads={nh} must be a positive multiple of num_query_groups={ng}"
        )
    full = torch.cat(shards, dim=0)  # per group [q heads; k; v], groups in order across ranks
    rest = full.shape[1:]
    if full.shape[0] % (nh + 2 * ng):
        raise ValueError(
            f"fused qkv has {full.shape[0]} rows, not a multiple of nh + 2*ng = {nh + 2 * ng}"
        )
    d = full.shape[0] // (nh + 2 * ng)
    grouped = full.reshape(ng, (nh // ng + 2) * d, *rest)
    q, k, v = grouped.split([nh // ng * d, d, d], dim=1)
    return {
        names[0]: q.reshape(nh * d, *rest),
        names[1]: k.reshape(ng * d, *rest),
        names[2]: v.reshape(ng * d, *rest),
    }


def _rope_theta(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}  # transformers 5; 4.x: rope_theta + rope_scaling
    scaling = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise NotImplementedError(
            f"rope_type {kind!r}: only unscaled rotary embeddings are supported"
        )
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def check_hf_config(hf_config: HfConfigSource) -> Arch:
    """``hf_arch`` plus the other features this mapping refuses (sliding window, activations other than
    silu, scaled rope): ``NotImplementedError`` naming the first one found. Imports no megatron."""
    cfg = _hf_dict(hf_config)
    arch = hf_arch(cfg)
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(
            f"hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) MLPs are supported"
        )
    _rope_theta(cfg)
    return arch


def _split_expert_name(name: str) -> tuple[str, int, str]:
    """``model.layers.3.mlp.experts.5.up_proj.weight`` -> (``...experts.``, 5, ``.up_proj.weight``)."""
    head, _, rest = name.partition(".mlp.experts.")
    idx, _, tail = rest.partition(".")
    return f"{head}.mlp.experts.", int(idx), f".{tail}"
