"""A megatron-core ``GPTModel`` that is the same network as a Hugging Face Qwen2 (dense) checkpoint.

Three steps, each usable alone:

* ``transformer_config_from_hf(hf_config, tp)``: the ``TransformerConfig`` of a Qwen2 ``config.json``:
  grouped-query attention (``num_query_groups``), bias on q/k/v only (``add_qkv_bias``, no other linear
  bias), RMSNorm, SwiGLU MLP (``gated_linear_unit`` + silu), no dropout, unfused kernels (local spec).
* ``build_gpt_model(hf_config, ...)``: the ``GPTModel`` on megatron's local (non-Transformer-Engine)
  layer spec, rotary embeddings with the checkpoint's ``rope_theta``, tied or untied embeddings, vocab
  padded like megatron pads it (``padded_vocab_size``). Call after ``initialize_model_parallel`` and
  ``model_parallel_cuda_manual_seed`` (on CPU, after ``megatron_cpu.enable_cpu_megatron()``).
* ``load_hf_weights(model, hf_state_dict, tp_rank, tp_size)``: copies this rank's shard of every HF
  tensor into the model.
* ``export_hf_weights(model, vocab_size)``: the inverse, for weight sync to an HF-named generator (vLLM)
  and checkpoint conversion: inside the running TP group, all-gathers one parameter at a time and yields
  ``(hf_name, full tensor)`` on TP rank 0 (``unshard_to_hf`` is the pure, per-parameter inverse of
  ``shard_hf_weight``).

The HF -> megatron map is plain data (``weight_map``: one ``WeightMapping`` per megatron parameter
naming its HF source tensors and a layout) and ``shard_hf_weight`` cuts one rank's shard for a layout;
neither imports megatron, so the checkpoint converter reuses both. Layouts:

=============  ==============================================  ===========================================
layout         HF source                                       megatron tensor on TP rank r of t
=============  ==============================================  ===========================================
replicated     RMSNorm weights                                 the whole tensor
vocab          embed_tokens / lm_head ``[V, H]``               rows ``[r*Vp/t, (r+1)*Vp/t)`` of the vocab
                                                               padded with zero rows to ``Vp``
qkv            q_proj, k_proj, v_proj weight (or bias)         megatron's fused QKV: per query group
                                                               ``[its nh/ng q heads; its k head; its v
                                                               head]``; rank r holds groups
                                                               ``[r*ng/t, (r+1)*ng/t)``
gate_up        gate_proj, up_proj ``[F, H]``                   ``[gate rows of shard r; up rows of shard r]``
row            o_proj ``[H, nh*d]``, down_proj ``[H, F]``      columns ``[r*K/t, (r+1)*K/t)`` (row-parallel)
=============  ==============================================  ===========================================

Left for later: MoE (Qwen2-MoE / Qwen3-MoE experts and router), Qwen3's q/k RMSNorm, sliding-window
attention, rope scaling (rope_type other than "default"), pipeline parallelism (the map assumes one
stage holds every layer; export gathers over TP only), sequence parallelism.
Padded vocab rows are zero: their logits (``[..., vocab_size:]``) are not part of the HF model and must
be left out of comparisons and, for exact HF log-probs, out of the softmax.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LAYOUTS = ("replicated", "vocab", "qkv", "gate_up", "row")


@dataclass(frozen=True)
class WeightMapping:
    megatron: str  # parameter name in megatron's GPTModel (local layer spec)
    hf: tuple[str, ...]  # source tensors in the HF checkpoint, in the order the layout fuses them
    layout: str  # one of LAYOUTS


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    """config.json as a dict, from a dict, a transformers config, a config.json path or its folder."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if isinstance(hf_config, (str, Path)):
        path = Path(hf_config)
        return json.loads((path / "config.json" if path.is_dir() else path).read_text())
    return hf_config.to_dict()


