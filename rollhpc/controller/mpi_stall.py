"""The controller's last line against an MPI call that never returns.

The controller never blocks in MPI on purpose: sends are non-blocking, receives start only once a
message's header is there, and between calls it checks that every worker is alive. But a call can
still hang inside the library when its peer has just died: MPICH over OFI's tcp provider retries the
connection to a dead rank forever inside ``MPI_Isend``; a receive waits forever for the buffers of a
message whose sender died half-way. Python code cannot run in that thread any more, so a watcher thread
looks at ``MpiChannel.busy_since`` and, past ``limit_s`` (``controller.mpi_stall_s``), hands the stall to
``on_stall`` (which reports the failure, naming a dead worker when there is one, and ends the process).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rollhpc.transport.mpi_channel import MpiChannel


class MpiStallWatch:
    def __init__(
        self,
        channel: MpiChannel,
        on_stall: Callable[[float], None],
        limit_s: float = 30.0,
        every_s: float = 1.0,
    ):
        self.channel = channel
        self.on_stall = on_stall
        self.limit_s = limit_s
        self.every_s = min(every_s, limit_s / 4)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpi-stall-watch", daemon=True)

    def start(self) -> "MpiStallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        # a call counts as stuck once this thread has seen it running for limit_s of its own polls, not by the
        # clock alone: a job suspended by Slurm (SIGSTOP, then SIGCONT) finds its clock far ahead on waking
        seen, polls = None, 0
        while not self._stop.wait(self.every_s):
            since = self.channel.busy_since
            seen, polls = (since, polls + 1) if since is not None and since == seen else (since, 0)
            if since is not None and polls * self.every_s >= self.limit_s:
                self.on_stall(time.monotonic() - since)
                return
