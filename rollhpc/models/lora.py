"""LoRA adapters on megatron-core's tensor-parallel linear layers (shapes in comments).

A target linear ``y = W x`` (W: [out, in]) gains ``y += scaling * B (A dropout(x))`` with A: [r, in], B: [out, r],
``scaling = alpha / r``; B starts at zero (the adapted model is the base model until B moves), A from a
Kaiming-uniform draw that depends only on the seed and the layer, so any TP or PP layout starts from the same
adapters. The base weights are frozen: no gradient, no optimizer state, no DDP bucket (megatron's DDP and
optimizer only take parameters that require a gradient).

Tensor parallelism follows the layer it adapts:
- column-parallel (``linear_qkv``, ``linear_fc1``: W's output rows sharded): A is replicated, B is sharded like W's
  rows ([out / tp, r]). Every TP rank computes the same ``A x``; its gradient is the sum of every rank's part, so
  ``A x`` passes through megatron's copy-to-TP-region (identity forward, all-reduce backward);
- row-parallel (``linear_proj``, ``linear_fc2``: W's input columns sharded, the input arriving sharded): A is
  sharded like W's columns ([r, in / tp]), B is replicated. Each rank's ``A_shard x_shard`` is a partial sum of
  ``A x``, all-reduced by megatron's reduce-from-TP-region (all-reduce forward, identity backward) before B.
B's rows keep W's row order (megatron's interleaved q/k/v groups, fc1's gate and up halves), so an adapter is
gathered and split into Hugging Face's modules exactly as the weight it adapts (``rollhpc.models.megatron_gpt``).

The adapters of a transformer layer live in ``layer.lora`` (a ``LoraLayer``), outside the base linears, so the
base layers' state dicts and Hugging Face mappings are untouched; each base linear calls its adapter from a
forward hook (activation recompute re-runs it like the rest of the forward). ``adapters_disabled`` gives the
base model for the reference log-probs: the frozen base is the reference policy.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

from rollhpc.models.hf_weight_map import LORA_ATTRIBUTE, unshard_to_hf
from rollhpc.models.lora_config import TARGETS, LoraConfig
from rollhpc.models.megatron_cpu import import_megatron
from rollhpc.models.megatron_hf import _gather, export_hf_weights

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core.tensor_parallel.mappings import (  # noqa: E402
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory  # noqa: E402
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # noqa: E402

__all__ = [
    "TARGETS",
    "LoraConfig",
    "LoraAdapter",
    "LoraLayer",
    "attach_lora",
    "adapters_disabled",
    "adapter_parameters",
    "export_lora_hf",
    "merged_hf_weights",
    "adapter_sync_tensors",
    "adapter_of",
    "peft_tensors",
    "peft_config",
    "LORA_ATTRIBUTE",
]


class LoraAdapter(torch.nn.Module):
    """A and B of one tensor-parallel linear: ``delta(x)`` is what the adapter adds to the linear's output."""

    def __init__(
        self,
        mode: Literal["column", "row"],
        in_features: int,
        out_features: int,
        config: LoraConfig,
        tp_rank: int,
        tp_size: int,
        tp_group: dist.ProcessGroup | None,
        init_key: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ):
        """``in_features`` / ``out_features``: the full (unsharded) sizes of the linear's weight."""
        super().__init__()
        if mode not in ("column", "row"):
            raise ValueError(f"mode must be 'column' or 'row', got {mode!r}")
        shard_in, shard_out = (
            (in_features, out_features // tp_size)
            if mode == "column"
            else (in_features // tp_size, out_features)
        )
        if (out_features if mode == "column" else in_features) % tp_size:
            raise ValueError(
                f"a {mode}-parallel linear of {in_features} -> {out_features} does not split over "
                f"tp={tp_size}"
            )
        self.mode, self.scaling, self.tp_group, self.tp_size = (
            mode,
            config.scaling,
            tp_group,
            tp_size,
        )
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout else torch.nn.Identity()
        # [r, in], the same on every layout
        full_a = _initial_a(config.rank, in_features, config.seed, init_key)
        if mode == "row":
            full_a = full_a[:, tp_rank * shard_in : (tp_rank + 1) * shard_in]
        # [r, in or in/tp]
        self.lora_a = torch.nn.Parameter(full_a.to(dtype=dtype, device=device).contiguous())
        self.lora_b = torch.nn.Parameter(
            torch.zeros(shard_out, config.rank, dtype=dtype, device=device)
        )
        # megatron's TP attributes: grad norm, checkpoints
        sharded = self.lora_b if mode == "column" else self.lora_a
        sharded.tensor_model_parallel, sharded.partition_dim, sharded.partition_stride = (
            True,
            1 - (mode == "column"),
            1,
        )
        self.enabled = True

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, in or in/tp] -> [s, b, out/tp or out]: the adapter's share of the linear's output."""
        # [s, b, r]
        a = torch.nn.functional.linear(self.dropout(x).to(self.lora_a.dtype), self.lora_a)
        if self.tp_size > 1:
            a = (
                copy_to_tensor_model_parallel_region(a, group=self.tp_group)
                if self.mode == "column"
                else reduce_from_tensor_model_parallel_region(a, group=self.tp_group)
            )
        return torch.nn.functional.linear(a, self.lora_b) * self.scaling

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """For megatron's dist checkpointing: the sharded one of A and B split over TP like its linear's weight,
        the other replicated."""
        axis = {"lora_b": 0} if self.mode == "column" else {"lora_a": 1}
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            axis,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )


class LoraLayer(torch.nn.ModuleDict):
    """One transformer layer's adapters, by target name; checkpointed through each adapter's sharding, fc1's B
    through megatron's SwiGLU factory as fc1's weight is (its gate and up halves stored apart: a checkpoint's
    layout does not depend on the TP size it was saved at)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, adapter in self.items():
            sub = adapter.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata)
            if name == "fc1":
                key = f"{prefix}{name}.lora_b"
                sub[key] = apply_swiglu_sharded_factory(
                    sub[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False)
                )
            out.update(sub)
        return out


