"""RUN_DIR/tb/: scalars for TensorBoard, flushed every step so a live `tensorboard --logdir` sees them.

Uses tensorboard's own event-file writer rather than torch's SummaryWriter, so the controller does not
need torch to log. Values that are not real numbers are skipped. ``RunLog`` imports this module only when
a run logs to TensorBoard: loading a config (which may import a pipeline, and so RunLog) does not load
tensorboard.
"""

from __future__ import annotations

import numbers
import time
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event, SessionLog
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter


def numeric_scalars(values: dict[str, Any]) -> dict[str, float]:
    """The entries TensorBoard can plot: real numbers (Python or numpy), bools excluded."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool)
    }


class TensorBoardLog:
    """``purge_from``: a resumed run; TensorBoard drops the earlier files' points from that step on (the
    steps the interrupted session logged after its last checkpoint), as torch's ``purge_step`` does."""

    def __init__(self, log_dir: Path, purge_from: int | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.log_dir))
        if purge_from is not None:
            self._writer.add_event(Event(step=purge_from, file_version="brain.Event:2"))
            self._writer.add_event(
                Event(step=purge_from, session_log=SessionLog(status=SessionLog.START))
            )
            self._writer.flush()

    def add_scalars(self, step: int, values: dict[str, Any]) -> None:
        scalars = numeric_scalars(values)
        if not scalars:
            return
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()])
        self._writer.add_event(Event(wall_time=time.time(), step=int(step), summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
