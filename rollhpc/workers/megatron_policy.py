"""Train and reference roles on megatron-core: a ``GPTModel`` built from a Hugging Face checkpoint.

Each rank of the role joins a torch.distributed world of the role's ranks (gloo on CPU, NCCL on GPU;
rendezvous address from role rank 0 over the role's MPI communicator), then megatron's parallel state
with the role's TP/CP/EP/DP layout; the layout's data-parallel rank must equal megatron's, which is
how the controller's DP split and megatron's gradient groups agree.

The trainer takes batches of padded token rows (prompt + response) with a loss mask over response
targets, runs the policy loss of ``rollhpc.algo.losses`` in micro-batches with gradients summed over
data-parallel ranks by megatron's DDP (denominators are global, so DP=2 gives the DP=1 gradient), and exports its weights
in Hugging Face names, bucketed, for the generators. The reference role is the same model frozen; the critic
(PPO) is the same trunk with a value head.

Every forward and backward goes through megatron's own schedules (``models.megatron_pipeline``), so
pipeline parallelism (``pp``, and ``vpp`` virtual stages: a rank holds one model chunk per virtual stage)
is the same code path as pp=1: the loss, log-probs and values are computed on the last stage, which is
why the last stage's TP rank 0 is its replica's DP leader (``parallel.RankCoords.is_dp_leader``).

The trainer and critic run on megatron-core's own DistributedDataParallel and optimizer (fp32 main parameters,
the distributed optimizer, clipping by the global norm); on CPU through ``models.megatron_cpu``.

Left out here: context parallelism (megatron-core's local attention asserts cp == 1; it needs Transformer
Engine's attention on CUDA: refused at config load), sequence packing.

Longer than our ~600-line rule on purpose: the reference, train and critic roles are one class hierarchy over one
model build, and their import paths (``rollhpc.workers.megatron_policy:MegatronTrainWorker``, ...) are the role
names in every user's config; their pieces that stand alone live beside it (``models.megatron_pipeline``,
``checkpoint.trainer_state``, ``workers.offload``).
"""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from rollhpc.algo.objective import LossConfig
from rollhpc.batch import Batch, TrainingBatch, ValueBatch
from rollhpc.parallel import pipeline_stage_layers
from rollhpc.protocol.worker import Collect, Dispatch, Worker, WorkerContext, register
from rollhpc.testing import fault_injection
from rollhpc.transport.rendezvous import rendezvous_host
from rollhpc.workers.megatron_policy_spec import (
    MegatronCriticWorkerSpec,
    MegatronPolicyWorkerSpec,
    MegatronReferenceWorkerSpec,
    MegatronTrainWorkerSpec,
)

if TYPE_CHECKING:
    from rollhpc.algo.losses import MicroBatch, TokenCounts

    # a micro-batch's loss on the last stage's output, given its mini-batch's counts: (loss, metrics)
    MicroBatchLoss = Callable[[MicroBatch, Any, TokenCounts], tuple[Any, dict[str, float]]]

log = logging.getLogger("rollhpc.megatron")


def init_role_distributed(ctx: WorkerContext, timeout_s: float = 600.0) -> None:
    """torch.distributed over this role's ranks: role rank 0 serves the rendezvous store on a port the system
    gives it (bound, never released and picked again: another process cannot take it in between) and publishes
    the address over MPI."""
    import torch
    import torch.distributed as dist

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


