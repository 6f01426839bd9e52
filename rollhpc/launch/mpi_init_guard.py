"""A time limit on forming the MPI world, which has none of its own.

When the MPI library cannot form the world (a rank that died during start-up, a corrupted address
exchange through the process manager, a node whose network is gone), the ranks wait forever, in
``MPI_Init`` or in the first collectives, and on Slurm the allocation sits idle until its time limit.
Nothing inside the rank can be trusted to end that: a Python timer needs the interpreter, which a blocked
call may hold, and a rank (or its Slurm step's I/O) may be wedged in ways no thread can see. So a forked
watcher process waits on a pipe instead. The rank reports two milestones, ``mpi_initialized()`` and
``world_formed()`` (after the first collectives); if the second has not come within the limit, the
watcher records the failure for the batch script (RUN_DIR/startup-failed.json: a restart is worth trying)
and the run (RUN_DIR/error.json), kills the rank, and only then says so on the rank's stderr (the job's
output), with a time limit of its own: a stalled step may no longer read what its tasks write. Until
then the watcher also ends when the rank ends, whatever the reason.

Slurm ends a step by sending SIGTERM to every process of each task (the watcher included), then SIGKILL
after its KillWait. The watcher must not die of that signal: a rank blocked in C may never act on its own
SIGTERM, and without the watcher nothing would end it before KillWait, or ever, when the step's end never
comes through. So the watcher ignores SIGTERM, SIGINT and SIGHUP as signals and reads them as news: the
step is being ended, and a rank still alive ``SIGNAL_GRACE_S`` later is killed (its own limit still holds
when that comes first). The rank itself keeps the default action for SIGTERM until its world has formed
(``rollhpc.rank`` installs no Python handler before then), so a rank that can die of it does.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

from rollhpc.proc.parent_death import die_with_parent
from rollhpc.rundir.records import record_startup_failure, this_host

_MPI_INITIALIZED = b"i"
_WORLD_FORMED = b"w"
SIGNAL_GRACE_S = 3.0  # after a SIGTERM/SIGINT/SIGHUP, how long a rank may take to end by itself
_STEP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_received: list[int] = []  # step signals seen by the watcher, in order


def _note_signal(signum, frame):  # noqa: ARG001
    _received.append(signum)  # the wake-up fd (set_wakeup_fd) interrupts the wait


class MpiInitGuard:
    """Start before ``from mpi4py import MPI``; call ``mpi_initialized()`` once it returned and
    ``world_formed()`` once the first collectives are done."""

    def __init__(self, run_dir: Path, timeout_s: float, role: str | None):
        read_end, self._write_end = os.pipe()
        rank_pid = os.getpid()
        # held back across the fork: the watcher must not die of one before its own handlers are set
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STEP_SIGNALS)
        self._pid = os.fork()
        if self._pid == 0:
            os.close(self._write_end)
            try:
                _watch(read_end, rank_pid, Path(run_dir), timeout_s, role, mask)
            finally:
                os._exit(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.close(read_end)

    def mpi_initialized(self) -> None:
        os.write(self._write_end, _MPI_INITIALIZED)

    def world_formed(self) -> None:
        os.write(self._write_end, _WORLD_FORMED)
        os.close(self._write_end)
        os.waitpid(self._pid, 0)


def _watch(
    read_end: int, rank_pid: int, run_dir: Path, timeout_s: float, role: str | None, mask: set[int]
) -> None:
    die_with_parent(rank_pid)  # go when the rank goes
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    for signum in _STEP_SIGNALS:
        signal.signal(signum, _note_signal)
    signal.pthread_sigmask(signal.SIG_SETMASK, set(mask) - set(_STEP_SIGNALS))
    deadline = time.monotonic() + timeout_s
    initialized, ending = False, None
    while (left := deadline - time.monotonic()) > 0:
        # the step is being ended: the rank gets a short grace to go
        if _received and ending is None:
            ending = signal.Signals(_received[0]).name
            deadline = min(deadline, time.monotonic() + SIGNAL_GRACE_S)
            continue
        ready, _, _ = select.select([read_end, wake_r], [], [], left)
        if wake_r in ready:
            os.read(wake_r, 64)
        if read_end not in ready:
            continue
        got = os.read(read_end, 16)
        if not got or _WORLD_FORMED in got:  # end of file (the rank is gone), or the world is up
            return
        initialized = True
    for signum in _STEP_SIGNALS:  # from here on nothing may interrupt the record and the kill
        signal.signal(signum, signal.SIG_IGN)
    host = this_host()
    who = f"{'role ' + repr(role) + ', ' if role else ''}pid {rank_pid} on {host}"
    where = "the first collectives" if initialized else "MPI_Init"
    if ending:
        why = (
            f"the step was ended ({ending}) while {who} was still in {where}, and the rank did not go: "
            f"killed {SIGNAL_GRACE_S:g} s later"
        )
    elif initialized:
        why = (
            f"the MPI world did not form within {timeout_s:g} s ({who} finished MPI_Init, not the first "
            f"collectives; controller.world_timeout_s): some rank never joined it"
        )
    else:
        why = (
            f"MPI_Init did not finish within {timeout_s:g} s ({who}; controller.world_timeout_s): "
            f"the MPI library could not form the world; its own errors, if any, are in the output above"
        )
    record_startup_failure(run_dir, host, why, culprit=not initialized and not ending)
    die_with_parent(None, signal_number=0)  # outlive the rank for the message below
    os.kill(rank_pid, signal.SIGKILL)
    signal.signal(signal.SIGALRM, _give_up_writing)
    signal.alarm(5)
    try:
        print(f"rollhpc: {why}", file=sys.stderr, flush=True)
    except (OSError, TimeoutError):
        pass
    finally:
        signal.alarm(0)


def _give_up_writing(signum, frame):  # noqa: ARG001
    raise TimeoutError("stderr is not being read")
