"""MPICH shared-memory segments left behind by killed ranks, removed when a restarted attempt starts.

MPICH names each node's shared-memory segment after the job's process-manager id (``mpich_shm_<FNV hash of
the PMI job id>_<node index>``, and ``mpich_vci_...``), opens it with "create, or attach if it exists", and
removes it in MPI_Finalize. Ranks that are SIGKILLed (a lost node's neighbours, a step the batch script
ended, Slurm's own kill) never get there, so every failed attempt leaves its segments in /dev/shm. A
requeued Slurm job keeps its job id and starts its srun as step 0 again: with the same PMI job id its
ranks would open those segments, and MPI_Init fails ("MPIDI_POSIX_comm_bootstrap: Out of memory": a
segment sized for another number of ranks per node). The batch script therefore gives each attempt's
world a step id of its own (``launch.slurm``), and this module removes the garbage: on a restarted
attempt each rank, before MPI_Init, removes the segments of its own user that were last changed before the
attempt started (the batch script exports that time, ``ATTEMPT_STARTED``) and that no live process maps.
A segment of this attempt is newer; one of another running job is mapped by its ranks.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from rollhpc.proc.attempt import restart_number

log = logging.getLogger("rollhpc.proc.mpi_shm")

# seconds since the epoch, set by the batch script before srun
ATTEMPT_STARTED = "ROLLHPC_ATTEMPT_STARTED"
SHM_DIR = Path("/dev/shm")
# the controller's one-to-all payload files (rollhpc.transport.mpi_channel), + its pid and a counter; named here,
# where the clean-ups look for them, because this module must not import MPI
FANOUT_PREFIX = "rollhpc_fanout_"
PREFIXES = ("mpich_shm_", "mpich_vci_", FANOUT_PREFIX)


def mapped_paths(uid: int) -> dict[str, list[int]]:
    """Files mapped by live processes of ``uid`` (from /proc/PID/maps), with those processes."""
    found: dict[str, list[int]] = {}
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
                        pids = found.setdefault(parts[5].strip().removesuffix(" (deleted)"), [])
                        if int(proc.name) not in pids:
                            pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


# a segment younger than this may be another world's that its ranks have not mapped yet
MIN_AGE_S = 120.0


def stale_segments(
    before: float, shm_dir: Path = SHM_DIR, min_age_s: float = MIN_AGE_S
) -> list[Path]:
    """This user's MPICH segments in ``shm_dir`` last changed before ``before`` and at least ``min_age_s`` ago
    that no live process maps. The age: another MPI job of the same user on the node (a node shared between
    jobs, simulated nodes sharing one machine) creates its segment in MPI_Init a moment before its ranks map
    it; removed in between, its ranks end up in two segments of one name and the world never forms."""
    young = time.time() - min_age_s
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
        if st.st_uid == uid and max(st.st_mtime, st.st_ctime) < before and st.st_mtime < young:
            candidates.append(path)
    if not candidates:
        return []
    in_use = mapped_paths(uid)
    for p in candidates:
        # a live job's, or a process of an earlier attempt that outlived it: say which
        if str(p) in in_use:
            who = ", ".join(f"{pid} ({_command(pid)})" for pid in in_use[str(p)][:3])
            print(
                f"rollhpc: keeping {p}, older than this attempt but mapped by {who}",
                file=sys.stderr,
                flush=True,
            )
    return [p for p in candidates if str(p) not in in_use]


def _command(pid: int) -> str:
    try:
        return (
            (Path("/proc") / str(pid) / "cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")[:120]
        )
    except OSError:
        return "?"


def remove_stale_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """On a restarted attempt (``restart_number() > 0`` and ``ATTEMPT_STARTED`` set): remove the
    segments an earlier attempt left on this node; returns their names. A no-op otherwise."""
    started = os.environ.get(ATTEMPT_STARTED, "")
    if restart_number() == 0 or not started:
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
