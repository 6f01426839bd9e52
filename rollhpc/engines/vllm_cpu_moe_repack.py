"""Workaround for vLLM's CPU MoE kernel, which loses its weight layout when weights are reloaded.

On CPU, vLLM packs each MoE layer's expert weights (w13, w2) into the layout of its grouped-GEMM kernel
once, after the first load (``CPUUnquantizedExperts.process_weights_after_loading``). ``reload_weights``
writes new weights in checkpoint layout and processes the layer again, but on a weight update that
processing skips the experts' packing step (``UnquantizedFusedMoEMethod._setup_kernel`` runs it on the
first call only). The kernel then multiplies with unpacked weights. There is no error, only wrong
outputs. The RLVR pipeline's trainer-vs-generator log-prob check found it on a tiny Qwen2-MoE: a mean
|diff| of 0.05 after the first weight sync, where dense models show 0.

After each reload, ``repack_after_reload`` compares, for every MoE layer, the first rows of expert 0's
w13 with the ``gate_proj`` tensor that was just sent. Equal means the weights are still in checkpoint
layout, and the packing step is run here. If a later vLLM packs by itself, the rows differ and nothing
is done.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

if TYPE_CHECKING:
    from vllm.v1.worker.cpu_worker import CPUWorker

log = logging.getLogger(__name__)

_EXPERT0_GATE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.0\.gate_proj\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def is_moe_config(hf_config: dict[str, Any]) -> bool:
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0) > 0


def capture_expert0_gates(
    named_tensors: Iterable[tuple[str, torch.Tensor]], into: dict[int, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass the tensors through, keeping a copy of each layer's expert-0 ``gate_proj`` (the caller may
    reuse its buffers once a tensor has been consumed)."""
    for name, tensor in named_tensors:
        match = _EXPERT0_GATE.match(name)
        if match:
            into[int(match.group(1))] = tensor.detach().to("cpu", copy=True)
        yield name, tensor


def repack_after_reload(worker: CPUWorker, gates: dict[int, torch.Tensor]) -> int:
    """In a vLLM worker (``collective_rpc``): pack again the experts of every MoE layer whose w13 is in
    checkpoint layout; returns how many layers were packed."""
    # vLLM's CPU kernels, imported where they run (as vLLM itself does): on a CPU worker, never in a GPU build
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    packed = 0
    for name, module in worker.model_runner.model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        layer = _LAYER.search(name)
        if (
            not isinstance(experts, CPUUnquantizedExperts)
            or layer is None
            or int(layer.group(1)) not in gates
        ):
            continue
        if getattr(experts, "_use_zentorch", False):
            continue  # zentorch uses the weights as loaded
        gate = gates[int(layer.group(1))]
        rows = gate.shape[0] // tp_size
        w13 = module.w13_weight
        # vLLM padded the intermediate size: the layouts cannot be compared
        if w13.shape[1] != 2 * rows:
            log.warning(
                "%s: MoE weights padded by vLLM (%d rows for %d); not checked after the reload",
                name,
                w13.shape[1] // 2,
                rows,
            )
            continue
        shard = gate[tp_rank * rows : (tp_rank + 1) * rows].to(w13.dtype)
        if torch.equal(w13[0, :rows], shard):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed
