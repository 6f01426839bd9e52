"""RunLog: the one thing a pipeline calls to leave a step behind in RUN_DIR.

    metrics.jsonl          every key of every step (MetricsLog)
    tb/                    the numeric keys, as TensorBoard scalars (TensorBoardLog)
    rollouts/step_N.h5     the step's samples, when the pipeline passes them (RolloutWriter)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollhpc.observability.metrics import MetricsLog
from rollhpc.observability.rollouts import RolloutRecord, RolloutWriter
from rollhpc.observability.tensorboard import TensorBoardLog


class RunLog:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        self.tensorboard = TensorBoardLog(self.run_dir / "tb") if tensorboard else None
        self.rollouts = RolloutWriter(self.run_dir / "rollouts")
        self._closed = False

    def log_step(self, step: int, metrics: dict[str, Any], rollouts: RolloutRecord | None = None) -> None:
        """metrics go to metrics.jsonl as given (with "step" first) and their numeric part to TensorBoard."""
        record = {"step": step, **{k: v for k, v in metrics.items() if k != "step"}}
        if rollouts is not None:
            self.rollouts.write(step, rollouts)
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.add_scalars(step, {k: v for k, v in record.items() if k != "step"})

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
