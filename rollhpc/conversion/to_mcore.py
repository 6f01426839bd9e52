"""One rank of an HF -> megatron conversion, in a worker process of a gloo world of the target layout.

The rank builds its ``GPTModel`` partition (no random init), copies its shards from the HF files one tensor
at a time (``load_hf_weights``: a tensor is read with one seek + read, cut, copied, dropped), and the world
writes the checkpoint collectively with ``save_mcore_checkpoint``, the function the trainer saves with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rollhpc.checkpoint.mcore import save_mcore_checkpoint
from rollhpc.checkpoint.safetensors_io import SafetensorsDir
from rollhpc.conversion.meters import (
    Progress,
    Ticking,
    log,
    reset_peak_rss,
    rss_bytes,
    worker_memory,
)
from rollhpc.models import megatron_cpu
from rollhpc.models.megatron_gpt import build_gpt_model
from rollhpc.models.megatron_hf import load_hf_weights, model_weight_map

megatron_cpu.import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports

from megatron.core import parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedStateDict,
    ShardedTensor,
    apply_factories,
)
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402


def convert_rank(rank: int, job: Mapping[str, Any]) -> dict[str, int]:
    """Rank ``rank``'s partition of ``job["src"]`` written into the checkpoint ``job["dst"]``; its memory
    report (``meters.worker_memory``)."""
    _init_world(rank, job)
    src = Path(job["src"])
    baseline = rss_bytes()
    reset_peak_rss()
    model = _filled_partition(rank, job, src)
    if job["progress"] and rank == 0:
        log(f"writing the megatron checkpoint ({job['world']} rank(s)) to {job['dst']}")
    layout = dict(source=str(src), converted_by="rollhpc convert hf-to-mcore")
    save_mcore_checkpoint(
        model,
        job["dst"],
        src,
        layout,
        overwrite=job["overwrite"],
        checksums=True,
        sharded_state_dict=_sharded_without_views(model),
    )
    result = worker_memory(baseline)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return result


def _init_world(rank: int, job: Mapping[str, Any]) -> None:
    """torch.distributed (gloo, meeting at ``job["rendezvous"]``) and megatron's parallel state of the
    target layout, on CPU."""
    dist.init_process_group(
        "gloo",
        init_method=job["rendezvous"],
        rank=rank,
        world_size=job["world"],
        timeout=timedelta(hours=2),
    )
    megatron_cpu.enable_cpu_megatron()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=job["tp"],
        pipeline_model_parallel_size=job["pp"],
        expert_model_parallel_size=job["ep"],
        expert_tensor_parallel_size=job["etp"],
    )
    model_parallel_cuda_manual_seed(0)


def _filled_partition(rank: int, job: Mapping[str, Any], src: Path) -> torch.nn.Module:
    """This rank's ``GPTModel`` partition, built without initialisation and filled from the HF files."""
    cfg = json.loads((src / "config.json").read_text())
    model = build_gpt_model(
        cfg,
        params_dtype=getattr(torch, job["dtype"]),
        padded_vocab=job["padded_vocab"],
        perform_initialization=False,
    )
    model.requires_grad_(False)
    table, _ = model_weight_map(model)
    bar = Progress(
        sum(len(w.hf) for w in table),
        f"rank {rank}: reading {src.name}",
        enabled=job["progress"] and rank == 0,
    )
    load_hf_weights(
        model,
        Ticking(SafetensorsDir(src), bar),
        parallel_state.get_tensor_model_parallel_rank(),
        job["tp"],
    )
    bar.close()
    return model


def _sharded_without_views(model: torch.nn.Module) -> ShardedStateDict:
    """``model.sharded_state_dict()`` with its factories applied and no tensor a view of a larger one.

    megatron's writer copies every view before writing any file (the fc1 weight is split into gate and
    up views: about half the model's bytes copied at once). Here each such parameter is copied into its
    pieces and then released, one parameter at a time, so the save holds the partition once. The model
    is unusable afterwards (released parameters are empty)."""
    sd = model.sharded_state_dict()
    apply_factories(sd)
    by_storage: dict[int, list[ShardedTensor]] = {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and sh.data is not None:
            storage = sh.data.untyped_storage()
            if storage.nbytes() != sh.data.numel() * sh.data.element_size():
                by_storage.setdefault(storage.data_ptr(), []).append(sh)
    params = {p.untyped_storage().data_ptr(): p for p in model.parameters()}
    for ptr, pieces in by_storage.items():
        for sh in pieces:
            sh.data = sh.data.clone()
        if ptr in params:
            params[ptr].data = torch.empty(0, dtype=params[ptr].dtype)
    return sd
