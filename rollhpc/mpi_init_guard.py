"""A time limit on ``MPI_Init``, which has none of its own.

When the MPI library cannot form the world (a rank that died during start-up, a corrupted address
exchange through the process manager, a node whose network is gone), the ranks that did reach
``MPI_Init`` wait in it forever, and on Slurm the allocation sits idle until its time limit. A Python
timer cannot help: the thread that would fire it needs the interpreter, which the blocked call holds.
So a forked watcher process waits on a pipe instead; if the rank does not report "initialized" in
time, the watcher says so on the rank's stderr (the job's output), records the failure for the batch
script (RUN_DIR/startup-failed.json: a restart is worth trying) and the run (RUN_DIR/error.json),
and kills the rank. The watcher also ends when the rank ends, whatever the reason.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
from pathlib import Path

from rollhpc.launch.requeue import record_startup_failure
from rollhpc.parent_death import die_with_parent


class MpiInitGuard:
    """Start before ``from mpi4py import MPI``; call ``initialized()`` once it returned."""

    def __init__(self, run_dir: Path, timeout_s: float, role: str | None):
        read_end, self._write_end = os.pipe()
        rank_pid = os.getpid()
        self._pid = os.fork()
        if self._pid == 0:
            os.close(self._write_end)
            try:
                _watch(read_end, rank_pid, Path(run_dir), timeout_s, role)
            finally:
                os._exit(0)
        os.close(read_end)

    def initialized(self) -> None:
        os.write(self._write_end, b"1")
        os.close(self._write_end)
        os.waitpid(self._pid, 0)


def _watch(read_end: int, rank_pid: int, run_dir: Path, timeout_s: float, role: str | None) -> None:
    die_with_parent(rank_pid)  # go when the rank goes
    ready, _, _ = select.select([read_end], [], [], timeout_s)
    if ready:  # "initialized", or end of file: the rank is gone
        return
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    who = f"{'role ' + repr(role) + ', ' if role else ''}pid {rank_pid} on {host}"
    why = (f"MPI_Init did not finish within {timeout_s:g} s ({who}; controller.world_timeout_s): "
           f"the MPI library could not form the world; its own errors, if any, are in the output above")
    print(f"rollhpc: {why}", file=sys.stderr, flush=True)
    record_startup_failure(run_dir, host, why, culprit=True)
    os.kill(rank_pid, signal.SIGKILL)
