"""Train and reference roles on megatron-core: a ``GPTModel`` built from a Hugging Face checkpoint.

Each rank of the role joins a torch.distributed world of the role's ranks (gloo on CPU, NCCL on GPU;
rendezvous address from role rank 0 over the role's MPI communicator), then megatron's parallel state
with the role's TP/CP/EP/DP layout; the layout's data-parallel rank must equal megatron's, which is
how the controller's DP split and megatron's gradient groups agree.

The trainer takes batches of padded token rows (prompt + response) with a loss mask over response
targets, runs the policy loss of ``rollhpc.algo.losses`` in micro-batches with gradients summed over
data-parallel ranks by megatron's DDP (denominators are global, so DP=2 gives the DP=1 gradient), and
exports its weights in Hugging Face names, bucketed, for the generators. The reference role is the same model frozen; the critic
(PPO) is the same trunk with a value head.

Every forward and backward goes through megatron's own schedules (``models.megatron_pipeline``), so
pipeline parallelism (``pp``, and ``vpp`` virtual stages: a rank holds one model chunk per virtual stage)
is the same code path as pp=1: the loss, log-probs and values are computed on the last stage, which is
why the last stage's TP rank 0 is its replica's DP leader (``parallel.RankCoords.is_dp_leader``).

The trainer and critic run on megatron-core's own DistributedDataParallel and optimizer (fp32 main parameters,
the distributed optimizer, clipping by the global norm); on CPU through ``models.megatron_cpu``.

Left out here: context parallelism (megatron-core's local attention asserts cp == 1; it needs Transformer
Engine's attention on CUDA: refused at config load), sequence packing.

Their import paths (``rollhpc.workers.megatron_policy:MegatronTrainWorker``, ...) are the role names in every
user's config; the machinery they call lives beside them: building the model and optimizer
(``workers.megatron_build``), cutting micro-batches (``workers.megatron_batches``), the schedules
(``models.megatron_pipeline``), checkpoints (``checkpoint.trainer_state``) and offload (``workers.offload``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rollhpc.algo.losses import MicroBatch, PolicyLoss, TokenCounts, ValueLoss
from rollhpc.algo.lr_schedule import learning_rate
from rollhpc.algo.objective import LossConfig
from rollhpc.batch import Batch, TrainingBatch, ValueBatch
from rollhpc.checkpoint.trainer_state import load_trainer_state, save_trainer_state
from rollhpc.models.hf_weight_map import VALUE_HEAD, _hf_dict
from rollhpc.models.lora import adapters_disabled
from rollhpc.models.megatron_cpu import import_megatron
from rollhpc.models.megatron_hf import weights_sha256
from rollhpc.models.megatron_pipeline import export_pipeline_hf_weights, run_schedule
from rollhpc.models.vocab_parallel import token_logprobs
from rollhpc.protocol.worker import Worker, WorkerContext
from rollhpc.testing import fault_injection
from rollhpc.weight_sync.buckets import pack_buckets, stamp
from rollhpc.workers import megatron_batches
from rollhpc.workers.megatron_build import (
    attach_adapters,
    build_chunks,
    build_optimizer,
    init_parallel_state,
    init_role_distributed,
)
from rollhpc.workers.megatron_policy_spec import (
    MegatronCriticWorkerSpec,
    MegatronPolicyWorkerSpec,
    MegatronReferenceWorkerSpec,
    MegatronTrainWorkerSpec,
)
from rollhpc.workers.megatron_offload import MegatronStateOffloader
from rollhpc.workers.router_replay import Forward, RouteReplayer
from rollhpc.workers.megatron_weight_channel import WeightChannelMixin
from rollhpc.workers.offload import StateOffloader, gpu_memory

import_megatron()  # megatron-core's first import: on CPU without torch.compile's imports (megatron_cpu)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import finalize_model_grads  # noqa: E402
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region  # noqa: E402
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402

# a micro-batch's loss on the last stage's output, given its mini-batch's counts: (loss, metrics)
MicroBatchLoss = Callable[
    [MicroBatch, torch.Tensor, TokenCounts], tuple[torch.Tensor, dict[str, float]]
]


class MegatronPolicyWorker(MegatronPolicyWorkerSpec, Worker):
    """Shared by the train and reference roles: model construction and log-probabilities (``Options``,
    ``trainable``, the load-time checks and the memory estimate: its spec, megatron_policy_spec)."""

    def __init__(self, ctx: WorkerContext, options: MegatronPolicyWorkerSpec.Options):
        super().__init__(ctx, options)
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
        init_parallel_state(ctx, layout)
        self.hf_config = _hf_dict(model_dir)
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.chunks = build_chunks(
            ctx.role,
            self.hf_config,
            model_dir,
            layout,
            dtype=options.dtype,
            recompute=getattr(options, "recompute", "none"),
            routing_replay=options.router_replay != "none",
        )
        self.replayer = RouteReplayer.of(self.chunks, options.router_replay, ctx.role)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group()
        self._grad_syncs = 0  # gradient reductions so far (a test hook counts them: rollhpc.testing.fault_injection)
        self.last_stage = parallel_state.is_pipeline_last_stage()
        # under sequence parallelism (a MoE model at tp > 1) each TP rank holds 1/tp of every sequence
        self.sequence_split = layout.tp if self.chunks[0].config.sequence_parallel else 1
        self.device = next(self.chunks[0].parameters()).device
        for chunk in self.chunks:
            if not self.trainable:
                chunk.requires_grad_(False)
                chunk.eval()

    def offload_states(self, parts: list[str]) -> dict[str, float]:
        """Move ``parts`` (parameters, gradients, optimizer) to host memory, freeing the GPU for a colocated role
        (rollhpc.controller.colocation); returns bytes moved, seconds and this process's GPU memory after."""
        return {**self._offloader().offload(parts), **gpu_memory()}

    def reload_states(self, parts: list[str]) -> dict[str, float]:
        """Bring ``parts`` back onto this rank's device (the inverse of ``offload_states``)."""
        return {**self._offloader().reload(parts), **gpu_memory()}

    def _offloader(self) -> StateOffloader | MegatronStateOffloader:
        if getattr(self, "_state_offloader", None) is None:
            # parameters in DDP's buffers, main parameters and moments in megatron's optimizer
            if self.trainable:
                self._state_offloader = MegatronStateOffloader(
                    self.model_chunks, self.optimizer, self.device
                )
            else:
                self._state_offloader = StateOffloader(self.chunks, None, self.device)
        return self._state_offloader

    def _parts(self, batch: Batch, with_mask: bool) -> list[dict[str, torch.Tensor]]:
        """The batch's micro-batches as tensors on this rank's device (``megatron_batches.micro_batch_parts``)."""
        return megatron_batches.micro_batch_parts(
            batch,
            with_mask,
            device=self.device,
            interleaved=self.ctx.layout.vpp is not None,
            local_shapes=self._shapes_are_local(),
            index=self._micro_batch_index,
        )

    def _micro_batch_index(self, n: int, ends: np.ndarray | None, full: int) -> list[np.ndarray]:
        """``megatron_batches.micro_batch_index`` for this rank's layout and options."""
        return megatron_batches.micro_batch_index(
            n,
            ends,
            full,
            pp=self.ctx.layout.pp,
            interleaved=self.ctx.layout.vpp is not None,
            micro_batch_size=self.options.micro_batch_size,
            max_tokens=self.options.max_tokens_per_micro_batch,
            local_shapes=self._shapes_are_local(),
            role_max=self._role_max,
        )

    def _role_max(self, values: list[float]) -> list[float]:
        """The largest of each value over every rank of the role (a collective)."""
        return self._all_reduce(values, dist.ReduceOp.MAX, None)

    def _all_reduce(
        self, values: list[float], op: dist.ReduceOp, group: dist.ProcessGroup | None
    ) -> list[float]:
        """``values`` reduced by ``op`` over ``group`` (None: the role's ranks), in float64; a collective."""
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

    def _call_chunk(self, chunk: torch.nn.Module, part: MicroBatch) -> torch.Tensor:
        """One chunk's forward on a micro-batch (later stages take their input from the schedule), its MoE
        routes replayed or recorded as ``self.replayer`` was started."""
        tokens = part["tokens"]
        length = tokens.shape[1]
        # a sequence split over TP ranks needs a length tp divides: padding after the row's last token changes
        # none of its (causal) outputs, and the padded positions' logits are cut off again
        pad = -length % self.sequence_split
        if pad:
            tokens = torch.nn.functional.pad(tokens, (0, pad))
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if self.replayer is not None:
            self.replayer.before(chunk, part, tokens.shape[1])
        out = chunk(tokens, positions, None)  # last stage: logits [b, L, V_padded / tp]
        if self.replayer is not None:
            self.replayer.after(chunk, part)
        if pad and get_attr_wrapped_model(chunk, "post_process"):
            out = out[:, :length]
        return out

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob, entropy) of every next token: ``[b, L-1]`` each, from the last stage's logits."""
        return token_logprobs(
            logits[:, :-1],
            tokens[:, 1:],
            self.vocab_size,
            tp_rank=self.tp_rank,
            tp_size=self.ctx.layout.tp,
            tp_group=self.tp_group,
            with_entropy=with_entropy,
        )

    def _autocast(self) -> torch.autocast:
        """The forward/backward precision context: bfloat16 matmuls under ``mixed_precision: bf16``."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.options.mixed_precision == "bf16"
        )

    def _forward_only(
        self,
        batch: Batch,
        result: Callable[[MicroBatch, torch.Tensor], torch.Tensor],
        key: str,
    ) -> Batch | None:
        """``result(part, output) -> [b, L-1] tensor`` for every row of the batch, through the schedule
        without gradients; the rows as ``{key: ...}`` on the last stage, None on the others."""
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

    def compute_logprobs(self, batch: Batch) -> Batch | None:
        """log p(token) of every next token under the current weights: ``{"logprob": [b, L-1] float32}``
        (from the last pipeline stage; None from the others, which are not DP leaders)."""
        return self._logprob_forward(batch, "old_logprob")

    def _logprob_forward(self, batch: Batch, forward: Forward) -> Batch | None:
        """``compute_logprobs`` as the ``forward`` of a step (which routes it replays or records)."""
        if self.replayer is not None:
            batch = self.replayer.prepare(batch, forward)
        return self._forward_only(
            batch, lambda part, logits: self._logprobs(logits, part["tokens"])[0], "logprob"
        )


class MegatronReferenceWorker(MegatronReferenceWorkerSpec, MegatronPolicyWorker):
    """The frozen initial policy: log-probabilities for the KL term."""


class MegatronTrainWorker(WeightChannelMixin, MegatronTrainWorkerSpec, MegatronPolicyWorker):
    # under overlap_grad_reduce a bucket is reduced once each of its parameters' gradients is ready; a parameter the
    # loss never reaches would hold its bucket back (megatron asserts at finalize): no overlap then
    every_parameter_gets_a_gradient = True

    def __init__(self, ctx: WorkerContext, options: MegatronTrainWorkerSpec.Options):
        super().__init__(ctx, options)
        if options.lora is not None:
            attach_adapters(ctx.role, self.chunks, options.lora)
        self._add_modules()
        self._build_optimizer()
        self.optimizer_steps = 0
        for chunk in self.chunks:
            chunk.train()

    def _build_optimizer(self) -> None:
        """The chunks in megatron's DDP (``self.model_chunks``, what forward and backward run through) and its
        optimizer (``megatron_build.build_optimizer``). On CUDA each gradient bucket is reduced as soon as the
        backward has filled it, in roles whose every parameter gets a gradient (not the critic); on CPU nothing
        overlaps (megatron's overlap runs on CUDA streams)."""
        overlap = self.device.type == "cuda" and self.every_parameter_gets_a_gradient
        self.model_chunks, self.optimizer = build_optimizer(
            self.chunks, self.options, overlap_grad_reduce=overlap
        )

    def compute_ref_logprobs(self, batch: Batch) -> Batch | None:
        """A LoRA policy's reference log-probs: ``compute_logprobs`` of the frozen base, adapters disabled."""
        if self.options.lora is None:
            raise RuntimeError(
                f"role {self.ctx.role!r} has no LoRA adapters: its reference is a 'reference' role"
            )
        with adapters_disabled(*self.chunks):
            return self._logprob_forward(batch, "reference")

    def _zero_grad(self) -> None:
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)

    def _add_modules(self) -> None:
        """Hook for subclasses: modules trained with the GPT model (the critic's value head), added to its chunks
        before DDP wraps them, so that buckets, the optimizer and checkpoints take them like any parameter."""

    def save_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: model, optimizer, counters and RNG into ``role_dir`` (see ``checkpoint.trainer_state``)."""
        return save_trainer_state(self, Path(role_dir))

    def load_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Collective: the state ``save_checkpoint`` wrote, back into this role."""
        return load_trainer_state(self, Path(role_dir))

    def weights_digest(self) -> str | None:
        """sha256 over the full weights in Hugging Face names and bytes (name order): equal digests mean
        bitwise-equal models whatever the layout (a critic's value head, which has no HF name, is left out).
        Collective like ``export_weights``."""
        if self.ctx.coords.edp_rank != 0:
            return None
        digest = weights_sha256(
            export_pipeline_hf_weights(self.chunks, self.vocab_size, self.tp_group)
        )
        return digest if self.ctx.group_rank == 0 else None

    def _dp_sum(self, values: list[float]) -> list[float]:
        return self._all_reduce(values, dist.ReduceOp.SUM, self.dp_group)

    def train_step(self, batch: TrainingBatch, loss_config: LossConfig) -> list[dict[str, float]]:
        """``mini_batches`` optimizer steps on this batch with the ``PolicyLoss`` of ``loss_config``; a batch without
        ``old_logprob`` is trained on-policy (the step's own forward gives them), in one optimizer step.
        Returns, from each DP leader, one dict of metrics averaged over the mini-batches."""
        o: MegatronTrainWorkerSpec.Options = self.options
        if batch.old_logprob is None and o.mini_batches > 1:
            raise ValueError(
                f"a batch without old_logprob is trained on-policy, in one optimizer step; this role "
                f"takes mini_batches={o.mini_batches}"
            )
        t0 = time.perf_counter()
        policy_loss = PolicyLoss(loss_config)

        def loss(
            micro: MicroBatch, logits: torch.Tensor, counts: TokenCounts
        ) -> tuple[torch.Tensor, dict[str, float]]:
            logprob, entropy = self._logprobs(
                logits, micro["tokens"], with_entropy=policy_loss.needs_entropy
            )
            return policy_loss(logprob, entropy, micro, counts)

        skip = o.skip_zero_advantage and self._shapes_are_local()
        rows_with_gradient = (
            partial(megatron_batches.rows_with_gradient, batch, loss_config=loss_config)
            if skip
            else None
        )
        rows = batch.as_batch()
        if self.replayer is not None:
            rows = self.replayer.prepare(rows, "train")
        out, skipped, micro_batches = self._train_mini_batches(rows, loss, rows_with_gradient)
        if self.replayer is not None:
            # over the role's ranks: each layer's routes once per TP rank, so the share is exact
            replayed, differing = self._all_reduce(
                list(self.replayer.take_counts()), dist.ReduceOp.SUM, None
            )
            out["route_replay_differ_frac"] = differing / max(replayed, 1.0)
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
            parts = self._parts(
                megatron_batches.mini_batch_rows(batch, mini, trained), with_mask=True
            )
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

    def _finish_mini_batch(self, sums: dict[str, float], metrics: dict[str, list[float]]) -> None:
        """Sum the metrics over DP ranks, reduce and clip the gradients, take the optimizer step."""
        keys = sorted(sums)
        for k, v in zip(keys, self._dp_sum([sums[k] for k in keys])):
            metrics.setdefault(k, []).append(v)
        self._before_grad_sync()
        # DP reduction of the buckets, tied embedding across stages
        finalize_model_grads(self.model_chunks)
        self._set_lr()
        # clips to grad_clip, steps the main parameters, copies them back
        _, norm, _ = self.optimizer.step()
        metrics.setdefault("grad_norm", []).append(float(norm or 0.0))
        self.optimizer_steps += 1

    def _set_lr(self) -> None:
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
        self._grad_syncs += 1
        if dist.get_rank(self.dp_group) == dist.get_world_size(self.dp_group) - 1 > 0:
            # a test hook: a node can die while its peers all-reduce
            fault_injection.before_grad_sync(self._grad_syncs)

    def export_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> list[Any] | None:
        """The full weights in Hugging Face names (``adapters_only``: LoRA's adapters), packed into buckets, from
        group rank 0.

        Collective inside the first data-parallel replica (its TP ranks all-gather each parameter);
        the other replicas hold the same weights and return at once.
        """
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
        self.value_head: torch.nn.Linear | None = None
        self._hidden: torch.Tensor | None = None
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

    def _values(self, length: int) -> torch.Tensor:
        """V(prefix up to t) for t < L-1: ``[b, L-1]`` (``length`` = L, the micro-batch's token columns), aligned
        with the policy's log-prob positions, from the hidden states the last stage's forward just left in
        ``_hidden``."""
        hidden = self._hidden
        if self.sequence_split > 1:
            # each TP rank holds 1/tp of the sequence; the head is replicated, so each rank computes every value
            # and its gradient goes back to the rank's own part alone (split, not summed)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        hidden = hidden.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        return (
            self.value_head(hidden[:, : length - 1].float().to(self.value_head.weight.dtype))
            .squeeze(-1)
            .float()
        )

    def compute_values(self, batch: Batch) -> Batch | None:
        """``{"values": [b, L-1] float32}`` from the last pipeline stage (None from the others)."""
        return self._forward_only(
            batch, lambda part, logits: self._values(part["tokens"].shape[1]), "values"
        )

    def train_step(
        self, batch: ValueBatch, value_clip: float | None = 0.2
    ) -> list[dict[str, float]]:
        """Clipped value regression (``ValueLoss``) on the batch's ``returns`` with its ``old_values``, token-mean
        over ``loss_mask``, in the actor's mini-batch loop."""
        t0 = time.perf_counter()
        value_loss = ValueLoss(value_clip)

        def loss(
            micro: MicroBatch, output: torch.Tensor, counts: TokenCounts
        ) -> tuple[torch.Tensor, dict[str, float]]:
            # the values of the hidden states this forward left
            return value_loss(self._values(micro["tokens"].shape[1]), micro, counts)

        out, _, _ = self._train_mini_batches(batch.as_batch(), loss)
        out["train_time_s"] = time.perf_counter() - t0
        return [out]
