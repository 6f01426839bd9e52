"""The plan-time side of the training pipelines (rollhpc.pipelines.training, rlvr, agentic): the options both take,
what each stage of a step holds on the GPUs (``rollhpc plan``), and the load-time checks they share. Light
(rollhpc.protocol.spec): config loading and ``plan`` read it without the run loop, the weight sync or torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from rollhpc.algo.kl_control import KlControlConfig
from rollhpc.algo.objective import LossConfig
from rollhpc.checkpoint.run_checkpoint import CheckpointConfig
from rollhpc.protocol.spec import PipelineSpec
from rollhpc.rollout.scheduler_config import SchedulerConfig

if TYPE_CHECKING:
    from rollhpc.models.lora_config import LoraConfig

__all__ = [
    "TRAINER_PARTS",
    "TrainingOptions",
    "TrainingPipelineSpec",
    "check_critic_role",
    "check_lora_serving",
    "check_route_source",
    "replayed_routes",
    "train_lora",
]

TRAINER_PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(kw_only=True)
class TrainingOptions:
    """What every training pipeline's ``Options`` has (RLVR's and agentic's derive from this and call
    ``super().__post_init__()``): the policy, the step budget, the objective, the rollout, the weight sync, and
    what the run leaves in its directory besides metrics and rollouts."""

    model_dir: str  # the starting policy (Hugging Face directory), e.g. the SFT warm start
    steps: int = 100
    algorithm: Literal["grpo", "rloo", "reinforce_pp", "ppo"] = "grpo"  # ppo needs a critic role
    grpo_scale: bool = True  # divide by the group's std (False: Dr. GRPO)
    loss: LossConfig = field(default_factory=LossConfig)
    # fixed, or adaptive to a target KL
    kl_control: KlControlConfig = field(default_factory=KlControlConfig)
    gamma: float = 1.0  # PPO/GAE discount and lambda
    lam: float = 0.95
    value_clip: float | None = 0.2  # PPO critic's value clipping (None: off)
    rollout: SchedulerConfig = field(default_factory=SchedulerConfig)
    # an exactly on-policy update (the trainer's own old log-probs, synchronous rollout, one optimizer step per
    # batch, no KL) needs no separate old-log-prob forward: the train step's own forward gives them
    skip_on_policy_logprobs: bool = True
    eval_every: int = 10
    # trainer -> generators: auto (per generator from the plan: CUDA IPC on the GPU of the trainer's rank 0,
    # the broadcast group elsewhere; rollhpc.weight_sync.routing), broadcast (a direct process group),
    # relay (through the controller) or ipc (rollhpc.weight_sync.driver)
    weight_sync: Literal["auto", "broadcast", "relay", "ipc"] = "auto"
    weight_sync_bucket_mb: float = 64.0
    rollout_every: int = 1  # write rollouts/step_N.h5 every this many steps (0: never)
    # stop after the step that passes this many seconds, evaluations included (0: off)
    max_wall_s: float = 0.0
    max_train_s: float = 0.0  # the same, counting training time only (evaluations left out)
    # colocated roles take turns on their devices: each stage offloads what it does not use
    # (rollhpc.controller.colocation); off: they stay resident together
    offload: bool = False
    # RUN_DIR/checkpoints, resume
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # final: when the run ends (its last step, or max_wall_s / max_train_s; not a stop for a requeue), the
    # trainer's model of its final checkpoint becomes a Hugging Face directory, RUN_DIR/export/hf (as
    # `rollhpc export RUN_DIR RUN_DIR/export/hf` would write it); none: `rollhpc export` it when wanted
    export_hf: Literal["none", "final"] = "none"
    # verify after sync: the first weight sync and every this many after it carry a checksum per tensor, checked
    # by the generators before they load anything (a mismatch stops the run naming the parameter); 0: never
    weight_sync_verify_every: int = 50

    def __post_init__(self) -> None:
        if self.weight_sync_verify_every < 0:
            raise ValueError(
                f"weight_sync_verify_every must be >= 0 (0: never), got {self.weight_sync_verify_every}"
            )
        if self.export_hf == "final" and not self.checkpoint.at_end:
            raise ValueError(
                "export_hf=final exports the run's final checkpoint, but checkpoint.at_end=false saves "
                "none: set checkpoint.at_end=true, or export_hf=none and `rollhpc export RUN_DIR --step "
                "N OUT_DIR` a checkpoint of your choice"
            )


def check_critic_role(options: TrainingOptions, roles: dict[str, Any]) -> None:
    """Config-time: PPO's values come from a critic role."""
    if options.algorithm == "ppo" and "critic" not in roles:
        raise ValueError(
            "algorithm 'ppo' needs a 'critic' role (rollhpc.workers.megatron_policy:MegatronCriticWorker)"
        )