def weight_map(num_layers: int, tie_word_embeddings: bool) -> list[WeightMapping]:
    """Every megatron GPTModel parameter of a dense Qwen2 model and where it comes from in HF."""
    m = [WeightMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = hf + "self_attn."
        m += [
            WeightMapping(mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"),
            WeightMapping(mc + "self_attention.linear_qkv.weight",
                          tuple(f"{attn}{p}_proj.weight" for p in "qkv"), "qkv"),
            WeightMapping(mc + "self_attention.linear_qkv.bias",
                          tuple(f"{attn}{p}_proj.bias" for p in "qkv"), "qkv"),
            WeightMapping(mc + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
            WeightMapping(mc + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",),
                          "replicated"),
            WeightMapping(mc + "mlp.linear_fc1.weight",
                          (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "gate_up"),
            WeightMapping(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row"),
        ]
    m.append(WeightMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not tie_word_embeddings:
        m.append(WeightMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return m


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padding: the next multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def shard_hf_weight(layout: str, tensors: list[torch.Tensor], tp_rank: int, tp_size: int, *,
                    num_query_groups: int = 0, padded_vocab: int = 0) -> torch.Tensor:
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
            raise ValueError(f"padded vocab {padded_vocab} must be >= {w.shape[0]} and a multiple of tp={tp_size}")
        full = torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], *w.shape[1:])])
        return full.chunk(tp_size, dim=0)[tp_rank]
    if layout == "gate_up":
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]])
    q, k, v = tensors  # [nh*d, ...], [ng*d, ...], [ng*d, ...]
    ng = num_query_groups
    if ng < 1 or ng % tp_size:
        raise ValueError(f"num_query_groups={ng} must be a positive multiple of tp={tp_size}")
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *rest), k.reshape(ng, -1, *rest), v.reshape(ng, -1, *rest)], dim=1)
    return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest)


