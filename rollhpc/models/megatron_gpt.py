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
stage holds every layer), sequence parallelism, and megatron -> HF export (the inverse of the shards).
Padded vocab rows are zero: their logits (``[..., vocab_size:]``) are not part of the HF model and must
be left out of comparisons and, for exact HF log-probs, out of the softmax.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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
