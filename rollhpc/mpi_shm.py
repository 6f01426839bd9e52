"""MPICH shared-memory segments left behind by a killed attempt, removed before the next attempt's MPI_Init.

MPICH names each node's shared-memory segment after the job's process-manager id (``mpich_shm_<FNV hash of
the PMI job id>_<node index>``, and ``mpich_vci_...``) and opens it with "create, or attach if it exists". A
requeued Slurm job keeps its job id and runs its srun as step 0 again, so its ranks find the segments of
the attempt before, which nobody removed when its ranks were SIGKILLed (a lost node's neighbours, a step the
batch script ended, Slurm's own kill): MPI_Init then fails with "MPIDI_POSIX_comm_bootstrap: Out of memory"
on that node, and the ranks waiting for it stay in MPI_Init until the world-formation guard ends them.

So on a restarted attempt each rank, before MPI_Init, removes the segments of its own user that were
created before the attempt started (the batch script exports that time, ``ATTEMPT_STARTED``) and that no
live process maps: a segment of this attempt is newer, one of another running job is mapped by its ranks.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("rollhpc.mpi_shm")

ATTEMPT_STARTED = "ROLLHPC_ATTEMPT_STARTED"  # seconds since the epoch, set by the batch script before srun
SHM_DIR = Path("/dev/shm")
PREFIXES = ("mpich_shm_", "mpich_vci_")


def mapped_paths(uid: int) -> set[str]:
    """Files mapped by any live process of ``uid`` (from /proc/PID/maps)."""
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if proc.stat().st_uid != uid:
                continue
            with open(proc / "maps") as f:
                for line in f:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        found.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def stale_segments(before: float, shm_dir: Path = SHM_DIR) -> list[Path]:
    """This user's MPICH segments in ``shm_dir`` last changed before ``before`` that no live process maps."""
    uid = os.getuid()
    candidates = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return []
    for path in entries:
        if not path.name.startswith(PREFIXES):
            continue
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == uid and max(st.st_mtime, st.st_ctime) < before:
            candidates.append(path)
    if not candidates:
        return []
    in_use = mapped_paths(uid)
    return [p for p in candidates if str(p) not in in_use]


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """On a restarted Slurm attempt (SLURM_RESTART_COUNT > 0 and ``ATTEMPT_STARTED`` set): remove the
    segments an earlier attempt left on this node; returns their names. A no-op otherwise."""
    started = os.environ.get(ATTEMPT_STARTED, "")
    if os.environ.get("SLURM_RESTART_COUNT", "0") in ("", "0") or not started:
        return []
    removed = []
    for path in stale_segments(float(started), shm_dir):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:  # another rank of this node removed it first
            continue
        except OSError as e:
            log.warning("could not remove %s, left by an earlier attempt: %s", path, e)
    return removed
