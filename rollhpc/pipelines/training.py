"""What the training pipelines (RLVR, agentic) share around the run loop: the policy cursor saved in every
checkpoint, worker ranks as the rollout scheduler's ports, and the hooks that are the same for both (weights
to the generators before the first step, the weights digest at the end).

A subclass builds its rollout side in ``run``, sets ``self.policy``, then returns ``self.run_loop()``; it
implements ``step``, ``evaluate``, ``state_objects`` and ``checkpoint_summary`` (``run_loop.TrainingSteps``).
Its ``Options`` carry steps, eval_every, rollout_every, max_wall_s, max_train_s, weight_sync and
weight_sync_bucket_mb.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollhpc.controller.pipeline import Pipeline
from rollhpc.controller.run_loop import LoopSettings, Outcome, RunLoop
from rollhpc.weight_sync.driver import WeightSync, choose_mode

__all__ = ["PolicyCursor", "RankPort", "TrainingPipeline"]


@dataclass
class PolicyCursor:
    """The policy version the generators hold, and (async mode) the batch already generated for the next
    step: part of every checkpoint, so a resumed async run trains on the batch the uninterrupted one would."""

    version: int = 0
    pending: Any = None  # (groups, RolloutStats) or None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.pending = state["version"], state["pending"]


class RankPort:
    """One worker rank as a scheduler port (generator or reward): ``submit(*args)`` calls ``method`` on it."""

    def __init__(self, rank_proxy: Any, method: str):
        self._method = getattr(rank_proxy, method)

    def submit(self, *args: Any) -> Any:
        return self._method.submit(*args)


TRAINER_PARTS = ("parameters", "gradients", "optimizer", "activations")


class TrainingPipeline(Pipeline):
    policy: PolicyCursor
    checkpointer: Any

    # what each stage of a step holds on the GPU, by role and part (rollhpc.launch.memory_plan): colocated
    # roles take turns, each stage loading only these; a role that is absent from the run drops out
    memory_stages: dict[str, dict[str, tuple[str, ...]]] = {
        "generate": {"generate": ("weights", "kv_cache")},
        "reference": {"reference": ("parameters", "activations")},
        "values": {"critic": ("parameters", "forward_activations")},
        "old_logprob": {"train": ("parameters", "forward_activations")},
        "train": {"train": TRAINER_PARTS, "critic": TRAINER_PARTS},  # the critic trains beside the actor
        "weight_sync": {"train": ("parameters",), "generate": ("weights",)},
    }

    @classmethod
    def prepared_paths(cls, options: Any) -> list[str]:
        """What ``prepare`` builds (the warm start), so it need not exist before the run starts
        (``config.missing_inputs``)."""
        return [options.model_dir] if options.warm_start is not None else []

    def trains_once_per_batch(self) -> bool:
        """Whether the train role takes one optimizer step per batch (its ``mini_batches`` is 1): then a batch
        of the current weights is trained on-policy, and the train step's own forward gives the old log-probs."""
        config = self.run_ctx.config
        return config is None or getattr(config.roles["train"].options, "mini_batches", 1) == 1

    def run_loop(self) -> Outcome:
        """Weight sync and (offload on) the colocated roles' turns set up, then the shared run loop over this
        pipeline's steps."""
        o = self.options
        mode = o.weight_sync
        if mode == "auto":
            from rollhpc.launch.device_mapping import WorldPlan

            plan_path = self.run_ctx.run_dir / "plan.json"
            mode = choose_mode(mode, WorldPlan.load(plan_path)) if plan_path.exists() else "broadcast"
        self.weight_sync = WeightSync(self.groups["train"], self.groups["generate"], mode, o.weight_sync_bucket_mb)
        if getattr(o, "offload", False) and self.run_ctx.config is not None:
            from rollhpc.controller.colocation import Residency, colocation_of

            self.residency = Residency(self.groups, self.memory_stages, colocation_of(self.run_ctx.config.roles))
        loop = RunLoop(self.run_ctx.run_dir, self.checkpointer,
                       LoopSettings(steps=o.steps, eval_every=o.eval_every, rollout_every=o.rollout_every,
                                    max_wall_s=o.max_wall_s, max_train_s=o.max_train_s))
        self.outcome = loop.run(self)
        self.stopped_for_requeue = self.outcome is Outcome.STOPPED_FOR_REQUEUE  # read by rank.py
        return self.outcome

    residency: Any = None

    def stage(self, name: str) -> None:
        """Entering a stage of the step: colocated roles take their turn (offload on), else nothing."""
        if self.residency is not None:
            self.residency.enter(name)

    def residency_metrics(self) -> dict[str, Any]:
        return self.residency.step_metrics() if self.residency is not None else {}

    def sync_weights(self) -> float:
        self.stage("weight_sync")
        return self.weight_sync(self.policy.version)

    def begin(self, resumed: bool) -> None:
        self.sync_weights()  # the generators start from exactly the trainer's weights

    def weights_digest(self) -> str:
        return self.groups["train"].weights_digest()
