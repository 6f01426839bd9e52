"""Which attempt of a Slurm run this process belongs to: one number across Slurm's requeues and rollhpc's
resubmissions.

A run restarts in two ways. Slurm requeues the same job (its batch node died: SLURM_RESTART_COUNT counts
those), or the batch script submits the job again as a new one (``rollhpc.launch.resubmit``: a time-limit
checkpoint, a lost worker, a world that did not form), which starts with no SLURM_RESTART_COUNT at all.
The resubmission therefore passes the restarts so far in ROLLHPC_RESTART_BASE, and the attempt's number is
the sum. Light on purpose: every rank reads it before MPI_Init (``rollhpc.testing.fault_injection``,
``rollhpc.proc.mpi_shm``).
"""

from __future__ import annotations

import os

RESTART_BASE = "ROLLHPC_RESTART_BASE"  # restarts before this job began (set by a resubmission)


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0


def slurm_restart_count() -> int:
    """How often Slurm requeued this job id (SLURM_RESTART_COUNT; 0 outside Slurm)."""
    return _int_env("SLURM_RESTART_COUNT")


def restart_number() -> int:
    """0 for a run's first attempt, n for its n-th restart, however each restart came about."""
    return _int_env(RESTART_BASE) + slurm_restart_count()