def train_lora(roles: dict[str, Any]) -> LoraConfig | None:
    """The train role's LoRA settings (``roles.train.options.lora``), None without LoRA or a train role."""
    return getattr(getattr(roles.get("train"), "options", None), "lora", None)


def check_lora_serving(roles: dict[str, Any]) -> None:
    """Config-time: a generate role that serves LoRA (``max_lora_rank``) serves the train role's adapters."""
    serving = getattr(getattr(roles.get("generate"), "options", None), "max_lora_rank", 0)
    if not serving:
        return
    lora = train_lora(roles)
    if lora is None:
        raise ValueError(
            f"roles.generate.options.max_lora_rank={serving} serves a LoRA trainer's adapters, but "
            "roles.train.options has no lora: remove max_lora_rank"
        )
    if lora.rank > serving:
        raise ValueError(
            f"roles.generate.options.max_lora_rank={serving} is below the train role's "
            f"lora.rank={lora.rank}: vLLM would refuse the adapters"
        )


def replayed_routes(roles: dict[str, Any]) -> str:
    """The train role's ``router_replay`` (none, r2 or r3)."""
    return getattr(getattr(roles.get("train"), "options", None), "router_replay", "none")


def check_route_source(roles: dict[str, Any]) -> None:
    """Config-time: routing replay r3 replays the generator's routes, so the generate role's engine returns them."""
    replay = replayed_routes(roles)
    engine = getattr(roles.get("generate"), "options", None)
    if replay == "r3" and not getattr(engine, "returns_routes", lambda: False)():
        raise ValueError(
            "roles.train.options.router_replay=r3 replays the generator's routes, and the generate role's "
            "engine does not return them: set roles.generate.options.return_routes=true (vLLM on GPUs) or "
            "engine=torch, or use router_replay: r2 (the trainer's own routes, recorded in its old-log-prob "
            "forward)"
        )


class WarmStartOptions(Protocol):
    """What ``prepare`` and ``prepared_paths`` read of a training pipeline's options: each pipeline declares its
    own warm start."""

    model_dir: str
    warm_start: object | None


class TrainingPipelineSpec(PipelineSpec):
    """What the training pipelines share before they run: their GPU stages and the warm start's path."""

    # what each stage of a step holds on the GPU, by role and part (rollhpc.placement.memory_plan): colocated
    # roles take turns, each stage loading only these; a role that is absent from the run drops out
    memory_stages: ClassVar[dict[str, dict[str, tuple[str, ...]]] | None] = {
        "generate": {"generate": ("weights", "kv_cache")},
        "reference": {"reference": ("parameters", "activations")},
        "values": {"critic": ("parameters", "forward_activations")},
        "old_logprob": {"train": ("parameters", "forward_activations")},
        "train": {
            "train": TRAINER_PARTS,
            "critic": TRAINER_PARTS,
        },  # the critic trains beside the actor
        "weight_sync": {"train": ("parameters",), "generate": ("weights",)},
        # the trained state read whole: a checkpoint's save, and the final weights' digest (megatron's offload
        # frees the GPU storage of what it moves, so nothing may read it while offloaded)
        "checkpoint": {
            "train": ("parameters", "gradients", "optimizer"),
            "critic": ("parameters", "gradients", "optimizer"),
        },
    }

    @classmethod
    def prepare(
        cls, options: WarmStartOptions, seed: int, roles: dict[str, Any] | None = None
    ) -> None:
        """Before any rank starts: the pipeline's warm start (``build_warm_start``), when its options ask for one."""
        if options.warm_start is not None:
            cls.build_warm_start(options, options.warm_start, roles or {})

    @classmethod
    def build_warm_start(cls, options: WarmStartOptions, w: object, roles: dict[str, Any]) -> None:
        """Build the starting policy ``w`` (the options' warm start) describes into ``options.model_dir``."""
        raise NotImplementedError

    @classmethod
    def prepared_paths(cls, options: WarmStartOptions) -> list[str]:
        """What ``prepare`` builds (the warm start), so it need not exist before the run starts
        (``config.missing_inputs``)."""
        return [options.model_dir] if options.warm_start is not None else []