class MegatronPolicyWorker(MegatronPolicyWorkerSpec, Worker):
    """Shared by the train and reference roles: model construction and log-probabilities (``Options``,
    ``trainable``, the load-time checks and the memory estimate: its spec, megatron_policy_spec)."""

    def __init__(self, ctx: WorkerContext, options: MegatronPolicyWorkerSpec.Options):
        super().__init__(ctx, options)
        import torch

        if options.threads:
            torch.set_num_threads(options.threads)
        layout = ctx.layout
        if layout is None:
            raise RuntimeError(
                "the megatron roles need the role's parallel layout in their context"
            )
        self.check_layout(layout)
        model_dir = Path(options.model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"role {ctx.role!r}: {model_dir} has no config.json (options.model_dir must be "
                "a Hugging Face checkpoint directory)"
            )
        init_role_distributed(ctx)
        from rollhpc.models import megatron_cpu

        megatron_cpu.import_megatron()  # first: on CPU, without torch.compile's imports
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from rollhpc.models.megatron_gpt import (
            _hf_dict,
            build_gpt_model,
            load_hf_weights,
            recompute_overrides,
        )

        megatron_cpu.enable_cpu_megatron()
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
        self.hf_config = _hf_dict(model_dir)
        self.vocab_size = int(self.hf_config["vocab_size"])
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[options.dtype]
        try:
            pipeline_stage_layers(int(self.hf_config["num_hidden_layers"]), layout.pp, layout.vpp)
        except ValueError as e:
            raise ValueError(f"role {ctx.role!r}: {e}") from None
        state = _load_safetensors(model_dir)
        # one chunk per virtual pipeline stage (one chunk without vpp; at pp=1 the whole model)
        self.chunks = [
            build_gpt_model(
                self.hf_config,
                params_dtype=dtype,
                vp_stage=v if layout.vpp else None,
                **recompute_overrides(getattr(options, "recompute", "none")),
            )
            for v in range(layout.vpp or 1)
        ]
        for chunk in self.chunks:
            load_hf_weights(
                chunk, state, parallel_state.get_tensor_model_parallel_rank(), layout.tp
            )
            if torch.cuda.is_available():
                chunk.cuda()
        del state
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self._grad_syncs = 0  # gradient reductions so far (a test hook counts them: rollhpc.testing.fault_injection)
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.device = next(self.chunks[0].parameters()).device
        for chunk in self.chunks:
            if not self.trainable:
                chunk.requires_grad_(False)
                chunk.eval()

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self, parts: list[str]) -> dict[str, float]:
        """Move ``parts`` (parameters, gradients, optimizer) to host memory, freeing the GPU for a colocated role
        (rollhpc.controller.colocation); returns bytes moved, seconds and this process's GPU memory after."""
        from rollhpc.workers.offload import gpu_memory

        return {**self._offloader().offload(parts), **gpu_memory()}

    @register(Dispatch.ONE_TO_ALL)
    def reload_states(self, parts: list[str]) -> dict[str, float]:
        """Bring ``parts`` back onto this rank's device (the inverse of ``offload_states``)."""
        from rollhpc.workers.offload import gpu_memory

        return {**self._offloader().reload(parts), **gpu_memory()}

    def _offloader(self) -> Any:
        if getattr(self, "_state_offloader", None) is None:
            from rollhpc.workers.offload import MegatronStateOffloader, StateOffloader

            # parameters in DDP's buffers, main parameters and moments in megatron's optimizer
            if self.trainable:
                self._state_offloader = MegatronStateOffloader(
                    self.model_chunks, self.optimizer, self.device
                )
            else:
                self._state_offloader = StateOffloader(self.chunks, None, self.device)
        return self._state_offloader

    def _parts(self, batch: Batch, with_mask: bool) -> list[dict[str, Any]]:
        """The batch's micro-batches as tensors on this rank's device; padding rows (the interleaved
        schedule needs whole groups of pp micro-batches) get a zero loss mask and ``keep`` False.

        With the loss mask (training), rows go into micro-batches longest first and each micro-batch is cut
        after its last loss token: rows are right-padded to the batch's longest, and under causal attention
        the columns after a micro-batch's last loss token change none of its loss terms, so a batch of mixed
        lengths costs its tokens, not rows x longest. (The interleaved schedule needs one shape: there the
        cut is the batch's.) Forward-only calls keep the full width: their outputs are ``[B, L-1]``."""
        import torch

        interleaved = self.ctx.layout.vpp is not None
        order = np.arange(len(batch))
        ends = None
        # tokens each row needs: through its last loss position's target
        if with_mask and self._shapes_are_local():
            mask = np.asarray(batch["loss_mask"]) > 0
            ends = np.where(mask.any(1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0) + 1
            order = np.argsort(-ends, kind="stable")
        full = batch["tokens"].shape[1]
        # the interleaved schedule's one width
        width = int(ends.max(initial=2)) if ends is not None else None
        parts = []
        for idx in self._micro_batch_index(len(batch), None if ends is None else ends[order], full):
            keep = idx >= 0
            rows = order[np.where(keep, idx, 0)]
            if ends is not None and not interleaved:
                width = max(int(ends[rows].max()), 2)
            part = {
                k: torch.as_tensor(_cut(np.asarray(v)[rows], width, full), device=self.device)
                for k, v in batch.data.items()
                if with_mask or k == "tokens"
            }
            if with_mask and not keep.all():
                part["loss_mask"] = part["loss_mask"] * torch.as_tensor(
                    keep[:, None], device=self.device
                )
            part["tokens"] = part["tokens"].long()
            part["keep"] = torch.as_tensor(keep, device=self.device)
            parts.append(part)
        return parts

    def _micro_batch_index(self, n: int, ends: np.ndarray | None, full: int) -> list[np.ndarray]:
        """Positions (into the rows' order; -1 a padding row) of each micro-batch: ``micro_batch_size`` rows, or
        with ``max_tokens_per_micro_batch`` as many as the token budget holds. ``ends``: each row's token count,
        longest first, where this rank shapes its micro-batches alone (training without expert parallelism);
        else None: every row at the batch's ``full`` width.

        Under the token budget, rows of unequal length pack greedily (``token_budget_micro_batches``); the
        interleaved schedule's one shape gets as many rows as the budget holds at the batch's cut. The stages of a
        pipeline hold the same rows and compute the same micro-batches. Under expert parallelism the MoE token
        dispatch is a collective over other DP ranks, which hold other rows: the ranks agree on the count and the
        rows per micro-batch by an all-reduce (the largest of each), padding with -1 rows where they hold fewer."""
        from rollhpc.models.megatron_pipeline import micro_batches, token_budget_micro_batches

        pp, interleaved = self.ctx.layout.pp, self.ctx.layout.vpp is not None
        budget = self.options.max_tokens_per_micro_batch
        if budget and ends is not None and not interleaved:
            return token_budget_micro_batches(ends, budget)
        width = int(ends.max(initial=2)) if ends is not None else full
        size = max(1, budget // width) if budget else self.options.micro_batch_size
        if self._shapes_are_local():
            return micro_batches(n, size, pp, interleaved)
        count, most = (int(v) for v in self._role_max([math.ceil(n / size), n]))
        if interleaved:
            count = max(pp, math.ceil(count / pp) * pp)
        rows = max(1, math.ceil(most / count))
        return list(
            np.concatenate([np.arange(n), np.full(count * rows - n, -1)]).reshape(count, rows)
        )

    def _role_max(self, values: list[float]) -> list[float]:
        """The largest of each value over every rank of the role (a collective)."""
        import torch.distributed as dist

        return self._all_reduce(values, dist.ReduceOp.MAX, None)

    def _all_reduce(self, values: list[float], op: Any, group: Any) -> list[float]:
        """``values`` reduced by ``op`` over ``group`` (None: the role's ranks), in float64; a collective."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if values and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=op, group=group)
        return t.tolist()

    def _shapes_are_local(self) -> bool:
        """Whether this rank may choose its micro-batches' count and shapes alone. Not under expert parallelism:
        the MoE token dispatcher gathers activations across the expert-parallel ranks, which are other DP
        ranks with other rows, and a collective needs the same shapes everywhere. There every DP rank trains
        all its rows at the batch's width (skipping zero-advantage rows and cutting padding are off)."""
        return self.ctx.layout.ep == 1

    @staticmethod
    def _call_chunk(chunk: Any, part: dict[str, Any]) -> Any:
        """One chunk's forward on a micro-batch (later stages take their input from the schedule)."""
        import torch

        tokens = part["tokens"]
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return chunk(tokens, positions, None)  # last stage: logits [b, L, V_padded / tp]

    def _logprobs(self, logits: Any, tokens: Any, with_entropy: bool = False):
        """(logprob, entropy) of every next token: ``[b, L-1]`` each, from the last stage's logits."""
        from rollhpc.models.vocab_parallel import token_logprobs

        return token_logprobs(
            logits[:, :-1],
            tokens[:, 1:],
            self.vocab_size,
            tp_rank=self.tp_rank,
            tp_size=self.ctx.layout.tp,
            tp_group=self.tp_group,
            with_entropy=with_entropy,
        )

    def _autocast(self) -> Any:
        """The forward/backward precision context: bfloat16 matmuls under ``mixed_precision: bf16``."""
        import torch

        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.options.mixed_precision == "bf16"
        )

    def _forward_only(self, batch: Batch, result: Any, key: str) -> Batch | None:
        """``result(part, output) -> [b, L-1] tensor`` for every row of the batch, through the schedule
        without gradients; the rows as ``{key: ...}`` on the last stage, None on the others."""
        import torch

        from rollhpc.models.megatron_pipeline import run_schedule

        training = [c.training for c in self.chunks]
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad(), self._autocast():
            kept = run_schedule(
                self.chunks,
                self._parts(batch, with_mask=False),
                self._call_chunk,
                lambda part, out: (out.new_zeros(()), {key: result(part, out)[part["keep"]]}),
                forward_only=True,
            )
        for chunk, was in zip(self.chunks, training):
            chunk.train(was)
        if not self.last_stage:
            return None
        width = batch["tokens"].shape[1] - 1
        rows = [k[key].float().cpu().numpy() for k in kept]
        return Batch({key: np.concatenate(rows) if rows else np.zeros((0, width), np.float32)})

    @register(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch | None:
        """log p(token) of every next token under the current weights: ``{"logprob": [b, L-1] float32}``
        (from the last pipeline stage; None from the others, which are not DP leaders)."""
        return self._forward_only(
            batch, lambda part, logits: self._logprobs(logits, part["tokens"])[0], "logprob"
        )


class _WeightChannelMixin:
    """The sending end of ``weight_sync.broadcast``: trainer rank 0 hosts the rendezvous and broadcasts."""

    def _exported_on_rank_zero(self, adapters_only: bool = False) -> Any:
        """Collective: the full weights in Hugging Face names, gathered over TP within the first data-parallel
        replica (with EP its expert shards span several DP ranks), as a lazy iterator on group rank 0; None on
        every other rank, which has taken part in the gathers (or, in another replica, had none to join).
        ``adapters_only``: a LoRA policy's adapters alone, for generators that merge them (engine: torch)."""
        from rollhpc.models.megatron_pipeline import export_pipeline_hf_weights

        if adapters_only and getattr(self.options, "lora", None) is None:
            raise RuntimeError(
                f"role {self.ctx.role!r}: adapters-only weight sync without LoRA adapters"
            )
        if self.ctx.coords.edp_rank != 0:
            return None
        named = export_pipeline_hf_weights(
            self.chunks, self.vocab_size, self.tp_group, adapters_only
        )
        if self.ctx.group_rank == 0:
            return named
        for _ in named:  # the other TP ranks take part in the gathers only
            pass
        return None

    @register(Dispatch.RANK_ZERO)
    def open_weight_channel(self) -> tuple[str, int]:
        """The rendezvous store's address (opened on the first call): the broadcast group forms through it and the
        streamed IPC / shared-memory sync passes its headers and acknowledgements through it."""
        from rollhpc.weight_sync.broadcast import open_store

        if getattr(self, "_store", None) is None:
            self._store = open_store()
        return rendezvous_host(), int(self._store.port)

    @register(Dispatch.RANK_ZERO)
    def join_weight_channel(self, world: int) -> None:
        from rollhpc.weight_sync.broadcast import WeightBroadcast

        self._channel = WeightBroadcast(0, world, "", 0, store=self._store, device=self.device)

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def broadcast_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> int | None:
        """Gather the weights over TP (first DP replica) and broadcast them from rank 0; returns bytes sent.
        ``verify``: with a checksum per tensor (``weight_sync.buckets.stamp``); ``adapters_only``: LoRA's adapters."""
        named = self._exported_on_rank_zero(adapters_only)
        return (
            None if named is None else self._channel.send(named, int(bucket_mb * (1 << 20)), verify)
        )

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def share_weights(
        self,
        receivers: int,
        tag: str,
        bucket_mb: float = 512.0,
        verify: bool = False,
        adapters_only: bool = False,
    ) -> dict[str, Any] | None:
        """Stream the weights to ``receivers`` generators on rank 0's GPU (CUDA IPC) or host (shared memory, on CPU)
        through ``IN_FLIGHT_BUCKETS`` reused slots of ``bucket_mb`` (``weight_sync.slots``), the headers and
        acknowledgements through the store of ``open_weight_channel`` under ``tag``; returns rank 0's
        ``SyncStats`` (bytes, slots' peak, measured peak extra memory). Returns once every receiver has copied
        every bucket: the slots are freed then."""
        from rollhpc.weight_sync.slots import SlotSender, StoreControl, slot_memory

        named = self._exported_on_rank_zero(adapters_only)
        if named is None:
            return None
        self._shared_syncs = getattr(self, "_shared_syncs", 0) + 1
        sender = SlotSender(
            slot_memory(self.device),
            StoreControl(self._store, tag),
            receivers,
            int(bucket_mb * (1 << 20)),
            verify=verify,
            sync=self._shared_syncs,
        )
        return sender.send(named).as_dict()


class MegatronReferenceWorker(MegatronReferenceWorkerSpec, MegatronPolicyWorker):
    """The frozen initial policy: log-probabilities for the KL term."""


class MegatronTrainWorker(MegatronTrainWorkerSpec, _WeightChannelMixin, MegatronPolicyWorker):
    # under overlap_grad_reduce a bucket is reduced once each of its parameters' gradients is ready; a parameter the
    # loss never reaches would hold its bucket back (megatron asserts at finalize): no overlap then
    every_parameter_gets_a_gradient = True

    def __init__(self, ctx: WorkerContext, options: MegatronTrainWorkerSpec.Options):
        super().__init__(ctx, options)
        if options.lora is not None:
            from rollhpc.models.lora import attach_lora

            n = sum(
                attach_lora(c, options.lora, self.tp_rank, self.ctx.layout.tp, self.tp_group)
                for c in self.chunks
            )
            log.info(
                "role %s: LoRA rank %d on %s, %d adapter parameters on this rank (base frozen)",
                ctx.role,
                options.lora.rank,
                ",".join(options.lora.target),
                n,
            )
        self._add_modules()
        self._build_optimizer()
        self.optimizer_steps = 0
        for chunk in self.chunks:
            chunk.train()

    def _build_optimizer(self) -> None:
        """The chunks in megatron's DistributedDataParallel (``self.model_chunks``, what forward and backward run
        through) and ``get_megatron_optimizer`` over them; on CPU through rollhpc.models.megatron_cpu.

        On CUDA each gradient bucket is reduced (reduce-scattered under the distributed optimizer) as soon as the
        backward has filled it, overlapping the last micro-batch's backward (the schedule runs the other micro-batches
        under DDP's ``no_sync``), in roles whose every parameter gets a gradient (not the critic). The parameter all-gather after the step is not deferred to the next forward
        (``overlap_param_gather``): in RL the weights leave for the generators right after each step, which needs
        them gathered at once. On CPU nothing overlaps (megatron's overlap runs on CUDA streams)."""
        import torch
        from megatron.core import optimizer as mcore_optimizer
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from rollhpc.models.megatron_pipeline import configure_chunks

        o: MegatronTrainWorkerSpec.Options = self.options
        # losses divided by global counts: DDP sums gradients instead of averaging
        configure_chunks(self.chunks)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[o.dtype]
        if dtype != torch.float32:
            # the whole model in one 16-bit dtype, as megatron's Float16Module makes it: the local layer spec builds
            # its norms in fp32, and the distributed optimizer's reshardable checkpoint cannot gather a model whose
            # parameters fill two DDP buffers of different dtypes (a size mismatch at the first save)
            for chunk in self.chunks:
                chunk.to(dtype)
        overlap = self.device.type == "cuda" and self.every_parameter_gets_a_gradient
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=o.distributed_optimizer,
        )
        self.model_chunks = [
            DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0)
            for i, c in enumerate(self.chunks)
        ]
        no_sync = [c.no_sync for c in self.model_chunks]
        for chunk in self.chunks:  # the schedules read it from the (shared) model config
            chunk.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        config = mcore_optimizer.OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            clip_grad=o.grad_clip,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=o.distributed_optimizer,
        )
        self.optimizer = mcore_optimizer.get_megatron_optimizer(config, self.model_chunks)

    @register(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch | None:
        """A LoRA policy's reference log-probs: ``compute_logprobs`` of the frozen base, adapters disabled."""
        from rollhpc.models.lora import adapters_disabled

        if self.options.lora is None:
            raise RuntimeError(
                f"role {self.ctx.role!r} has no LoRA adapters: its reference is a 'reference' role"
            )
        with adapters_disabled(*self.chunks):
            return self.compute_logprobs(batch)

    def _zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def _add_modules(self) -> None:
        """Hook for subclasses: modules trained with the GPT model (the critic's value head), added to its chunks
        before DDP wraps them, so that buckets, the optimizer and checkpoints take them like any parameter."""

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def save_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: model, optimizer, counters and RNG into ``role_dir`` (see ``checkpoint.trainer_state``)."""
        from rollhpc.checkpoint.trainer_state import save_trainer_state

        return save_trainer_state(self, Path(role_dir))

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def load_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: the state ``save_checkpoint`` wrote, back into this role."""
        from rollhpc.checkpoint.trainer_state import load_trainer_state

        return load_trainer_state(self, Path(role_dir))

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def weights_digest(self) -> str | None:
        """sha256 over the full weights in Hugging Face names and bytes (name order): equal digests mean
        bitwise-equal models whatever the layout (a critic's value head, which has no HF name, is left out).
        Collective like ``export_weights``."""
        import hashlib

        import torch

        from rollhpc.models.megatron_pipeline import export_pipeline_hf_weights

        if self.ctx.coords.edp_rank != 0:
            return None
        h = hashlib.sha256()
        named = sorted(
            (
                (n, t.detach().cpu().contiguous())
                for n, t in export_pipeline_hf_weights(self.chunks, self.vocab_size, self.tp_group)
            ),
            key=lambda x: x[0],
        )
        for name, t in named:
            h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest() if self.ctx.group_rank == 0 else None

    def _dp_sum(self, values: list[float]) -> list[float]:
        import torch.distributed as dist

        return self._all_reduce(values, dist.ReduceOp.SUM, self.dp_group)

    @register(Dispatch.DP_SPLIT)
    def train_step(self, batch: TrainingBatch, loss_config: LossConfig) -> list[dict[str, float]]:
        """``mini_batches`` optimizer steps on this batch with the ``PolicyLoss`` of ``loss_config``; a batch without
        ``old_logprob`` is trained on-policy (the step's own forward gives them), in one optimizer step.
        Returns, from each DP leader, one dict of metrics averaged over the mini-batches."""
        from rollhpc.algo.losses import PolicyLoss

        o: MegatronTrainWorkerSpec.Options = self.options
        if batch.old_logprob is None and o.mini_batches > 1:
            raise ValueError(
                f"a batch without old_logprob is trained on-policy, in one optimizer step; this role "
                f"takes mini_batches={o.mini_batches}"
            )
        t0 = time.perf_counter()
        policy_loss = PolicyLoss(loss_config)

        def loss(
            micro: MicroBatch, logits: Any, counts: TokenCounts
        ) -> tuple[Any, dict[str, float]]:
            logprob, entropy = self._logprobs(
                logits, micro["tokens"], with_entropy=policy_loss.needs_entropy
            )
            return policy_loss(logprob, entropy, micro, counts)

        skip = o.skip_zero_advantage and self._shapes_are_local()
        rows_with_gradient = (
            partial(self._rows_with_gradient, batch, loss_config=loss_config) if skip else None
        )
        out, skipped, micro_batches = self._train_mini_batches(
            batch.as_batch(), loss, rows_with_gradient
        )
        # this rank's (its replica's), over the mini-batches
        out.update(
            n_tokens=float(np.asarray(batch.loss_mask).sum()),
            train_time_s=time.perf_counter() - t0,
            lr=self.optimizer.param_groups[0]["lr"],
            rows_skipped=self._dp_sum([float(skipped)])[0],
            micro_batches=float(micro_batches),
        )
        return [out]

    def _train_mini_batches(
        self,
        batch: Batch,
        loss: MicroBatchLoss,
        rows_with_gradient: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> tuple[dict[str, float], int, int]:
        """The mini-batch loop of every trainer (actor and critic): ``mini_batches`` optimizer steps, one per
        contiguous chunk of rows, each micro-batch's ``loss(micro, output, counts)`` back-propagated and the
        gradients reduced over DP before the step. ``rows_with_gradient(mini)``: the rows of a mini-batch that run
        forward and backward (None: all). Returns the metrics (summed over each mini-batch's micro-batches and the
        DP ranks, averaged over the mini-batches), the rows skipped and the micro-batches run."""
        from rollhpc.algo.losses import TokenCounts
        from rollhpc.models.megatron_pipeline import run_schedule

        mask = np.asarray(batch["loss_mask"])
        metrics: dict[str, list[float]] = {}
        skipped = micro_batches = 0
        for mini in np.array_split(np.arange(len(batch)), self.options.mini_batches):
            trained = rows_with_gradient(mini) if rows_with_gradient is not None else mini
            skipped += len(mini) - len(trained)
            counts = TokenCounts(
                *self._dp_sum(
                    [
                        float(mask[mini].sum()),
                        float((mask[mini].sum(1) > 0).sum()),
                        float(mask[trained].sum()),
                    ]
                )
            )
            self._zero_grad()
            parts = self._parts(_mini_batch(batch, mini, trained), with_mask=True)
            micro_batches += len(parts)
            sums: dict[str, float] = {}
            with self._autocast():
                for stats in run_schedule(
                    self.model_chunks,
                    parts,
                    self._call_chunk,
                    partial(loss, counts=counts),
                    forward_only=False,
                ):
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + v
            self._finish_mini_batch(sums, metrics)
        return {k: float(np.mean(v)) for k, v in metrics.items()}, skipped, micro_batches

    @staticmethod
    def _rows_with_gradient(
        batch: TrainingBatch, rows: np.ndarray, loss_config: LossConfig
    ) -> np.ndarray:
        """The rows of ``rows`` whose loss can have a gradient: with no KL or entropy term, a row whose loss
        tokens all have advantage 0 contributes exactly zero (clipped or not, -A * ratio is 0)."""
        # (a KL with coefficient 0 is still reported)
        if loss_config.entropy_coef > 0 or batch.ref_logprob is not None:
            return rows
        adv = np.asarray(batch.advantage)[rows]
        mask = np.asarray(batch.loss_mask)[rows] > 0
        live = (adv != 0) & mask if adv.ndim == 2 else (adv != 0) & mask.any(1)
        return rows[live.reshape(len(rows), -1).any(1)]

    def _finish_mini_batch(self, sums: dict[str, float], metrics: dict[str, list[float]]) -> None:
        """Sum the metrics over DP ranks, reduce and clip the gradients, take the optimizer step."""
        keys = sorted(sums)
        for k, v in zip(keys, self._dp_sum([sums[k] for k in keys])):
            metrics.setdefault(k, []).append(v)
        from megatron.core.distributed import finalize_model_grads

        self._before_grad_sync()
        # DP reduction of the buckets, tied embedding across stages
        finalize_model_grads(self.model_chunks)
        self._set_lr()
        # clips to grad_clip, steps the main parameters, copies them back
        _, norm, _ = self.optimizer.step()
        metrics.setdefault("grad_norm", []).append(float(norm or 0.0))
        self.optimizer_steps += 1

    def _set_lr(self) -> None:
        from rollhpc.algo.lr_schedule import learning_rate

        o = self.options
        lr = learning_rate(
            self.optimizer_steps,
            lr=o.lr,
            warmup_steps=o.warmup_steps,
            schedule=o.lr_schedule,
            decay_steps=o.lr_decay_steps,
            min_lr=o.min_lr,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _before_grad_sync(self) -> None:
        import torch.distributed as dist

        self._grad_syncs += 1
        if dist.get_rank(self.dp_group) == dist.get_world_size(self.dp_group) - 1 > 0:
            # a test hook: a node can die while its peers all-reduce
            fault_injection.before_grad_sync(self._grad_syncs)

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def export_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> list[Any] | None:
        """The full weights in Hugging Face names (``adapters_only``: LoRA's adapters), packed into buckets, from
        group rank 0.

        Collective inside the first data-parallel replica (its TP ranks all-gather each parameter);
        the other replicas hold the same weights and return at once.
        """
        from rollhpc.weight_sync.buckets import pack_buckets, stamp

        named = self._exported_on_rank_zero(adapters_only)
        if named is None:
            return None
        buckets = pack_buckets(
            ((n, t.detach().cpu()) for n, t in named), int(bucket_mb * (1 << 20))
        )
        return [stamp(b) if verify else b for b in buckets]


class MegatronCriticWorker(MegatronCriticWorkerSpec, MegatronTrainWorker):
    """PPO's critic: the policy's GPT trunk (initialised from the same checkpoint) with a scalar value
    head on the final-norm hidden states of the last pipeline stage. The language-model head is
    computed but unused. The value head is a submodule of the last stage's model chunk (``value_head``, a name
    without a Hugging Face counterpart), so megatron's DDP, optimizer and checkpoints treat it like the trunk's
    parameters; every TP and DP replica initialises it alike (same seed)."""

    every_parameter_gets_a_gradient = False  # the language-model head's output is unused

    def _add_modules(self) -> None:
        import torch

        from rollhpc.models.megatron_gpt import VALUE_HEAD

        self.value_head: Any = None
        self._hidden: Any = None
        last = next((c for c in self.chunks if c.post_process), None)
        if last is None:  # not the last pipeline stage: no values computed here
            return
        head = torch.nn.Linear(
            last.config.hidden_size, 1, device=self.device, dtype=next(last.parameters()).dtype
        )
        with torch.random.fork_rng(devices=[]):
            # same head on every rank (it is replicated over TP and DP)
            torch.manual_seed(self.ctx.seed)
            torch.nn.init.normal_(head.weight, std=0.02)
        torch.nn.init.zeros_(head.bias)
        last.add_module(VALUE_HEAD, head)
        self.value_head = head
        last.decoder.final_layernorm.register_forward_hook(
            lambda m, i, out: setattr(self, "_hidden", out)
        )

    def _values(self) -> Any:
        """V(prefix up to t) for t < L-1: ``[b, L-1]``, aligned with the policy's log-prob positions, from
        the hidden states the last stage's forward just left in ``_hidden``."""
        hidden = self._hidden.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        return (
            self.value_head(hidden[:, :-1].float().to(self.value_head.weight.dtype))
            .squeeze(-1)
            .float()
        )

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch | None:
        """``{"values": [b, L-1] float32}`` from the last pipeline stage (None from the others)."""
        return self._forward_only(batch, lambda part, logits: self._values(), "values")

    @register(Dispatch.DP_SPLIT)
    def train_step(
        self, batch: ValueBatch, value_clip: float | None = 0.2
    ) -> list[dict[str, float]]:
        """Clipped value regression (``ValueLoss``) on the batch's ``returns`` with its ``old_values``, token-mean
        over ``loss_mask``, in the actor's mini-batch loop."""
        from rollhpc.algo.losses import ValueLoss

        t0 = time.perf_counter()
        value_loss = ValueLoss(value_clip)

        def loss(
            micro: MicroBatch, output: Any, counts: TokenCounts
        ) -> tuple[Any, dict[str, float]]:
            # the values of the hidden states this forward left
            return value_loss(self._values(), micro, counts)

        out, _, _ = self._train_mini_batches(batch.as_batch(), loss)
        out["train_time_s"] = time.perf_counter() - t0
        return [out]


def _mini_batch(batch: Batch, mini: np.ndarray, trained: np.ndarray) -> Batch:
    """The rows ``trained`` of ``batch``; with none (every row of the mini-batch ``mini`` skipped), its first row
    with no loss token: zero gradients (not none) keep the optimizer's step."""
    if len(trained):
        return Batch({k: np.asarray(v)[trained] for k, v in batch.data.items()})
    rows = Batch({k: np.asarray(v)[mini[:1]] for k, v in batch.data.items()})
    rows.data["loss_mask"] = np.zeros_like(np.asarray(rows["loss_mask"]))
    return rows


def _cut(rows: np.ndarray, width: int | None, full: int) -> np.ndarray:
    """``rows`` cut to ``width`` token columns: ``[b, full]`` tokens to ``width``, ``[b, full - 1]`` per-position
    arrays (masks, log-probs, advantages) to ``width - 1``; anything else (per-row values) as it is."""
    if width is None or rows.ndim < 2 or width >= full:
        return rows
    if rows.shape[1] == full:
        return rows[:, :width]
    return rows[:, : width - 1] if rows.shape[1] == full - 1 else rows


def _load_safetensors(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