def unshard_to_hf(layout: str, shards: list[torch.Tensor], hf_names: tuple[str, ...] | list[str], *,
                  num_query_groups: int = 0, num_attention_heads: int = 0,
                  vocab_size: int = 0) -> dict[str, torch.Tensor]:
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
            raise ValueError(f"vocab_size={vocab_size} must be in [1, padded vocab {full.shape[0]}]")
        return {names[0]: full[:vocab_size]}
    if layout == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return {names[0]: torch.cat([g for g, _ in halves]), names[1]: torch.cat([u for _, u in halves])}
    ng, nh = num_query_groups, num_attention_heads
    if ng < 1 or nh < 1 or nh % ng:
        raise ValueError(f"num_attention_heads={nh} must be a positive multiple of num_query_groups={ng}")
    full = torch.cat(shards, dim=0)  # per group [q heads; k; v], groups in order across ranks
    rest = full.shape[1:]
    if full.shape[0] % (nh + 2 * ng):
        raise ValueError(f"fused qkv has {full.shape[0]} rows, not a multiple of nh + 2*ng = {nh + 2 * ng}")
    d = full.shape[0] // (nh + 2 * ng)
    grouped = full.reshape(ng, (nh // ng + 2) * d, *rest)
    q, k, v = grouped.split([nh // ng * d, d, d], dim=1)
    return {names[0]: q.reshape(nh * d, *rest), names[1]: k.reshape(ng * d, *rest),
            names[2]: v.reshape(ng * d, *rest)}


def _rope_theta(cfg: dict[str, Any]) -> float:
    rope = cfg.get("rope_parameters") or {}  # transformers 5; 4.x: rope_theta + rope_scaling
    scaling = cfg.get("rope_scaling") or {}
    kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise NotImplementedError(f"rope_type {kind!r}: only unscaled rotary embeddings are supported")
    return float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def transformer_config_from_hf(hf_config: Any, tp: int = 1, *, params_dtype: torch.dtype = torch.float32,
                               **overrides: Any):
    """megatron's ``TransformerConfig`` for a dense Qwen2 ``config.json`` at tensor-parallel size ``tp``.
    ``overrides`` go to ``TransformerConfig`` last (e.g. ``recompute_granularity``)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    cfg = _hf_dict(hf_config)
    if cfg.get("model_type") != "qwen2":
        raise NotImplementedError(f"model_type {cfg.get('model_type')!r}: only dense 'qwen2' is supported")
    if cfg.get("use_sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {cfg['hidden_act']!r}: Qwen2 uses silu")
    _rope_theta(cfg)  # refuses scaled rope early
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
        add_qkv_bias=True,
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
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt_model(hf_config: Any, tp: int | None = None, *, params_dtype: torch.dtype = torch.float32,
                    parallel_output: bool = True, vocab_divisible_by: int = 128, **overrides: Any):
    """megatron-core ``GPTModel`` with the architecture of a dense Qwen2 checkpoint. ``tp`` defaults to
    the tensor-parallel size of the initialized model-parallel state. ``parallel_output=False`` gathers
    the logits over TP ranks (``[b, s, padded_vocab]`` on every rank)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = _hf_dict(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size() if tp is None else tp
    config = transformer_config_from_hf(cfg, tp, params_dtype=params_dtype, **overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(cfg["vocab_size"], tp, vocab_divisible_by),
        max_sequence_length=cfg.get("max_position_embeddings", 4096),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(cfg),
    )


def load_hf_weights(model: torch.nn.Module, hf_state_dict: Mapping[str, torch.Tensor], tp_rank: int,
                    tp_size: int) -> None:
    """Copy TP rank ``tp_rank``'s shard of every HF tensor into ``model`` (built by ``build_gpt_model``).
    Raises if a megatron parameter has no source, a shape differs, or an HF tensor is left unused
    (``lm_head.weight`` of a tied checkpoint is ignored)."""
    config = model.config
    tied = bool(model.share_embeddings_and_output_weights)
    params = dict(model.named_parameters())
    table = weight_map(config.num_layers, tied)
    missing = set(params) - {w.megatron for w in table}
    if missing:
        raise KeyError(f"megatron parameters without an HF source: {sorted(missing)}")
    used = {"lm_head.weight"} if tied else set()
    with torch.no_grad():
        for w in table:
            absent = [n for n in w.hf if n not in hf_state_dict]
            if absent:
                raise KeyError(f"{w.megatron}: HF checkpoint lacks {absent}")
            shard = shard_hf_weight(w.layout, [hf_state_dict[n] for n in w.hf], tp_rank, tp_size,
                                    num_query_groups=config.num_query_groups, padded_vocab=model.vocab_size)
            param = params[w.megatron]
            if shard.shape != param.shape:
                raise ValueError(f"{w.megatron}: shard of {w.hf} has shape {tuple(shard.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.copy_(shard)
            used.update(w.hf)
    unused = sorted(n for n in hf_state_dict if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise KeyError(f"HF tensors with no megatron parameter: {unused}")


def export_hf_weights(model: torch.nn.Module, vocab_size: int, tp_group: Any = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full tensor)`` for every HF tensor of ``model`` (built by ``build_gpt_model``), gathered
    over the tensor-parallel group (default: megatron's ``parallel_state`` TP group; without an
    initialized ``torch.distributed`` or at TP size 1 nothing is gathered). ``vocab_size``: the HF
    (unpadded) vocab size, from ``config.json``.

    Collective: every TP rank must iterate this generator to the end, in step (it all-gathers one
    parameter per step); only TP rank 0 yields, the other ranks yield nothing. Memory stays bounded by
    one parameter's full tensor(s): each is gathered, unsharded, yielded and dropped before the next.
    Yielded tensors are detached, fresh (not views of the model's parameters when TP > 1; at TP 1 the
    non-fused ones may share storage with them: copy before the next optimizer step if kept).
    Tied embeddings: ``lm_head.weight`` is not yielded (HF ties it to ``model.embed_tokens.weight``)."""
    import torch.distributed as dist

    if tp_group is None and dist.is_available() and dist.is_initialized():
        from megatron.core import parallel_state
        tp_group = parallel_state.get_tensor_model_parallel_group()
    distributed = dist.is_available() and dist.is_initialized()
    tp_size = dist.get_world_size(tp_group) if distributed else 1
    tp_rank = dist.get_rank(tp_group) if distributed else 0
    config = model.config
    tied = bool(model.share_embeddings_and_output_weights)
    params = dict(model.named_parameters())
    table = weight_map(config.num_layers, tied)
    missing = set(params) - {w.megatron for w in table}
    if missing:
        raise KeyError(f"megatron parameters without an HF name: {sorted(missing)}")
    for w in table:
        local = params[w.megatron].detach()
        if tp_size > 1:
            local = local.contiguous()
            shards = [torch.empty_like(local) for _ in range(tp_size)]
            dist.all_gather(shards, local, group=tp_group)
        else:
            shards = [local]
        if tp_rank == 0:
            yield from unshard_to_hf(w.layout, shards, w.hf, num_query_groups=config.num_query_groups,
                                     num_attention_heads=config.num_attention_heads,
                                     vocab_size=vocab_size).items()
        del shards, local
