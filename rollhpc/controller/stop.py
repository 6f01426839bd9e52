"""Requests to checkpoint and stop, checked by the pipeline after every step.

Two ways in: SIGUSR1 sent to the controller process (a local run, or a user), or the file
``RUN_DIR/stop-request``, which the Slurm batch script writes when its ``--signal=B:USR1@N`` time-limit
warning arrives (the signal reaches only the batch shell, so the shell relays it through the shared
filesystem, whichever node the controller runs on). The pipeline answers by saving a checkpoint and
leaving with ``EXIT_REQUEUE``; the batch script then requeues the job, and the next start resumes.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from rollhpc.rundir import RunPaths

log = logging.getLogger("rollhpc.controller")


class StopRequest:
    def __init__(self, run_dir: Path):
        self.path = RunPaths(run_dir).stop_request
        self._signalled: str | None = None
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:  # noqa: ARG002
        self._signalled = "SIGUSR1 to the controller"

    def reason(self) -> str | None:
        """Why the run should stop now, or None."""
        if self._signalled:
            return self._signalled
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return None
        return f"{self.path.name}: {text or 'present'}"

    def clear(self) -> None:
        """Forget the request once it was honoured (the next start must not stop at once)."""
        self._signalled = None
        self.path.unlink(missing_ok=True)
