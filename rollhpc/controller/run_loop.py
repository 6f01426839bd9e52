"""The run loop every training pipeline shares: resume, step, evaluate, log, checkpoint, stop.

Why one loop: what happens around a training step (finding and loading the checkpoint to resume from, the
step-0 evaluation, evaluation on schedule, metrics lines and rollout files, checkpoints on schedule and at
a stop request, the wall-time limit, the final weights digest) is the same whether a step's samples come
from single-turn prompts (RLVR) or multi-turn episodes (agentic). A pipeline implements ``TrainingSteps``:
what one step does, how it evaluates, and which of its objects carry state across a restart; the loop does
the rest and returns an ``Outcome`` instead of setting a flag.

A checkpoint's controller state is ``{"step", "accuracy", "restarts", "rng", **{name: obj.state_dict()}}``
for the objects the pipeline names in ``state_objects()``: anything with ``state_dict`` /
``load_state_dict`` (the prompt cursor, the rollout scheduler's buffers, the KL controller, ...).
"""

from __future__ import annotations

import enum
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rollhpc.checkpoint.run_checkpoint import RunCheckpointer
from rollhpc.checkpoint.run_state import restore_rng_states, save_rng_states
from rollhpc.controller.stop import StopRequest
from rollhpc.observability.rollouts import RolloutRecord
from rollhpc.observability.run_log import RunLog
from rollhpc.rundir import RunPaths, read_jsonl
from rollhpc.rundir.records import log_event

__all__ = ["Outcome", "StepReport", "Stateful", "TrainingSteps", "LoopConfig", "RunLoop"]

log = logging.getLogger("rollhpc.run")


class Outcome(enum.Enum):
    FINISHED = "finished"  # the last step was taken
    ALREADY_DONE = "already_done"  # resumed from the checkpoint of the last step: nothing to do
    # a stop request: checkpointed, the next start resumes
    STOPPED_FOR_REQUEUE = "stopped_for_requeue"
    WALL_LIMIT = "wall_limit"  # max_wall_s or max_train_s passed


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class StepReport:
    """What one step left behind: its metrics (the loop adds accuracy, step_s, restarts, the weights
    digest), the samples for rollouts/step_N.h5, and whether it trained at all."""

    record: dict[str, Any]
    rollouts: RolloutRecord | None = None
    trained: bool = True
    summary: str = ""  # one log line (the loop appends the held-out accuracy)


class TrainingSteps(Protocol):
    """The pipeline's side of the loop."""

    def state_objects(self) -> dict[str, Stateful]:
        """Objects saved in every checkpoint under their name and restored before the first step."""
        ...

    def begin(self, resumed: bool) -> None:
        """Before the first step (after a restore, if any): e.g. give the generators the trainer's weights."""
        ...

    def step(self, step: int, last: bool) -> StepReport:
        """Take step ``step`` (``last``: no step follows, so nothing need be prepared for one)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics; ``accuracy`` (the headline number) among them."""
        ...

    def weights_digest(self) -> str:
        """The trained weights' sha256, logged at the last step (exact-resume checks compare it)."""
        ...

    def checkpoint_summary(self) -> dict[str, Any]:
        """Readable facts for the checkpoint's state.json beside step, version, restarts and accuracy."""
        ...


@dataclass(kw_only=True)
class LoopConfig:
    steps: int
    eval_every: int = 10  # 0: only at the start and the end
    rollout_every: int = 1  # rollouts/step_N.h5 every this many steps (0: never)
    max_wall_s: float = 0.0  # stop after the step that passes this many seconds (0: no limit)
    # the same, counting training only (evaluations left out): runs that evaluate at different rates, or
    # compared with another system's, get the same training time
    max_train_s: float = 0.0


def _clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress(done: int, left: int, elapsed: float, step_s: float) -> str:
    """The console's progress words after a step: this step's seconds, this session's elapsed time, and the
    time left at this session's mean pace (``done`` steps in ``elapsed`` seconds; evaluations included)."""
    eta = elapsed / done * left if done > 0 else float("nan")
    return f"{step_s:.1f} s/step, {_clock_text(elapsed)} elapsed" + (
        f", ETA {_clock_text(eta)}" if left and eta == eta else ""
    )


@dataclass
class _Session:
    """This start of the run, as the loop keeps it between steps: where it resumed (``start``, ``restarts``), the
    latest held-out metrics, its clock's start and the seconds its evaluations took."""

    start: int
    restarts: int
    metrics: dict[str, float]
    t_start: float
    eval_s: float = 0.0