def _initial_a(rank: int, in_features: int, seed: int, key: int) -> torch.Tensor:
    """Kaiming-uniform (a = sqrt(5), as torch's Linear and PEFT draw A), from a generator of its own: the same
    numbers whatever the layout, and the caller's RNG untouched."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + key) & 0x7FFF_FFFF_FFFF_FFFF)
    # kaiming_uniform with a=sqrt(5): gain * sqrt(3 / fan_in) = 1/sqrt(fan_in)
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank, in_features, generator=g, dtype=torch.float32) * 2 - 1) * bound


# a megatron linear's output: (output, bias or None)
_LinearOutput = tuple[torch.Tensor, torch.Tensor | None]


def _hook(
    adapter: LoraAdapter,
) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], _LinearOutput], _LinearOutput]:
    def forward_hook(
        module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: _LinearOutput
    ) -> _LinearOutput:
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter.delta(args[0]).to(out.dtype), bias

    return forward_hook


def attach_lora(
    model: torch.nn.Module,
    config: LoraConfig,
    tp_rank: int,
    tp_size: int,
    tp_group: dist.ProcessGroup | None,
) -> int:
    """Freeze ``model`` (a chunk built by ``rollhpc.models.megatron_gpt.build_gpt_model``) and give each of its
    transformer layers adapters on ``config.target``; returns the adapter parameters' element count on this
    rank. Layers are keyed by their global number, so a pipeline stage draws the A its layers have at pp=1."""
    model.requires_grad_(False)
    # what a checkpoint of it records (rollhpc.checkpoint.mcore), to read it back
    model.lora_config = config
    count = 0
    for layer in model.decoder.layers:
        adapters = LoraLayer()
        for name in config.target:
            parent, attr, mode = TARGETS[name]
            linear = getattr(getattr(layer, parent), attr, None)
            if linear is None or getattr(linear, "weight", None) is None:
                raise ValueError(
                    f"lora.target {name!r}: layer {layer.layer_number} has no {parent}.{attr} with a "
                    "weight (a MoE layer's experts are not adapted)"
                )
            out_full = linear.weight.shape[0] * (tp_size if mode == "column" else 1)
            in_full = linear.weight.shape[1] * (tp_size if mode == "row" else 1)
            adapters[name] = LoraAdapter(
                mode,
                in_full,
                out_full,
                config,
                tp_rank,
                tp_size,
                tp_group,
                init_key=layer.layer_number * len(TARGETS) + list(TARGETS).index(name),
                dtype=linear.weight.dtype,
                device=linear.weight.device,
            )
            linear.register_forward_hook(_hook(adapters[name]))
            count += adapters[name].lora_a.numel() + adapters[name].lora_b.numel()
        setattr(layer, LORA_ATTRIBUTE, adapters)
    return count


def _adapters(model: torch.nn.Module) -> Iterator[LoraAdapter]:
    return (m for m in model.modules() if isinstance(m, LoraAdapter))


@contextlib.contextmanager
def adapters_disabled(*models: torch.nn.Module) -> Iterator[None]:
    """The base model inside: every adapter of ``models`` adds nothing (the reference policy of a LoRA run)."""
    adapters = [a for m in models for a in _adapters(m)]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters' parameters by name (``decoder.layers.I.lora.TARGET.lora_a`` / ``lora_b``)."""
    return {n: p for n, p in model.named_parameters() if f".{LORA_ATTRIBUTE}." in n}


# HF (PEFT) module names of each target: the modules a fused megatron linear stands for, and how its B (column)
# or A (row) splits into them (rollhpc.models.megatron_gpt's layouts)
_HF_MODULES = {
    "qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv"),
    "proj": ("self_attn", ("o_proj",), "row"),
    "fc1": ("mlp", ("gate_proj", "up_proj"), "gate_up"),
    "fc2": ("mlp", ("down_proj",), "row"),
}
PEFT_PREFIX = "base_model.model.model.layers."


