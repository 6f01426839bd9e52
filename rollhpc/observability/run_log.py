"""RunLog: the one thing a pipeline calls to leave a step behind in RUN_DIR.

metrics.jsonl          every key of every step (MetricsLog)
tb/                    the numeric keys, as TensorBoard scalars (TensorBoardLog)
rollouts/step_N.h5     the step's samples, when the pipeline passes them (RolloutWriter)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollhpc.observability.metrics import MetricsLog, truncate_metrics
from rollhpc.observability.rollouts import RolloutRecord, RolloutWriter
from rollhpc.rundir import RunPaths

if TYPE_CHECKING:
    from rollhpc.observability.tensorboard import TensorBoardLog


class RunLog:
    """``resume_step``: a run resumed from the checkpoint of that step; what an earlier session logged for
    later steps is dropped (metrics lines, rollout files; TensorBoard is told to purge them), so the logs
    read as one run."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(RunPaths(self.run_dir).metrics, resume_step)
            for path in RunPaths(self.run_dir).rollouts.glob("step_*.h5"):
                if (
                    path.stem.removeprefix("step_").isdigit()
                    and int(path.stem.removeprefix("step_")) > resume_step
                ):
                    path.unlink()
        self.metrics = MetricsLog(RunPaths(self.run_dir).metrics)
        self.tensorboard: TensorBoardLog | None = None
        if tensorboard:
            # tensorboard is heavy, and this module is on the login-node path (pipelines import it)
            from rollhpc.observability.tensorboard import TensorBoardLog

            self.tensorboard = TensorBoardLog(
                RunPaths(self.run_dir).tensorboard,
                purge_from=None if resume_step is None else resume_step + 1,
            )
        self.rollouts = RolloutWriter(RunPaths(self.run_dir).rollouts)
        self._closed = False

    def log_step(
        self, step: int, metrics: dict[str, Any], rollouts: RolloutRecord | None = None
    ) -> None:
        """metrics go to metrics.jsonl as given (with "step" first, and "time": when, in Unix seconds, for
        plots against wall time) and their numeric part to TensorBoard (which keeps its own wall time)."""
        record = {
            "step": step,
            **{k: v for k, v in metrics.items() if k not in ("step", "time")},
            "time": round(time.time(), 3),
        }
        if rollouts is not None:
            self.rollouts.write(step, rollouts)
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.add_scalars(
                step, {k: v for k, v in record.items() if k not in ("step", "time")}
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
