"""A megatron-core ``GPTModel`` that is the same network as a Hugging Face Qwen2-family checkpoint.

Supported ``model_type``: ``qwen2`` (dense), ``qwen2_moe`` (routed experts plus one shared expert with a
sigmoid gate), ``qwen3`` and ``qwen3_moe`` (q/k RMSNorm per head, no qkv bias, no shared expert) and
``llama`` (no biases). Steps, each usable alone:

* ``transformer_config_from_hf(hf_config, tp)``: the ``TransformerConfig`` of a ``config.json``:
  grouped-query attention (``num_query_groups``), bias on q/k/v only (``add_qkv_bias``, no other linear
  bias), RMSNorm, SwiGLU MLP (``gated_linear_unit`` + silu), no dropout, unfused kernels (local spec);
  for MoE: top-k softmax router (renormalised over the chosen experts when ``norm_topk_prob``), no
  auxiliary loss, the "allgather" token dispatcher (the "alltoall" one needs CUDA streams).
* ``build_gpt_model(hf_config, ...)``: the ``GPTModel`` on megatron's local (non-Transformer-Engine)
  layer spec, rotary embeddings with the checkpoint's ``rope_theta``, tied or untied embeddings, vocab
  padded like megatron pads it (``padded_vocab_size``); pipeline/expert parallel sizes from the
  initialized ``parallel_state``. Call after ``initialize_model_parallel`` and
  ``model_parallel_cuda_manual_seed`` (on CPU, after ``megatron_cpu.enable_cpu_megatron()``).
* ``load_hf_weights(model, hf_state_dict, tp_rank, tp_size)``: copies this rank's shard of every HF
  tensor into the model (its pipeline stage's layers, its expert-parallel rank's experts). The state
  dict may be any ``Mapping`` (e.g. one that reads tensors lazily off disk): one entry is read at a time.
* ``export_hf_weights(model, vocab_size)``: the inverse, for weight sync to an HF-named generator (vLLM)
  and checkpoint conversion: inside the running TP group (and expert-TP / expert-parallel groups for
  MoE), all-gathers one parameter at a time and yields ``(hf_name, full tensor)`` on TP rank 0
  (``unshard_to_hf`` is the pure, per-parameter inverse of ``shard_hf_weight``).

The HF -> megatron map is plain data (``weight_map``: one ``WeightMapping`` per megatron parameter
naming its HF source tensors and a layout) and ``shard_hf_weight`` cuts one rank's shard for a layout;
neither imports megatron, so the checkpoint converter reuses both. Layouts:

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

Left for later: MoE models mixing dense and MoE layers (``mlp_only_layers``, ``decoder_sparse_step``
> 1), sliding-window attention, rope scaling (rope_type other than "default"), sequence parallelism.
Pipeline parallelism: ``build_gpt_model``/``load_hf_weights`` place each stage's (and virtual stage's)
layers; ``export_hf_weights`` gathers within one stage (``megatron_pipeline.export_pipeline_hf_weights``
streams every stage's). Padded vocab rows are zero: their logits (``[..., vocab_size:]``) are not
part of the HF model and must be left out of comparisons and, for exact HF log-probs, out of the softmax.

Longer than our ~600-line rule on purpose: the model's construction and its Hugging Face name map (dense,
MoE, tied or not, per TP/PP/EP shard) must agree tensor for tensor, and are kept side by side for that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LAYOUTS = ("replicated", "vocab", "qkv", "gate_up", "row")


SUPPORTED_MODEL_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
# a critic's scalar value head, a submodule of its last stage's chunk (rollhpc.workers.megatron_policy): trained and
# checkpointed with the model, but without a Hugging Face name (not loaded from, nor exported to, HF weights)
VALUE_HEAD = "value_head"
LORA_ATTRIBUTE = "lora"  # a transformer layer's LoRA adapters (rollhpc.models.lora): layer.lora


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


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    """config.json as a dict, from a dict, a transformers config, a config.json path or its folder."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        return json.loads((path / "config.json" if path.is_dir() else path).read_text())
    return hf_config.to_dict()


