"""The plan-time side of the megatron roles (rollhpc.workers.megatron_policy): their options, what megatron-core
would refuse of a layout or a model (checked at config load), a rank's GPU memory (``rollhpc plan``), and the
remote methods the controller calls (their ``@register`` contracts; the runtime classes implement them).

Light on purpose: config loading, ``plan`` and ``submit --dry-run`` read this on a login node without torch or
megatron (rollhpc.protocol.spec); the runtime classes subclass these specs, so the two cannot disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollhpc.models.lora_config import LoraConfig, adapter_parameter_count
from rollhpc.parallel import ParallelLayout, pipeline_stage_layers
from rollhpc.placement.memory_plan import (
    ModelShape,
    activation_bytes,
    dtype_bytes,
    forward_activation_bytes,
    megatron_stage_params,
    megatron_stage_split,
)
from rollhpc.protocol.dispatch import Collect, Dispatch, register
from rollhpc.protocol.spec import OffloadingWorkerSpec

if TYPE_CHECKING:
    from rollhpc.algo.objective import LossConfig
    from rollhpc.batch import Batch, TrainingBatch, ValueBatch
    from rollhpc.weight_sync.buckets import Bucket

__all__ = [
    "MegatronCriticWorkerSpec",
    "MegatronPolicyWorkerSpec",
    "MegatronReferenceWorkerSpec",
    "MegatronTrainWorkerSpec",
]


class MegatronPolicyWorkerSpec(OffloadingWorkerSpec):
    """Shared by the train and reference roles: the model, its dtype and micro-batches."""

    trainable = False

    @dataclass(kw_only=True)
    class Options:
        model_dir: str  # Hugging Face checkpoint (config.json + safetensors)
        micro_batch_size: int = 16  # rows per forward/backward
        # > 0: micro-batches packed up to this many tokens each (rows x the micro-batch's longest row) instead of
        # micro_batch_size rows: rows of unequal length (long-tailed responses) cost their tokens, and each
        # forward's activations stay bounded. Losses and gradients are the fixed-size ones (the loss divides by
        # the batch's global token count, whatever the split)
        max_tokens_per_micro_batch: int = 0
        # of the parameters, gradients and optimizer state
        dtype: Literal["float32", "bfloat16"] = "float32"
        # bf16: forward and backward matmuls in bfloat16 under torch.autocast over float32 parameters (which are
        # then their own main parameters: no fp32 copy), log-probs and the loss in float32. dtype=bfloat16 instead
        # keeps the weights themselves in bf16 (half the memory) beside the optimizer's fp32 main copy. On CPUs
        # with bf16 units (AVX512-BF16, AMX) a matmul runs ~3x faster
        mixed_precision: Literal["off", "bf16"] = "off"
        threads: int = 0  # torch intra-op threads on CPU (0: leave torch's default)
        # MoE routing replay (rollhpc.workers.router_replay): each token's experts fixed to those of the policy
        # that sampled. r3: the generator's, given with the batch (old-log-prob, reference and training
        # forwards); r2: the train role's own, recorded in its old-log-prob forward and replayed in training
        router_replay: Literal["none", "r2", "r3"] = "none"

        def __post_init__(self) -> None:
            if self.micro_batch_size < 1 or self.max_tokens_per_micro_batch < 0:
                raise ValueError(
                    f"micro_batch_size must be >= 1 and max_tokens_per_micro_batch >= 0, got "
                    f"{self.micro_batch_size} and {self.max_tokens_per_micro_batch}"
                )
            if self.mixed_precision == "bf16" and self.dtype != "float32":
                raise ValueError(
                    f"mixed_precision=bf16 computes in bfloat16 over float32 parameters; with "
                    f"dtype={self.dtype} the parameters are already 16-bit: use one of the two"
                )

    @classmethod
    def gpu_memory(
        cls,
        options: Options,
        layout: ParallelLayout,
        shape: ModelShape,
        *,
        seq_len: int,
        gpu_bytes: float,
    ) -> dict[str, float]:
        """Bytes a rank holds on its GPU (rollhpc.placement.memory_plan): its stage's parameters, and the
        activations of a forward (the trainer adds gradients, optimizer states and a backward's)."""
        size = dtype_bytes(options.dtype)
        params = megatron_stage_params(shape, layout.tp, layout.pp, layout.ep, layout.etp)
        rows = _micro_batch_rows(options, seq_len)
        # a forward alone keeps one layer's activations at a time, and the whole head's logits
        forward = forward_activation_bytes(
            shape, layout.tp, rows, seq_len, size, ep=layout.ep, etp=layout.etp
        )
        # routing replay's routes ride with each forward's activations
        routes = 0
        if getattr(options, "router_replay", "none") != "none" and shape.experts:
            routes = _route_bytes(shape, layout, rows, seq_len)
        frozen = {"parameters": float(params * size), "activations": float(forward + routes)}
        if not cls.trainable:
            return frozen
        memory = _with_training_memory(frozen, options, layout, shape, seq_len)
        memory["activations"] += float(routes)
        return memory

    @classmethod
    def check_layout(cls, layout: ParallelLayout) -> None:
        """Refuse at config load what megatron-core's local layer spec cannot run."""
        if layout.cp > 1:
            raise ValueError(
                f"cp={layout.cp}: context parallelism needs Transformer Engine's attention on CUDA "
                "(megatron-core's local attention, which these roles build, asserts cp == 1); use "
                "tp/pp/dp (and ep for MoE)"
            )

    @classmethod
    def check_model(cls, layout: ParallelLayout, options: Options) -> None:
        """megatron-core's rules for splitting the model (TransformerConfig's checks, which would otherwise fail
        in every rank's start-up): tp divides the attention heads, the KV heads (or they divide tp: megatron
        replicates them) and the FFN width; pp (x vpp) stages divide the layers; ep divides the experts. The
        vocabulary needs nothing: megatron pads it to a multiple of tp."""
        path = Path(getattr(options, "model_dir", "") or "") / "config.json"
        if not path.is_file():
            return
        hf = json.loads(path.read_text())
        heads = int(hf.get("num_attention_heads") or 0)
        kv = int(hf.get("num_key_value_heads") or heads)
        layers = int(hf.get("num_hidden_layers") or 0)
        ffn = int(hf.get("intermediate_size") or 0)
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        tp = layout.tp
        problems = []
        if heads and heads % tp:
            problems.append(f"tp={tp} does not divide the model's {heads} attention heads")
        if kv and kv % tp and tp % kv:
            problems.append(f"tp={tp} and the model's {kv} KV heads: one must divide the other")
        if ffn and ffn % tp:
            problems.append(
                f"tp={tp} does not divide the model's FFN width (intermediate_size {ffn})"
            )
        if layers:
            try:
                # megatron's even split, as plan draws it
                pipeline_stage_layers(layers, layout.pp, layout.vpp)
            except ValueError as e:
                problems.append(str(e))
        if layout.ep > 1 and (not experts or experts % layout.ep):
            problems.append(f"ep={layout.ep} does not divide the model's {experts} experts")
        if experts and layout.tp > 1 and getattr(options, "lora", None) is not None:
            problems.append(
                f"LoRA on a MoE model at tp={layout.tp}: the model runs sequence parallelism there (megatron's "
                "MoE layers need it at tp > 1), which the adapters do not follow yet; use tp 1 with ep"
            )
        replay = getattr(options, "router_replay", "none")
        if replay != "none" and not experts:
            problems.append(
                f"router_replay={replay} replays the experts of MoE layers, and this model has none "
                "(a dense model routes nothing: router_replay: none)"
            )
        if replay == "r2" and not cls.trainable:
            problems.append(
                "router_replay=r2 replays a trainer's own routes: a train role's option"
            )
        if problems:
            raise ValueError(f"{'; '.join(problems)} ({path})")

    @register(Dispatch.DP_SPLIT)
    def compute_logprobs(self, batch: Batch) -> Batch | None:
        """``{"logprob": [b, L-1] float32}`` per row, from the DP leaders."""
        raise NotImplementedError


class MegatronReferenceWorkerSpec(MegatronPolicyWorkerSpec):
    """The frozen initial policy: a forward's memory only."""


class MegatronTrainWorkerSpec(MegatronPolicyWorkerSpec):
    """The trainer: the optimizer's settings, and gradients and optimizer state in its memory. The optimizer
    stack is megatron-core's: the model chunks in its DistributedDataParallel (gradients in fp32 buckets,
    reduce-scattered or all-reduced), its optimizer with fp32 main parameters and Adam moments (dtype=bfloat16
    learns at small lr: the bf16 weights are the rounded main parameters), the global grad norm and clipping
    through it, no weight decay on biases and norms."""

    trainable = True

    @dataclass(kw_only=True)
    class Options(MegatronPolicyWorkerSpec.Options):
        lr: float = 1e-5
        weight_decay: float = 0.0
        betas: tuple[float, float] = (0.9, 0.999)
        grad_clip: float = 1.0  # global gradient norm cap (0: off)
        # optimizer steps per train_step (PPO-style updates within one rollout batch)
        mini_batches: int = 1
        warmup_steps: int = 0  # linear learning-rate warm-up over this many optimizer steps
        # after the warm-up: lr throughout, or a decay to min_lr over lr_decay_steps optimizer steps (rollhpc.algo.
        # lr_schedule; a run's optimizer steps are its steps x mini_batches)
        lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
        lr_decay_steps: int = 0
        min_lr: float = 0.0
        # activation recomputation in the backward (megatron's TransformerConfig): "selective" recomputes attention's
        # score matrices, "full" each layer from its input; the memory plan counts what each keeps
        recompute: Literal["none", "selective", "full"] = "none"
        # main parameters and moments sharded over the DP group (ZeRO-1)
        distributed_optimizer: bool = True
        # how checkpoints hold the distributed optimizer's state (rollhpc.checkpoint.trainer_state): "sharded", each
        # rank its own shard (no gather, no extra memory; resumes at another DP size, same TP/PP/EP), or
        # "reshardable", gathered per parameter on each DP group's rank 0 (which then holds the role's whole
        # optimizer state in memory; resumes at any TP/PP/DP layout). Megatron-LM saves the first by default
        optimizer_checkpoint: Literal["sharded", "reshardable"] = "sharded"
        # no forward/backward for rows whose gradient is exactly zero: every loss token has advantage 0 (GRPO's
        # groups where all samples scored the same) and the loss has no KL (no reference) or entropy term. The loss, its
        # gradient and the update are unchanged (the global token and row counts still include them); the
        # trainer's time drops by the share of such rows. (Off under expert parallelism: DP ranks must run alike.)
        skip_zero_advantage: bool = True
        # LoRA (rollhpc.models.lora): the checkpoint's weights frozen, adapters on lora.target trained; the weights
        # sent to the generators are the base with the adapters merged, and the base without them is the reference
        # policy (compute_ref_logprobs: no reference role needed)
        lora: LoraConfig | None = None

        def __post_init__(self) -> None:
            super().__post_init__()
            if self.lr <= 0 or self.mini_batches < 1 or self.grad_clip < 0 or self.warmup_steps < 0:
                raise ValueError(
                    "lr must be > 0, mini_batches >= 1, grad_clip >= 0, warmup_steps >= 0"
                )
            if self.lr_schedule != "constant" and (
                self.lr_decay_steps < 1 or not 0 <= self.min_lr <= self.lr
            ):
                raise ValueError(
                    f"lr_schedule={self.lr_schedule} decays lr to min_lr over lr_decay_steps: give "
                    f"lr_decay_steps >= 1 and 0 <= min_lr <= lr "
                    f"(got {self.lr_decay_steps}, {self.min_lr})"
                )

    @register(Dispatch.RANK_ZERO)
    def open_weight_channel(self) -> tuple[str, int]:
        """The address of the store the weight sync meets at (opened on rank 0)."""
        raise NotImplementedError

    @register(Dispatch.RANK_ZERO)
    def join_weight_channel(self, world: int) -> None:
        """Rank 0 joins the broadcast group of ``world`` members as its rank 0."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def broadcast_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> int | None:
        """Bytes rank 0 broadcast to the generators."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def share_weights(
        self,
        receivers: int,
        tag: str,
        bucket_mb: float = 512.0,
        verify: bool = False,
        adapters_only: bool = False,
    ) -> dict[str, Any] | None:
        """Rank 0's ``SyncStats`` of the weights streamed to colocated generators."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def compute_ref_logprobs(self, batch: Batch) -> Batch | None:
        """A LoRA policy's reference ``{"logprob": ...}``: the frozen base's, from the DP leaders."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def save_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Rank 0's record of the trainer state saved into ``role_dir``."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def load_checkpoint(self, role_dir: str) -> dict[str, Any]:
        """Rank 0's record of the trainer state loaded from ``role_dir``."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def weights_digest(self) -> str | None:
        """sha256 of the full weights in Hugging Face names and bytes."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def train_step(self, batch: TrainingBatch, loss_config: LossConfig) -> list[dict[str, float]]:
        """One dict of metrics per DP leader, averaged over the step's mini-batches."""
        raise NotImplementedError

    @register(Dispatch.ONE_TO_ALL, Collect.RANK_ZERO)
    def export_weights(
        self, bucket_mb: float = 64.0, verify: bool = False, adapters_only: bool = False
    ) -> list[Bucket] | None:
        """The full weights (or LoRA's adapters) in Hugging Face names, packed into buckets."""
        raise NotImplementedError