def export_lora_hf(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """This pipeline stage's adapters, gathered over TP, under PEFT's names for the Hugging Face model:
    ``base_model.model.model.layers.I.self_attn.q_proj.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r].
    A fused linear's adapter becomes one adapter per HF module it fuses (q/k/v, gate/up): the same A for each,
    B's rows split as the fused weight's are. Every TP rank must call it (it all-gathers); each gets the result."""
    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    c = model.config
    out: dict[str, torch.Tensor] = {}
    for layer in model.decoder.layers:
        adapters = getattr(layer, LORA_ATTRIBUTE, None)
        if adapters is None:
            continue
        for name, adapter in adapters.items():
            a, b = adapter.lora_a.detach(), adapter.lora_b.detach()
            a_full = a if adapter.mode == "column" else torch.cat(_gather(a, tp_group, tp), dim=1)
            b_shards = _gather(b, tp_group, tp) if adapter.mode == "column" else [b]
            out.update(
                peft_tensors(
                    layer.layer_number - 1,
                    name,
                    a_full,
                    b_shards,
                    c.num_query_groups,
                    c.num_attention_heads,
                )
            )
    return out


def peft_tensors(
    layer: int,
    target: str,
    a: torch.Tensor,
    b_shards: list[torch.Tensor],
    num_query_groups: int,
    num_attention_heads: int,
) -> dict[str, torch.Tensor]:
    """One megatron adapter as PEFT's tensors of the HF modules it stands for: A whole [r, in]; B as its TP
    shards (one, whole, for a row-parallel target or at TP 1), split as the fused weight's shards are (q/k/v
    groups, gate/up halves per shard); A shared by the modules of a fused linear."""
    parent, modules, layout = _HF_MODULES[target]
    hf = [f"{PEFT_PREFIX}{layer}.{parent}.{m}" for m in modules]
    out = {}
    if TARGETS[target][2] == "column":
        bs = unshard_to_hf(
            layout,
            b_shards,
            hf,
            num_query_groups=num_query_groups,
            num_attention_heads=num_attention_heads,
        )
        for m in hf:
            out[f"{m}.lora_A.weight"], out[f"{m}.lora_B.weight"] = a.clone(), bs[m].contiguous()
    else:
        (m,) = hf
        out[f"{m}.lora_A.weight"], out[f"{m}.lora_B.weight"] = (
            a.contiguous().clone(),
            b_shards[0].clone(),
        )
    return out


def peft_config(config: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """adapter_config.json of PEFT's LoRA for ``config``'s adapters (Hugging Face module names)."""
    modules = sorted(m for t in config.target for m in _HF_MODULES[t][1])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
        "modules_to_save": None,
    }


def merged_hf_weights(
    model: torch.nn.Module, vocab_size: int, tp_group: dist.ProcessGroup | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``export_hf_weights`` of a chunk with its adapters merged in (``W + alpha/r B A``, in float32, back in W's
    dtype): the weights the adapted model computes with, for the generators and digests. Without adapters the
    plain export. Collective like it (every TP rank iterates to the end; the adapters are gathered first)."""
    adapters = export_lora_hf(model, tp_group) if any(True for _ in _adapters(model)) else {}
    scaling = next((a.scaling for a in _adapters(model)), 0.0)
    for name, tensor in export_hf_weights(model, vocab_size, tp_group):
        key = (
            f"base_model.model.{name[: -len('.weight')]}.lora_A.weight"
            if name.endswith(".weight")
            else ""
        )
        if key in adapters:
            a, b = adapters[key], adapters[key.replace(".lora_A.", ".lora_B.")]
            tensor = (tensor.float() + scaling * (b.float() @ a.float())).to(tensor.dtype)
        yield name, tensor


def adapter_sync_tensors(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None, exporting: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a weight sync sends a generator that merges adapters itself (``engine: torch``): each adapted HF
    module's ``MODULE.lora_A.weight`` and ``MODULE.lora_B.weight`` (Hugging Face module names, no PEFT prefix),
    B multiplied by alpha/r so that the generator serves ``W + B A``. Collective (the TP gathers); yields on the
    ``exporting`` rank only."""
    adapters = export_lora_hf(model, tp_group)
    if not exporting:
        return
    scaling = next((a.scaling for a in _adapters(model)), 1.0)
    for key, t in adapters.items():
        name = key[len("base_model.model.") :]
        yield name, (t * scaling if ".lora_B." in name else t)


def adapter_of(megatron_name: str, config: LoraConfig) -> tuple[str, str] | None:
    """The parameter names (A, B) of the adapter on megatron weight ``megatron_name``
    (``decoder.layers.I.self_attention.linear_qkv.weight`` and the like), or None when it has none."""
    for target in config.target:
        parent, attr, _ = TARGETS[target]
        suffix = f".{parent}.{attr}.weight"
        if megatron_name.startswith("decoder.layers.") and megatron_name.endswith(suffix):
            layer = megatron_name[: -len(suffix)]
            return (
                f"{layer}.{LORA_ATTRIBUTE}.{target}.lora_a",
                f"{layer}.{LORA_ATTRIBUTE}.{target}.lora_b",
            )
    return None
