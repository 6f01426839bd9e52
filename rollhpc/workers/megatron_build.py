"""What a megatron role is built from: its torch.distributed world, megatron's parallel state, the model chunks
loaded from a Hugging Face checkpoint, and (for a trainer) megatron's DDP and optimizer over them.

Runs on the role's ranks only (``workers.megatron_policy`` calls it while building a worker); on CPU megatron's
hard-coded CUDA calls are pointed at the CPU first (``models.megatron_cpu``).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rollhpc.models.lora import attach_lora
from rollhpc.models.lora_config import LoraConfig
from rollhpc.models.megatron_cpu import enable_cpu_megatron, import_megatron
from rollhpc.parallel import ParallelLayout, pipeline_stage_layers
from rollhpc.protocol.worker import WorkerContext
from rollhpc.transport.rendezvous import rendezvous_host
from rollhpc.workers.megatron_policy_spec import MegatronTrainWorkerSpec

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import optimizer as mcore_optimizer  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402

from rollhpc.models.megatron_gpt import build_gpt_model, recompute_overrides  # noqa: E402
from rollhpc.models.megatron_hf import load_hf_weights  # noqa: E402
from rollhpc.models.megatron_pipeline import configure_chunks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

log = logging.getLogger("rollhpc.megatron")


def init_role_distributed(ctx: WorkerContext, timeout_s: float = 600.0) -> None:
    """torch.distributed over this role's ranks: role rank 0 serves the rendezvous store on a port the system
    gives it (bound, never released and picked again: another process cannot take it in between) and publishes
    the address over MPI."""
    if dist.is_initialized():
        return
    comm = ctx.role_comm
    timeout = timedelta(seconds=timeout_s)
    store, address = None, None
    if comm.Get_rank() == 0:
        host = rendezvous_host()
        # wait_for_workers=False: the others learn the port from this rank's broadcast below
        store = dist.TCPStore(
            host, 0, comm.Get_size(), is_master=True, timeout=timeout, wait_for_workers=False
        )
        address = (host, store.port)
    host, port = comm.bcast(address, root=0)
    if store is None:
        store = dist.TCPStore(host, port, comm.Get_size(), is_master=False, timeout=timeout)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend, store=store, rank=comm.Get_rank(), world_size=comm.Get_size(), timeout=timeout
    )


def init_parallel_state(ctx: WorkerContext, layout: ParallelLayout) -> None:
    """megatron's parallel state with the role's TP/PP/CP/EP layout, checked against the layout's DP rank (how
    the controller's DP split and megatron's gradient groups agree), and megatron's RNG streams seeded."""
    enable_cpu_megatron()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        order=layout.order,
    )
    if parallel_state.get_data_parallel_rank() != ctx.coords.dp_rank:
        raise RuntimeError(
            f"megatron puts rank {ctx.group_rank} at dp rank {parallel_state.get_data_parallel_rank()}"
            f" but the role layout says {ctx.coords.dp_rank}: rank orders disagree"
        )
    model_parallel_cuda_manual_seed(ctx.seed + 1000 * ctx.coords.pp_rank)


def load_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's ``*.safetensors`` files, by name."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def build_chunks(
    role: str,
    hf_config: dict[str, object],
    model_dir: Path,
    layout: ParallelLayout,
    *,
    dtype: str,
    recompute: str,
    routing_replay: bool = False,
) -> list[GPTModel]:
    """This rank's model chunks, one per virtual pipeline stage (one without vpp; at pp=1 the whole model),
    with the checkpoint's weights for this rank's shard, on the GPU where there is one. ``routing_replay``:
    each MoE router with megatron's ``RouterReplay`` (rollhpc.workers.router_replay)."""
    try:
        pipeline_stage_layers(int(hf_config["num_hidden_layers"]), layout.pp, layout.vpp)
    except ValueError as e:
        raise ValueError(f"role {role!r}: {e}") from None
    state = load_safetensors(model_dir)
    chunks = [
        build_gpt_model(
            hf_config,
            params_dtype=DTYPES[dtype],
            vp_stage=v if layout.vpp else None,
            **recompute_overrides(recompute),
            **({"moe_enable_routing_replay": True} if routing_replay else {}),
        )
        for v in range(layout.vpp or 1)
    ]
    for chunk in chunks:
        load_hf_weights(chunk, state, parallel_state.get_tensor_model_parallel_rank(), layout.tp)
        if torch.cuda.is_available():
            chunk.cuda()
    return chunks


def attach_adapters(role: str, chunks: list[GPTModel], lora: LoraConfig) -> None:
    """LoRA adapters on every chunk's target linears (``models.lora``), the base frozen; logs their count."""
    n = sum(
        attach_lora(
            c,
            lora,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group(),
        )
        for c in chunks
    )
    log.info(
        "role %s: LoRA rank %d on %s, %d adapter parameters on this rank (base frozen)",
        role,
        lora.rank,
        ",".join(lora.target),
        n,
    )


def build_optimizer(
    chunks: list[GPTModel], options: MegatronTrainWorkerSpec.Options, *, overlap_grad_reduce: bool
) -> tuple[list[DistributedDataParallel], mcore_optimizer.MegatronOptimizer]:
    """The chunks in megatron's DistributedDataParallel (what forward and backward run through) and
    ``get_megatron_optimizer`` over them (Adam with the options' lr, weight decay, betas and clipping); on CPU
    through rollhpc.models.megatron_cpu.

    ``overlap_grad_reduce``: each gradient bucket is reduced (reduce-scattered under the distributed optimizer) as
    soon as the backward has filled it, overlapping the last micro-batch's backward (the schedule runs the other
    micro-batches under DDP's ``no_sync``). The parameter all-gather after the step is not deferred to the next
    forward (``overlap_param_gather``): in RL the weights leave for the generators right after each step, which
    needs them gathered at once."""
    # losses divided by global counts: DDP sums gradients instead of averaging
    configure_chunks(chunks)
    o = options
    params_dtype = DTYPES[o.dtype]
    if params_dtype != torch.float32:
        # the whole model in one 16-bit dtype, as megatron's Float16Module makes it: the local layer spec builds
        # its norms in fp32, and the distributed optimizer's reshardable checkpoint cannot gather a model whose
        # parameters fill two DDP buffers of different dtypes (a size mismatch at the first save)
        for chunk in chunks:
            chunk.to(params_dtype)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=o.distributed_optimizer,
    )
    model_chunks = [
        DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    no_sync = [c.no_sync for c in model_chunks]
    for chunk in chunks:  # the schedules read it from the (shared) model config
        chunk.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    config = mcore_optimizer.OptimizerConfig(
        optimizer="adam",
        lr=o.lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        clip_grad=o.grad_clip,
        bf16=params_dtype == torch.bfloat16,
        params_dtype=params_dtype,
        use_distributed_optimizer=o.distributed_optimizer,
    )
    return model_chunks, mcore_optimizer.get_megatron_optimizer(config, model_chunks)