class MegatronCriticWorkerSpec(MegatronTrainWorkerSpec):
    """PPO's critic: the trainer's options and memory (its value head is one row of the hidden size)."""

    @register(Dispatch.DP_SPLIT)
    def compute_values(self, batch: Batch) -> Batch | None:
        """``{"values": [b, L-1] float32}`` per row, from the DP leaders."""
        raise NotImplementedError

    @register(Dispatch.DP_SPLIT)
    def train_step(  # type: ignore[override]
        self, batch: ValueBatch, value_clip: float | None = 0.2
    ) -> list[dict[str, float]]:
        """One dict of the value loss's metrics per DP leader."""
        raise NotImplementedError


def _route_bytes(shape: ModelShape, layout: ParallelLayout, rows: int, seq_len: int) -> int:
    """Routing replay's GPU bytes: a micro-batch's routes (int16, every MoE layer) and each local layer's int64
    targets, kept until the backward, for up to pp micro-batches in flight (1F1B's warm-up)."""
    tokens = rows * seq_len * shape.topk
    local_layers = -(-shape.layers // layout.pp)
    return layout.pp * tokens * (2 * shape.layers + 8 * local_layers)


def _micro_batch_rows(options: MegatronPolicyWorkerSpec.Options, seq_len: int) -> int:
    """Rows of a micro-batch; under a token budget its worst case: full-length rows."""
    if options.max_tokens_per_micro_batch:
        return max(1, options.max_tokens_per_micro_batch // seq_len)
    return options.micro_batch_size


def _stage_adapter_parameters(lora: LoraConfig, layout: ParallelLayout, shape: ModelShape) -> int:
    """LoRA's adapter parameters on one rank: its PP stage's layers, split over TP."""
    return adapter_parameter_count(
        lora,
        shape.hidden,
        shape.intermediate,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
        -(-shape.layers // layout.pp),
        layout.tp,
    )


def _with_training_memory(
    frozen: dict[str, float],
    options: MegatronTrainWorkerSpec.Options,
    layout: ParallelLayout,
    shape: ModelShape,
    seq_len: int,
) -> dict[str, float]:
    """A forward's parts (its activations as ``forward_activations``), and DDP's fp32 gradient buckets; fp32
    main parameters (a copy, unless the parameters are fp32 themselves) and two fp32 Adam moments, sharded
    by the distributed optimizer: dense parameters over the data-parallel group, routed experts over the
    expert-data-parallel group; and a backward's activations."""
    size = dtype_bytes(options.dtype)
    parameters = frozen["parameters"]
    params = megatron_stage_params(shape, layout.tp, layout.pp, layout.ep, layout.etp)
    dense, experts = megatron_stage_split(shape, layout.tp, layout.pp, layout.ep, layout.etp)
    if options.lora is not None:
        # only the adapters train: gradients and optimizer state for them alone
        adapters = _stage_adapter_parameters(options.lora, layout, shape)
        parameters += float(adapters * size)
        dense, experts, params = adapters, 0, adapters
    state = 4 * 2 + (0 if size == 4 else 4)
    shards = (layout.dp, layout.edp) if options.distributed_optimizer else (1, 1)
    rows = _micro_batch_rows(options, seq_len)
    activations = activation_bytes(
        shape,
        layout.tp,
        layout.pp,
        rows,
        seq_len,
        size,
        options.recompute,
        ep=layout.ep,
        etp=layout.etp,
    )
    return {
        "parameters": parameters,
        "gradients": float(params * 4),
        "optimizer": float(state * (dense / shards[0] + experts / shards[1])),
        "activations": float(activations),
        "forward_activations": frozen["activations"],
    }
