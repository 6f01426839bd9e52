"""What the training pipelines (RLVR, agentic) share around the run loop: the policy cursor saved in every
checkpoint, and the hooks that are the same for both (weights to the generators before the first step, the
weights digest at the end).

A subclass builds its rollout side in ``run``, sets ``self.policy``, ``self.scheduler`` and ``self.kl_control``,
then returns ``self.run_loop()``; it implements ``step``, ``evaluate`` and ``checkpoint_summary``, and adds its own
state to ``state_objects`` (``run_loop.TrainingSteps``).
Its ``Options`` derive from ``TrainingOptions``: what both pipelines take (the policy, steps, the algorithm and
loss, the rollout, evaluation and logging cadence, weight sync, time limits, offload, checkpoints and the final
export) is declared once there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from rollhpc.algo import advantages as adv_mod
from rollhpc.algo.correction import correct, mismatch_metrics
from rollhpc.batch import Batch, TrainingBatch, ValueBatch
from rollhpc.checkpoint.run_checkpoint import RunCheckpointer
from rollhpc.controller.colocation import Residency, colocation_of
from rollhpc.controller.run_loop import LoopConfig, Outcome, RunLoop, Stateful, StepReport
from rollhpc.conversion.export import ExportError, export_run, final_export_dir
from rollhpc.pipelines.training_spec import (
    TrainingOptions,
    TrainingPipelineSpec,
    check_critic_role,
    check_lora_serving,
    train_lora,
)
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.protocol.pipeline import Pipeline
from rollhpc.rollout.types import RolloutStats, Sample
from rollhpc.rundir import RunPaths
from rollhpc.weight_sync.driver import WeightSync
from rollhpc.weight_sync.routing import route_weights

if (
    TYPE_CHECKING
):  # the worker groups' module imports mpi4py; this one is on the cluster check's login path
    from rollhpc.algo.kl_control import KlController
    from rollhpc.controller.worker_group import GroupFuture
    from rollhpc.rollout.scheduler import RolloutScheduler

__all__ = [
    "PolicyCursor",
    "TrainingOptions",
    "TrainingPipeline",
    "check_critic_role",
    "check_lora_serving",
    "train_lora",
]

log = logging.getLogger("rollhpc.run")


@dataclass
class PolicyCursor:
    """The policy version the generators hold, and (async mode) the batch already generated for the next
    step: part of every checkpoint, so a resumed async run trains on the batch the uninterrupted one would."""

    version: int = 0
    pending: tuple[list[list[Sample]], RolloutStats] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.pending = state["version"], state["pending"]


def step_measures(times: dict[str, float]) -> dict[str, float]:
    """A step's clocks (``..._s``) rounded to the microsecond, everything else measured beside them as it is:
    ``logprob_abs_diff`` between two float32 engines is ~1e-7 and ``kl_ref`` early in a run as small, and
    rounding them too read as an exact 0.0 in every metrics line."""
    return {k: round(v, 6) if k.endswith("_s") else v for k, v in times.items()}


def generators_take_adapters(roles: dict[str, Any]) -> bool:
    """Whether a LoRA trainer's weight syncs move its adapters alone: the generate role's engine serves them
    (vLLM with ``max_lora_rank``) or merges them (engine=torch). Otherwise the base with the adapters merged in."""
    options = getattr(roles.get("generate"), "options", None)
    return train_lora(roles) is not None and bool(
        getattr(options, "takes_adapters", lambda: False)()
    )


class TrainingPipeline(TrainingPipelineSpec, Pipeline):
    policy: PolicyCursor
    scheduler: RolloutScheduler
    kl_control: KlController
    checkpointer: RunCheckpointer
    residency: Residency | None = None

    def trains_once_per_batch(self) -> bool:
        """Whether the train role takes one optimizer step per batch (its ``mini_batches`` is 1): then a batch
        of the current weights is trained on-policy, and the train step's own forward gives the old log-probs."""
        config = self.run_ctx.config
        return config is None or getattr(config.roles["train"].options, "mini_batches", 1) == 1

    def run_loop(self) -> Outcome:
        """Weight sync and (offload on) the colocated roles' turns set up, then the shared run loop over this
        pipeline's steps."""
        o = self.options
        mode, routing = o.weight_sync, None
        plan_path = RunPaths(self.run_ctx.run_dir).plan
        if mode != "relay" and plan_path.exists():
            # checked at load too (plan_world)
            routing = route_weights(WorldPlan.load(plan_path), mode)
        if mode == "auto":
            mode = routing.mode if routing is not None and routing.routes else "broadcast"
        self.weight_sync = WeightSync(
            self.workers["train"],
            self.workers["generate"],
            mode,
            o.weight_sync_bucket_mb,
            routing=routing,
            verify_every=o.weight_sync_verify_every,
            adapters_only=self._syncs_adapters_only(),
        )
        if getattr(o, "offload", False) and self.run_ctx.config is not None:
            self.residency = Residency(
                self.workers,
                self.memory_stages,
                colocation_of(self.run_ctx.config.roles),
                self.run_ctx.offloaded_at_start,
            )
            self.checkpointer.before_save = lambda: self.stage("checkpoint")
        loop = RunLoop(
            self.run_ctx.run_dir,
            self.checkpointer,
            LoopConfig(
                steps=o.steps,
                eval_every=o.eval_every,
                rollout_every=o.rollout_every,
                max_wall_s=o.max_wall_s,
                max_train_s=o.max_train_s,
            ),
        )
        outcome = loop.run(self)
        if o.export_hf == "final" and outcome is not Outcome.STOPPED_FOR_REQUEUE:
            self.export_final()
        return outcome  # rank_runtime acts on it (a requeue's exit status)

    def export_final(self) -> None:
        """``export_hf: final``: the trainer's model of the checkpoint just saved (the ``latest`` pointer: the
        last commit, not an older good one in its place) to RUN_DIR/export/hf, replacing an earlier attempt's. A
        run resumed from its last step's checkpoint (``Outcome.ALREADY_DONE``: e.g. a node lost during the
        export) exports it again. Runs here, in the controller, once the workers' checkpoint is committed:
        the conversion forks worker processes of its own and needs no world."""
        # the conversion imports torch: the controller loads it only for this export
        from rollhpc.conversion.checks import ConversionError

        run_dir = self.run_ctx.run_dir
        out = final_export_dir(run_dir)
        step = self.checkpointer.store.latest_step()
        try:
            source, report = export_run(run_dir, out, step=step, overwrite=True, progress=False)
        except (ExportError, ConversionError) as e:
            raise RuntimeError(
                f"the run ended with checkpoint step {step} saved, but export_hf=final could not "
                f"write {out}: {e}; `rollhpc export {run_dir} {out} --overwrite` retries it"
            ) from e
        log.info(
            "export_hf=final: wrote %s, a Hugging Face directory of the trainer's model of %s (%.1f s)",
            out,
            source.checkpoint.path.name,
            report.seconds,
        )

    def stage(self, name: str) -> None:
        """Entering a stage of the step: colocated roles take their turn (offload on), else nothing."""
        if self.residency is not None:
            self.residency.enter(name)

    def residency_metrics(self) -> dict[str, Any]:
        return self.residency.step_metrics() if self.residency is not None else {}

    def ppo_advantages(
        self,
        tokens: np.ndarray,
        mask: np.ndarray,
        token_rewards: np.ndarray,
        times: dict[str, float],
    ) -> tuple[np.ndarray, ValueBatch]:
        """PPO's token advantages (whitened): the critic's values, GAE with the options' gamma and lam; and the
        critic's batch (its returns and the values it had) for ``train_critic``."""
        self.stage("values")
        t = time.perf_counter()
        values = self.workers["critic"].compute_values(Batch({"tokens": tokens}))["values"] * mask
        times["critic_values_s"] = time.perf_counter() - t
        o = self.options
        advantage, returns = adv_mod.gae_advantages(
            token_rewards, values, mask, gamma=o.gamma, lam=o.lam
        )
        critic = ValueBatch(
            tokens, mask, returns=returns.astype(np.float32), old_values=values.astype(np.float32)
        )
        return adv_mod.whiten(advantage, mask), critic

    def train_critic(self, batch: ValueBatch | None) -> GroupFuture | None:
        """The critic's train step on ``batch`` (from ``ppo_advantages``), submitted: it runs beside the actor's.
        None without a critic batch (no PPO this step)."""
        if batch is None:
            return None
        return self.workers["critic"].train_step.submit(batch, self.options.value_clip)

    @staticmethod
    def with_critic_stats(
        stats: list[dict[str, float]], critic: GroupFuture
    ) -> list[dict[str, float]]:
        """The actor's per-rank train stats with the critic's (``critic_`` prefixed), once its step is done."""
        return [
            {**a, **{f"critic_{k}": v for k, v in b.items()}}
            for a, b in zip(stats, critic.result())
        ]

    def sync_weights(self) -> float:
        self.stage("weight_sync")
        return self.weight_sync(self.policy.version)

    # ---- the pieces of a step both pipelines take
    def skipped_step(self, rstats: RolloutStats) -> StepReport:
        """The report of a step with nothing to learn from (every group uniform): no update, no new version."""
        return StepReport(
            {
                "reward_mean": float("nan"),
                "policy_version": self.policy.version,
                "skipped": 1,
                **rstats.as_metrics(),
            },
            trained=False,
        )

    def old_logprobs_from_trainer(
        self, inputs: Batch, mask: np.ndarray, gen_logprob: np.ndarray, times: dict[str, float]
    ) -> np.ndarray:
        """The trainer's log-probs of the rows (``inputs``: their tokens, and with routing replay r3 the routes to
        replay) under the weights the batch was generated with, and how far the generator's were from them
        (``logprob_abs_diff``, per generated token: the weight sync and both engines' numerics; ``mismatch_*``:
        rollhpc.algo.correction.mismatch_metrics)."""
        self.stage("old_logprob")
        t = time.perf_counter()
        old = self.workers["train"].compute_logprobs(inputs)["logprob"]
        times["old_logprob_s"] = time.perf_counter() - t
        times["logprob_abs_diff"] = float(
            (np.abs(old - gen_logprob) * mask).sum() / max(mask.sum(), 1)
        )
        times.update(mismatch_metrics(old, gen_logprob, mask))
        return old

    def corrected(
        self, batch: TrainingBatch, gen_logprob: np.ndarray, times: dict[str, float]
    ) -> TrainingBatch:
        """``batch`` with the mismatch correction of ``loss.correction`` (rollhpc.algo.correction): its rejected
        tokens out of the loss mask and its weights in ``is_weight``; the batch itself without one."""
        config = self.options.loss.correction
        if not config.enabled:
            return batch
        if batch.old_logprob is None:
            raise ValueError("a mismatch correction needs the trainer's old log-probs")
        done = correct(config, batch.old_logprob, gen_logprob, batch.loss_mask)
        times.update(done.metrics)
        return replace(batch, loss_mask=done.loss_mask, is_weight=done.is_weight)

    def training_result(
        self,
        training: GroupFuture,
        critic: GroupFuture | None,
        started: float,
        times: dict[str, float],
    ) -> list[dict[str, float]]:
        """The train call's statistics (with the critic's, when it trained beside it), ``train_s`` since
        ``started``, and on-policy the train step's own distance from the generator's log-probs."""
        stats = training.result()
        if critic is not None:
            stats = self.with_critic_stats(stats, critic)
        times["train_s"] = time.perf_counter() - started
        if "logprob_abs_diff" in stats[0]:  # measured by the train step (summed over DP already)
            times["logprob_abs_diff"] = float(stats[0]["logprob_abs_diff"])
        return stats

    def publish_policy(self, times: dict[str, float]) -> None:
        """The trained weights become the next policy version, on every generator."""
        self.policy.version += 1
        t = time.perf_counter()
        times["weight_sync_s"] = self.sync_weights()
        times["weight_sync_total_s"] = time.perf_counter() - t
        if self.weight_sync.last_bytes is not None:
            times["weight_sync_mb"] = self.weight_sync.last_bytes / (1 << 20)

    def _syncs_adapters_only(self) -> bool:
        """A LoRA trainer sends only its adapters to generators that serve or merge them (generators_take_adapters)."""
        return generators_take_adapters(getattr(self.run_ctx.config, "roles", None) or {})

    def state_objects(self) -> dict[str, Stateful]:
        """What a run checkpoint saves of the controller's side: the policy cursor, the rollout scheduler's
        buffer and the KL controller; a pipeline adds its own (its prompt or seed stream, ...)."""
        return {"policy": self.policy, "scheduler": self.scheduler, "kl_control": self.kl_control}

    def begin(self, resumed: bool) -> None:
        self.sync_weights()  # the generators start from exactly the trainer's weights

    def weights_digest(self) -> str:
        self.stage("checkpoint")  # the trainer's weights back on its devices (offload on)
        return self.workers["train"].weights_digest()
