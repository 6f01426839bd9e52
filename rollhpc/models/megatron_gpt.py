"""A megatron-core ``GPTModel`` that is the same network as a Hugging Face Qwen2-family checkpoint.

* ``transformer_config_from_hf(hf_config, tp)``: the ``TransformerConfig`` of a ``config.json``:
  grouped-query attention (``num_query_groups``), bias on q/k/v only (``add_qkv_bias``, no other linear
  bias), RMSNorm, SwiGLU MLP (``gated_linear_unit`` + silu), no dropout, unfused kernels (local spec);
  for MoE: top-k softmax router (renormalised over the chosen experts when ``norm_topk_prob``), no
  auxiliary loss, the "allgather" token dispatcher (the "alltoall" one needs CUDA streams), and sequence
  parallelism at tp > 1 (megatron-core's MoE layer refuses to train at tp > 1 without it: each TP rank then holds
  1/tp of the sequence outside attention and the MLP's inner widths, and its forward needs a sequence length
  that tp divides).
* ``build_gpt_model(hf_config, ...)``: the ``GPTModel`` on megatron's local (non-Transformer-Engine)
  layer spec, rotary embeddings with the checkpoint's ``rope_theta``, tied or untied embeddings, vocab
  padded like megatron pads it (``padded_vocab_size``); pipeline/expert parallel sizes from the
  initialized ``parallel_state``. Call after ``initialize_model_parallel`` and
  ``model_parallel_cuda_manual_seed`` (on CPU, after ``megatron_cpu.enable_cpu_megatron()``).

Its weights come from and go back to Hugging Face names through ``models.megatron_hf`` (on the map of
``models.hf_weight_map``). Padded vocab rows are zero: their logits (``[..., vocab_size:]``) are not part of the
HF model and must be left out of comparisons and, for exact HF log-probs, out of the softmax.

Not supported: MoE models mixing dense and MoE layers (``mlp_only_layers``, ``decoder_sparse_step`` > 1),
sliding-window attention, rope scaling (rope_type other than "default"), sequence parallelism on dense models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from rollhpc.models.hf_weight_map import (
    Arch,
    HfConfigSource,
    _hf_dict,
    _rope_theta,
    check_hf_config,
    hf_arch,
    padded_vocab_size,
)
from rollhpc.models.megatron_cpu import import_megatron

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer import ModuleSpec, TransformerConfig  # noqa: E402
from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: E402
from megatron.core.transformer.transformer_block import (  # noqa: E402
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.moe import moe_utils  # noqa: E402


# The local layer spec runs plain PyTorch ops: every fused kernel that TransformerConfig would ask of
# Apex or Transformer Engine is switched off.
LOCAL_SPEC_FUSIONS_OFF: dict[str, bool] = dict.fromkeys(
    (
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "masked_softmax_fusion",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
    ),
    False,
)


def transformer_config_from_hf(
    hf_config: HfConfigSource,
    tp: int = 1,
    *,
    params_dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> TransformerConfig:
    """megatron's ``TransformerConfig`` for a ``config.json`` at tensor-parallel size ``tp``.
    ``overrides`` go to ``TransformerConfig`` last (e.g. ``recompute_granularity``,
    ``expert_model_parallel_size``, ``pipeline_model_parallel_size``)."""
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
        **LOCAL_SPEC_FUSIONS_OFF,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if arch.num_experts:
        kw.update(_moe_settings(cfg, arch))
        kw["sequence_parallel"] = tp > 1
    kw.update(overrides)
    if kw.get("pipeline_model_parallel_size", 1) > 1:
        kw.setdefault("pipeline_dtype", params_dtype)
    return TransformerConfig(**kw)


def _moe_settings(cfg: dict[str, Any], arch: Arch) -> dict[str, object]:
    """The ``TransformerConfig`` settings of a MoE checkpoint's experts and router."""
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch.shared_expert else 0
    return dict(
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


def _parallel_sizes() -> dict[str, int]:
    """pp/ep/etp sizes of the initialized megatron parallel state (all 1 when it is not initialized)."""
    if not parallel_state.model_parallel_is_initialized():
        return {}
    sizes = dict(
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    )
    if parallel_state.get_virtual_pipeline_model_parallel_world_size():
        sizes["virtual_pipeline_model_parallel_size"] = (
            parallel_state.get_virtual_pipeline_model_parallel_world_size()
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
    hf_config: HfConfigSource,
    tp: int | None = None,
    *,
    params_dtype: torch.dtype = torch.float32,
    parallel_output: bool = True,
    vocab_divisible_by: int = 128,
    padded_vocab: int | None = None,
    vp_stage: int | None = None,
    **overrides: object,
) -> GPTModel:
    """megatron-core ``GPTModel`` with the architecture of ``hf_config``. ``tp`` defaults to the
    tensor-parallel size of the initialized model-parallel state (pipeline, virtual-pipeline and
    expert-parallel sizes always come from it). ``parallel_output=False`` gathers the logits over TP ranks
    (``[b, s, padded_vocab]`` on every rank). ``padded_vocab`` replaces megatron's padding (e.g. to load
    a checkpoint saved at another TP size: it must be a multiple of ``tp``). With virtual pipeline stages
    (``vpp``) a rank holds one model chunk per ``vp_stage`` in ``range(vpp)``: build each with its index."""
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
    _check_vp_stage(vp_stage, config.virtual_pipeline_model_parallel_size)
    vocab = padded_vocab or padded_vocab_size(cfg["vocab_size"], tp, vocab_divisible_by)
    if vocab < cfg["vocab_size"] or vocab % tp:
        raise ValueError(
            f"padded vocab {vocab} must be >= vocab_size {cfg['vocab_size']} and a multiple of tp={tp}"
        )
    return GPTModel(
        config=config,
        transformer_layer_spec=_local_spec(arch, config, vp_stage),
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


def _local_spec(
    arch: Arch, config: TransformerConfig, vp_stage: int | None
) -> ModuleSpec | TransformerBlockSubmodules:
    """megatron's local layer spec; under sequence parallelism, the block's layers and its final norm with every
    norm one that runs on a sequence split over TP."""
    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, normalization="RMSNorm", qk_layernorm=arch.qk_norm
    )
    if not config.sequence_parallel:
        return spec
    return TransformerBlockSubmodules(
        layer_specs=[_norms_replaced(spec, SequenceParallelRMSNorm)]
        * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=SequenceParallelRMSNorm,
    )


class SequenceParallelRMSNorm:
    """torch's RMSNorm as megatron's local spec builds it (``WrappedTorchNorm``), for a model that runs sequence
    parallelism. megatron's wrapper refuses that because torch's norm does not mark its weight: there each TP rank
    normalizes 1/tp of the tokens, so the weight's gradient is a partial sum, which ``finalize_model_grads``
    all-reduces over the TP group for parameters marked ``sequence_parallel`` (as megatron's fused and Transformer
    Engine norms mark theirs)."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: object
    ) -> torch.nn.RMSNorm:
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _norms_replaced(spec: object, norm: type) -> object:
    """A layer spec (megatron's ``ModuleSpec`` tree) with ``norm`` built wherever it builds ``WrappedTorchNorm``."""
    if spec is WrappedTorchNorm:
        return norm
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(spec, submodules=_norms_replaced(spec.submodules, norm))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(
            spec,
            **{
                f.name: _norms_replaced(getattr(spec, f.name), norm)
                for f in dataclasses.fields(spec)
                if f.init
            },
        )
    return spec


def _check_vp_stage(vp_stage: int | None, vpp: int | None) -> None:
    """A chunk index in ``range(vpp)`` exactly when the parallel state has virtual pipeline stages."""
    if (vpp is None) != (vp_stage is None) or (vpp is not None and not 0 <= vp_stage < vpp):
        raise ValueError(
            f"vp_stage={vp_stage} with virtual pipeline size {vpp}: give a chunk index in "
            "range(vpp) exactly when the parallel state has virtual pipeline stages"
        )


def _patch_router_without_te() -> None:
    """megatron-core 0.16.1's MoE router tests ``te_general_gemm is not None``, a name it only defines
    when Transformer Engine imports: without TE the router's forward raises NameError. Define it as None
    (megatron's own fallback then runs: a plain matmul)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