def hf_arch(hf_config: Any) -> Arch:
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
    num_layers: int,
    tie_word_embeddings: bool,
    *,
    qkv_bias: bool = True,
    qk_norm: bool = False,
    num_experts: int = 0,
    shared_expert: bool = False,
    layers: Sequence[int] | None = None,
    experts: Sequence[int] | None = None,
    embedding: bool = True,
    output: bool = True,
) -> list[WeightMapping]:
    """Every megatron GPTModel parameter and where it comes from in HF. By default the whole model; a
    pipeline stage / expert-parallel rank holds global ``layers`` (named ``decoder.layers.{position}``),
    global ``experts`` (named ``local_experts.{position}``), the word embeddings when ``embedding``
    (first stage) and the final norm (+ output layer) when ``output`` (last stage)."""
    layers = range(num_layers) if layers is None else layers
    experts = range(num_experts) if experts is None else experts
    m = []
    if embedding:
        m.append(
            WeightMapping(
                "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"
            )
        )
    for local, i in enumerate(layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{local}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        m += [
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
        m += [
            WeightMapping(
                mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"
            ),
            WeightMapping(
                mc + "pre_mlp_layernorm.weight",
                (hf + "post_attention_layernorm.weight",),
                "replicated",
            ),
        ]
        if not num_experts:
            m += [
                WeightMapping(
                    mc + "mlp.linear_fc1.weight",
                    (mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                    "gate_up",
                ),
                WeightMapping(mc + "mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "row"),
            ]
            continue
        m.append(WeightMapping(mc + "mlp.router.weight", (mlp + "gate.weight",), "replicated"))
        for le, e in enumerate(experts):
            src, dst = f"{mlp}experts.{e}.", f"{mc}mlp.experts.local_experts.{le}."
            m += [
                WeightMapping(
                    dst + "linear_fc1.weight",
                    (src + "gate_proj.weight", src + "up_proj.weight"),
                    "gate_up",
                    expert=True,
                ),
                WeightMapping(
                    dst + "linear_fc2.weight", (src + "down_proj.weight",), "row", expert=True
                ),
            ]
        if shared_expert:
            src, dst = mlp + "shared_expert.", mc + "mlp.shared_experts."
            m += [
                WeightMapping(
                    dst + "linear_fc1.weight",
                    (src + "gate_proj.weight", src + "up_proj.weight"),
                    "gate_up",
                ),
                WeightMapping(dst + "linear_fc2.weight", (src + "down_proj.weight",), "row"),
                WeightMapping(
                    dst + "gate_weight", (mlp + "shared_expert_gate.weight",), "replicated"
                ),
            ]
    if output:
        m.append(
            WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
        )
        if not tie_word_embeddings:
            m.append(WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
        # tied, on a last pipeline stage without the embedding: megatron's copy of it
        elif not embedding:
            m.append(WeightMapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab"))
    return m


def arch_weight_map(arch: Arch, **part: Any) -> list[WeightMapping]:
    """``weight_map`` of an ``Arch``; ``part`` as in ``weight_map`` (layers, experts, embedding, output)."""
    return weight_map(
        arch.num_layers,
        arch.tie_word_embeddings,
        qkv_bias=arch.qkv_bias,
        qk_norm=arch.qk_norm,
        num_experts=arch.num_experts,
        shared_expert=arch.shared_expert,
        **part,
    )


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
    ng, nh = num_query_groups, num_attention_heads
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


def check_hf_config(hf_config: Any) -> Arch:
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


def transformer_config_from_hf(
    hf_config: Any, tp: int = 1, *, params_dtype: torch.dtype = torch.float32, **overrides: Any
):
    """megatron's ``TransformerConfig`` for a ``config.json`` at tensor-parallel size ``tp``.
    ``overrides`` go to ``TransformerConfig`` last (e.g. ``recompute_granularity``,
    ``expert_model_parallel_size``, ``pipeline_model_parallel_size``)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    cfg = _hf_dict(hf_config)
    arch = check_hf_config(cfg)
    heads = cfg["num_attention_heads"]
    kw: dict[str, Any] = dict(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        tensor_model_parallel_size=tp,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        hidden_dropout=0.0,
        attention_dropout=cfg.get("attention_dropout", 0.0),
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # The local spec runs plain PyTorch ops: every fused kernel off.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if arch.num_experts:
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch.shared_expert else 0
        kw.update(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_router_topk=cfg["num_experts_per_tok"],
            # HF: softmax over all experts, top-k, then renormalised if norm_topk_prob. megatron without
            # pre-softmax takes the top-k logits and softmaxes those: the same renormalised weights.
            moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_shared_expert_intermediate_size=shared or None,
            moe_shared_expert_gate=bool(shared),
        )
    kw.update(overrides)
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        kw.setdefault("pipeline_dtype", params_dtype)
    return TransformerConfig(**kw)


def _parallel_sizes() -> dict[str, int]:
    """pp/ep/etp sizes of the initialized megatron parallel state (all 1 when it is not initialized)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {}
    sizes = dict(
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(),
    )
    if ps.get_virtual_pipeline_model_parallel_world_size():
        sizes["virtual_pipeline_model_parallel_size"] = (
            ps.get_virtual_pipeline_model_parallel_world_size()
        )
    return sizes


def recompute_overrides(kind: str) -> dict[str, Any]:
    """megatron's ``TransformerConfig`` settings for activation recomputation: ``none``, ``selective`` (attention's
    core, the score matrices) or ``full`` (every layer from its input, one layer per checkpoint)."""
    if kind == "none":
        return {}
    if kind == "selective":
        return {"recompute_granularity": "selective"}
    if kind == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    raise ValueError(f"recompute must be none, selective or full, got {kind!r}")


def build_gpt_model(
    hf_config: Any,
    tp: int | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    vocab_divisible_by: int = 128,
    padded_vocab: int | None = None,
    vp_stage: int | None = None,
    **overrides: Any,
):
    """megatron-core ``GPTModel`` with the architecture of ``hf_config``. ``tp`` defaults to the
    tensor-parallel size of the initialized model-parallel state (pipeline, virtual-pipeline and
    expert-parallel sizes always come from it). ``parallel_output=False`` gathers the logits over TP ranks
    (``[b, s, padded_vocab]`` on every rank). ``padded_vocab`` replaces megatron's padding (e.g. to load
    a checkpoint saved at another TP size: it must be a multiple of ``tp``). With virtual pipeline stages
    (``vpp``) a rank holds one model chunk per ``vp_stage`` in ``range(vpp)``: build each with its index."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _hf_dict(hf_config)
    arch = hf_arch(cfg)
    if arch.num_experts:
        _patch_router_without_te()
    tp = parallel_state.get_tensor_model_parallel_world_size() if tp is None else tp
    sizes = _parallel_sizes()
    # a dense model ignores the expert grid (megatron refuses ep > 1 without experts)
    if not arch.num_experts:
        sizes = {k: v for k, v in sizes.items() if not k.startswith("expert_")}
    config = transformer_config_from_hf(
        cfg, tp, params_dtype=params_dtype, **{**sizes, **overrides}
    )
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    if (vpp is None) != (vp_stage is None) or (vpp is not None and not 0 <= vp_stage < vpp):
        raise ValueError(
            f"vp_stage={vp_stage} with virtual pipeline size {vpp}: give a chunk index in "
            "range(vpp) exactly when the parallel state has virtual pipeline stages"
        )
    vocab = padded_vocab or padded_vocab_size(cfg["vocab_size"], tp, vocab_divisible_by)
    if vocab < cfg["vocab_size"] or vocab % tp:
        raise ValueError(
            f"padded vocab {vocab} must be >= vocab_size {cfg['vocab_size']} and a multiple of tp={tp}"
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=arch.num_experts or None, normalization="RMSNorm", qk_layernorm=arch.qk_norm
        ),
        vocab_size=vocab,
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        pre_process=pp == 1
        or parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=pp == 1
        or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(cfg),
        vp_stage=vp_stage,
    )


def _patch_router_without_te() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm is not None``, a name it only defines
    when Transformer Engine imports: without TE the router's forward raises NameError. Define it as None
    (megatron's own fallback then runs: a plain matmul)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _group_coords(group: Any) -> tuple[int, int]:
    """(rank, size) in a process group; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _moe_experts(model: torch.nn.Module) -> Any:
    """The experts module of the model's first MoE layer (every layer is one), or None for dense models."""
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            return experts
    return None


def _hf_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters that have Hugging Face counterparts: all but a critic's value head and LoRA
    adapters (``rollhpc.models.lora``: exported on their own, under PEFT's names)."""
    return {
        n: p
        for n, p in model.named_parameters()
        if not n.startswith(VALUE_HEAD + ".") and f".{LORA_ATTRIBUTE}." not in n
    }


def model_weight_map(model: torch.nn.Module) -> tuple[list[WeightMapping], list[WeightMapping]]:
    """(this rank's map, the whole model's map) for a model built by ``build_gpt_model``: this pipeline
    stage's layers, embedding and output, this expert-parallel rank's experts."""
    c = model.config
    layers = [layer.layer_number - 1 for layer in model.decoder.layers]
    arch = Arch(
        num_layers=c.num_layers,
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        qkv_bias=bool(c.add_qkv_bias),
        qk_norm=bool(c.qk_layernorm),
        num_experts=c.num_moe_experts or 0,
        shared_expert=bool(c.moe_shared_expert_intermediate_size),
    )
    experts = None
    if arch.num_experts:
        moe = next((layer.mlp for layer in model.decoder.layers), None)
        experts = list(moe.local_expert_indices) if moe is not None else []
    local = arch_weight_map(
        arch,
        layers=layers,
        experts=experts,
        embedding=bool(model.pre_process),
        output=bool(model.post_process),
    )
    return local, arch_weight_map(arch)


def load_hf_weights(
    model: torch.nn.Module,
    hf_state_dict: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp_size: int,
    *,
    etp_rank: int | None = None,
    etp_size: int | None = None,
) -> None:
    """Copy TP rank ``tp_rank``'s shard of every HF tensor into ``model`` (built by ``build_gpt_model``).
    Routed experts are cut for the expert-TP rank (default: the model's expert-TP group). Raises if a
    megatron parameter has no source, a shape differs, or an HF tensor belongs to no parameter of the
    model (``lm_head.weight`` of a tied checkpoint is ignored). Reads ``hf_state_dict[name]`` once per
    use, one parameter at a time."""
    config = model.config
    params = _hf_params(model)
    table, whole = model_weight_map(model)
    missing = set(params) - {w.megatron for w in table}
    if missing:
        raise KeyError(f"megatron parameters without an HF source: {sorted(missing)}")
    if etp_rank is None or etp_size is None:
        experts = _moe_experts(model)
        etp_rank, etp_size = _group_coords(experts.tp_group) if experts is not None else (0, 1)
    absent = sorted(n for w in table for n in w.hf if n not in hf_state_dict)
    if absent:
        raise KeyError(
            f"HF checkpoint lacks {len(absent)} tensor(s): {absent[:8]}{' ...' if len(absent) > 8 else ''}"
        )
    expected = {n for w in whole for n in w.hf} | (
        {"lm_head.weight"} if model.share_embeddings_and_output_weights else set()
    )
    unused = sorted(
        n for n in hf_state_dict if n not in expected and not n.endswith("rotary_emb.inv_freq")
    )
    if unused:
        raise KeyError(
            f"HF tensors with no megatron parameter: {unused[:8]}{' ...' if len(unused) > 8 else ''}"
        )
    with torch.no_grad():
        for w in table:
            rank, size = (etp_rank, etp_size) if w.expert else (tp_rank, tp_size)
            sources = [hf_state_dict[n] for n in w.hf]
            shard = shard_hf_weight(
                w.layout,
                sources,
                rank,
                size,
                num_query_groups=config.num_query_groups,
                padded_vocab=model.vocab_size,
            )
            param = params[w.megatron]
            if shard.shape != param.shape:
                raise ValueError(
                    f"{w.megatron}: shard of {w.hf} (shapes {[tuple(t.shape) for t in sources]}) has "
                    f"shape {tuple(shard.shape)}, the model expects {tuple(param.shape)}"
                )
            param.copy_(shard)
            del sources, shard


def _gather(local: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    if size == 1:
        return [local]
    local = local.contiguous()
    shards = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shards, local, group=group)
    return shards


def export_hf_weights(
    model: torch.nn.Module, vocab_size: int, tp_group: Any = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF tensor of ``model`` (built by ``build_gpt_model``), gathered
    over the tensor-parallel group (default: megatron's ``parallel_state`` TP group; without an
    initialized ``torch.distributed`` or at TP size 1 nothing is gathered). ``vocab_size``: the HF
    (unpadded) vocab size, from ``config.json``. MoE: routed experts are gathered over the model's
    expert-TP group, then over its expert-parallel group (every expert comes out once).

    Collective: every TP rank (for MoE with ep > 1: every rank of the expert-parallel group too) must
    iterate this generator to the end, in step (it all-gathers one parameter per step); only TP rank 0
    (for MoE: TP rank 0 of expert-parallel rank 0) yields, the other ranks yield nothing. Memory stays bounded by one
    parameter's full tensor(s) (times ep for routed experts): each is gathered, unsharded, yielded and
    dropped before the next. Yielded tensors are detached, fresh (not views of the model's parameters when
    TP > 1; at TP 1 the non-fused ones may share storage with them: copy before the next optimizer step if
    kept). Tied embeddings: ``lm_head.weight`` is not yielded (HF ties it to ``model.embed_tokens.weight``).
    One pipeline stage's tensors only."""
    import torch.distributed as dist

    if tp_group is None and dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_rank, tp_size = _group_coords(tp_group)
    experts = _moe_experts(model)
    etp_group, ep_group = (
        (experts.tp_group, experts.ep_group) if experts is not None else (None, None)
    )
    etp_rank, etp_size = _group_coords(etp_group)
    ep_rank, ep_size = _group_coords(ep_group)
    config = model.config
    params = _hf_params(model)
    table, _ = model_weight_map(model)
    missing = set(params) - {w.megatron for w in table}
    if missing:
        raise KeyError(f"megatron parameters without an HF name: {sorted(missing)}")
    per_rank = len(experts.local_experts) if experts is not None else 0
    kw = dict(
        num_query_groups=config.num_query_groups,
        num_attention_heads=config.num_attention_heads,
        vocab_size=vocab_size,
    )
    for w in table:
        if getattr(params[w.megatron], "shared", False):
            continue  # the last pipeline stage's copy of a tied embedding: the first stage exports it
        local = params[w.megatron].detach()
        if not w.expert:
            shards = _gather(local, tp_group, tp_size)
            if tp_rank == 0 and ep_rank == 0:
                yield from unshard_to_hf(w.layout, shards, w.hf, **kw).items()
            del shards, local
            continue
        full = unshard_to_hf(w.layout, _gather(local, etp_group, etp_size), w.hf, **kw)
        for name, tensor in full.items():
            gathered = _gather(tensor, ep_group, ep_size)
            if tp_rank == 0 and ep_rank == 0:
                # name carries this rank's global expert index; rank k's copy is that index + (k - ep_rank) * per_rank
                head, idx, tail = _split_expert_name(name)
                for k, t in enumerate(gathered):
                    yield f"{head}{idx + (k - ep_rank) * per_rank}{tail}", t
            del gathered
        del full, local


def exporting_rank(model: torch.nn.Module, tp_group: Any = None) -> bool:
    """Whether ``export_hf_weights`` yields on this rank (TP rank 0, and expert-parallel rank 0 for MoE)."""
    import torch.distributed as dist

    if tp_group is None and dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
    experts = _moe_experts(model)
    return _group_coords(tp_group)[0] == 0 and (
        experts is None or _group_coords(experts.ep_group)[0] == 0
    )


def _split_expert_name(name: str) -> tuple[str, int, str]:
    """``model.layers.3.mlp.experts.5.up_proj.weight`` -> (``...experts.``, 5, ``.up_proj.weight``)."""
    head, _, rest = name.partition(".mlp.experts.")
    idx, _, tail = rest.partition(".")
    return f"{head}.mlp.experts.", int(idx), f".{tail}"