class RunLoop:
    def __init__(
        self,
        run_dir: Path,
        checkpointer: RunCheckpointer,
        settings: LoopConfig,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.run_dir = Path(run_dir)
        self.checkpointer = checkpointer
        self.settings = settings
        self.clock = clock  # seconds, for the wall and training-time limits and step_s / eval_s

    def run(self, steps: TrainingSteps) -> Outcome:
        s = self.settings
        objects = steps.state_objects()
        stop_request = StopRequest(self.run_dir)
        restored = self.checkpointer.restore()
        if restored is None:
            start, restarts, metrics = 0, self._start_over(), {}
            # a start over drops every line of the sessions it replaces
            resume_step = -1 if restarts else None
        else:
            checkpoint, state = restored
            start, restarts, metrics = state["step"], state["restarts"] + 1, state["eval"]
            missing = sorted(set(objects) - set(state))
            if missing:
                raise RuntimeError(
                    f"{checkpoint.path} has no state for {missing}: it was saved by another pipeline "
                    "or version; resume with the configuration it was saved with"
                )
            for name, obj in objects.items():
                obj.load_state_dict(state[name])
            restore_rng_states(state["rng"])
            self._log_restart(checkpoint.path, start, restarts)
            resume_step = start  # the lines after its step go
        with RunLog(self.run_dir, resume_step=resume_step) as run_log:
            steps.begin(resumed=restored is not None)
            if restored is None:
                metrics = steps.evaluate()
                run_log.log_step(0, {**metrics, "policy_version": 0, **_residency(steps)})
                log.info("step 0: held-out accuracy %.3f", metrics.get("accuracy", float("nan")))
            if start >= s.steps:
                log.info(
                    "the checkpoint of step %d is already the run's last step (steps=%d): nothing to do",
                    start,
                    s.steps,
                )
                return Outcome.ALREADY_DONE
            return self._loop(steps, objects, run_log, stop_request, start, restarts, metrics)

    def _loop(
        self,
        steps: TrainingSteps,
        objects: dict[str, Stateful],
        run_log: RunLog,
        stop_request: StopRequest,
        start: int,
        restarts: int,
        metrics: dict[str, float],
    ) -> Outcome:
        s = self.settings
        session = _Session(start, restarts, metrics, t_start=self.clock())
        for step in range(start + 1, s.steps + 1):
            t_step = self.clock()
            load_before = _load(steps)
            last = step == s.steps
            report = steps.step(step, last)
            record = report.record
            record.update(_load_metrics(load_before, _load(steps), self.clock() - t_step))
            elapsed = self.clock() - session.t_start
            wall_limit = (bool(s.max_wall_s) and elapsed > s.max_wall_s) or (
                bool(s.max_train_s) and elapsed - session.eval_s > s.max_train_s
            )
            why_stop = stop_request.reason() if not last else None
            if (s.eval_every and step % s.eval_every == 0) or last or wall_limit:
                self._evaluate(steps, record, session)
            self._complete(steps, step, report, session, t_step, final=last or wall_limit)
            run_log.log_step(step, record, report.rollouts if self._keeps(report, step) else None)
            if report.summary:
                self._log_summary(step, report, session, t_step)
            if (
                self.checkpointer.due(step, s.steps)
                or why_stop is not None
                or (wall_limit and self.checkpointer.options.at_end)
            ):
                self._save(steps, step, objects, restarts, session.metrics, record)
            if why_stop is not None:
                log.warning(
                    "stopping after step %d for a requeue (%s); the next start resumes from its checkpoint",
                    step,
                    why_stop,
                )
                stop_request.clear()
                return Outcome.STOPPED_FOR_REQUEUE
            if wall_limit:
                self._log_wall_limit(step, elapsed)
                return Outcome.WALL_LIMIT
        return Outcome.FINISHED

    def _evaluate(self, steps: TrainingSteps, record: dict[str, Any], session: _Session) -> None:
        """Held-out metrics into the step's record; their seconds are part of step_s, not of training."""
        t_eval = self.clock()
        session.metrics = steps.evaluate()
        record.update(session.metrics, eval_s=self.clock() - t_eval)
        session.eval_s += record["eval_s"]

    def _complete(
        self,
        steps: TrainingSteps,
        step: int,
        report: StepReport,
        session: _Session,
        t_step: float,
        final: bool,
    ) -> None:
        """What the loop adds to a step's record: step_s (a step that trained), the training clock, the restart
        count on a session's first step, the weights digest on the final one, the colocated roles' stages."""
        record = report.record
        if report.trained:
            record["step_s"] = self.clock() - t_step
        # what max_train_s counts: seconds since this start's first step, evaluations left out; the logging and
        # checkpoints of earlier steps are in it (a step's step_s ends before its own records are written)
        record["train_clock_s"] = self.clock() - session.t_start - session.eval_s
        if session.restarts and step == session.start + 1:
            record["restarts"] = session.restarts
        if final:
            record["weights_sha256"] = steps.weights_digest()
        record.update(_residency(steps))

    def _keeps(self, report: StepReport, step: int) -> bool:
        """Whether the step's samples go to rollouts/step_N.h5 (``rollout_every``, and the last step)."""
        s = self.settings
        return (
            report.rollouts is not None
            and s.rollout_every > 0
            and (step % s.rollout_every == 0 or step == s.steps)
        )

    def _log_summary(self, step: int, report: StepReport, session: _Session, t_step: float) -> None:
        s, record = self.settings, report.record
        log.info(
            "step %d/%d: %s%s; %s",
            step,
            s.steps,
            report.summary,
            f", held-out accuracy {record['accuracy']:.3f}" if "accuracy" in record else "",
            progress(
                step - session.start,
                s.steps - step,
                self.clock() - session.t_start,
                record.get("step_s", self.clock() - t_step),
            ),
        )

    def _log_wall_limit(self, step: int, elapsed: float) -> None:
        s = self.settings
        log.info(
            "stopping after step %d: %s reached",
            step,
            f"max_wall_s={s.max_wall_s:.0f}"
            if s.max_wall_s and elapsed > s.max_wall_s
            else f"max_train_s={s.max_train_s:.0f} (evaluations not counted)",
        )

    def _save(
        self,
        steps: TrainingSteps,
        step: int,
        objects: dict[str, Stateful],
        restarts: int,
        metrics: dict[str, float],
        record: dict[str, Any],
    ) -> None:
        state = {
            "step": step,
            "restarts": restarts,
            "eval": metrics,
            "rng": save_rng_states(),
            **{name: obj.state_dict() for name, obj in objects.items()},
        }
        summary = {
            "step": step,
            "policy_version": record.get("policy_version"),
            "restarts": restarts,
            "accuracy": metrics.get("accuracy"),
            **steps.checkpoint_summary(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        self.checkpointer.save(step, state, summary)

    def _start_over(self) -> int:
        """With no checkpoint to resume from: 0 for a run's first session, else the restart number of a session
        that starts the run again from step 0 because the sessions before it were lost before their first
        checkpoint but logged steps (a node lost at step 2 of a run checkpointing every 5). Their lines are
        dropped (so every step is logged once), and restarts.jsonl says why the run started over."""
        records = [r for r in read_jsonl(RunPaths(self.run_dir).metrics) if isinstance(r, dict)]
        if not records:
            return 0
        restarts = 1 + max(int(r.get("restarts") or 0) for r in records)
        log.warning(
            "restart %d: no checkpoint yet; the run starts again from step 0 (the %d steps the earlier "
            "session logged are dropped)",
            restarts,
            len(records),
        )
        self._log_resume(None, 0, restarts)
        return restarts

    def _log_restart(self, path: Path, step: int, restarts: int) -> None:
        log.warning("restart %d: resuming after step %d from %s", restarts, step, path)
        self._log_resume(str(path), step, restarts)

    def _log_resume(self, checkpoint: str | None, step: int, restarts: int) -> None:
        """One line per resume in RUN_DIR/restarts.jsonl (the batch script's starts and requeues go there too)."""
        log_event(
            self.run_dir,
            {
                "event": "resume",
                "checkpoint": checkpoint,
                "step": step,
                "restarts": restarts,
                "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            },
        )


def _load(steps: TrainingSteps) -> dict[str, tuple[float, float, int]] | None:
    """The roles' load counters now (``Controller.load``), or None for a pipeline without worker groups."""
    workers = getattr(steps, "workers", None)
    controller = (
        getattr(next(iter(workers.values()), None), "controller", None) if workers else None
    )
    return controller.load() if controller is not None else None


def _load_metrics(before: dict | None, after: dict | None, wall_s: float) -> dict[str, float]:
    """Per role over one step (evaluation excluded): ``load/ROLE/busy_fraction``, the share of the step its
    ranks spent inside calls (1 - that is its idle fraction; a generator's rollout calls include their short
    waits for completions, its engine's own idle share is ``generator_idle_fraction``), and
    ``load/ROLE/cpu_cores``, the CPU cores its processes used on average (the controller's too)."""
    if not before or not after or wall_s <= 0:
        return {}
    out = {}
    for role, (call, cpu, n) in after.items():
        call0, cpu0, _ = before.get(role, (0.0, 0.0, n))
        if role != "controller":
            out[f"load/{role}/busy_fraction"] = round(min(1.0, (call - call0) / (n * wall_s)), 4)
        out[f"load/{role}/cpu_cores"] = round((cpu - cpu0) / wall_s, 3)
    return out


def _residency(steps: TrainingSteps) -> dict[str, Any]:
    """The stages the colocated roles took turns in since the last record (offload on), in order."""
    hook = getattr(steps, "residency_metrics", None)
    return hook() if hook is not None else {}
