"""Processes that end when their parent ends, so that a killed run leaves nothing behind.

Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) is asked for in every process rollhpc starts
or lets start under a rank: mpiexec under the local launcher, each rank, each rank's MPI_Init watcher,
and the multiprocessing Manager megatron's checkpoint writer needs. Without it, a SIGKILL (the OOM
killer, a user's kill -9, a test) orphans the children: they hold memory and file handles forever on a
workstation (Slurm's cgroups clean up after a job; a local run has nobody to do that).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, signal_number: int = signal.SIGKILL) -> None:
    """SIGKILL this process when its parent exits. ``parent_pid``: the parent it should have; if that
    one is already gone (we were re-parented before asking), exit at once. ``signal_number=0`` takes the
    request back. No-op where prctl is missing (not Linux) or when ROLLHPC_NO_PDEATHSIG is set (debugging
    a rank under a debugger that re-parents)."""
    if os.environ.get("ROLLHPC_NO_PDEATHSIG"):
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal_number)
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(0)


# the process that is forking, noted just before each fork (0: from another thread than main)
_forking_pid = 0


def _note_forking_process() -> None:
    global _forking_pid
    # the signal follows the forking thread, not the process: a helper forked from a thread that ends first
    # would be killed with that thread, so only forks from the main thread (which lives as long as we do) get it
    _forking_pid = os.getpid() if threading.current_thread() is threading.main_thread() else 0


def _die_with_forking_process() -> None:
    if _forking_pid:
        die_with_parent(_forking_pid)


_forks_covered = False


def forked_children_die_with_us() -> None:
    """Every process this one forks from now on (and those they fork) gets a parent-death signal: libraries
    fork helpers we do not start ourselves. megatron's checkpoint writer forks one process per write bucket;
    a rank SIGKILLed while one is writing leaves it behind, blocked flushing its results into a pipe nobody
    reads. (Fork-then-exec through ``subprocess`` runs no Python at-fork hooks; those children are untouched.)"""
    global _forks_covered
    if not _forks_covered:  # (die_with_parent itself honours ROLLHPC_NO_PDEATHSIG)
        os.register_at_fork(before=_note_forking_process, after_in_child=_die_with_forking_process)
        _forks_covered = True
