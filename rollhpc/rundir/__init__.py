"""A run directory: the name of every file in it (``RunPaths``), and how rollhpc writes files there (and in
checkpoints, exports, reports): whole or not at all, and durable once written.

``RunPaths(run_dir).world`` and its siblings are the only place a run directory's file names are spelled out;
which module writes or reads each one is said beside it. The run's own records (its events, lost nodes, the
controller's exit, a world that did not form) are ``rollhpc.rundir.records``; the kinds of failure they name,
``rollhpc.rundir.failure_kind``.

A file goes to a temporary name in its own directory (so the rename is atomic), is fsynced, renamed over the
target, and the directory is fsynced (so the rename survives a crash of the node). Readers, on this node or
another, see the old content or the new, never a mix, and a process killed mid-write leaves at most a
``.NAME.tmp-*`` file behind. Temporary names are unique per call: several ranks may write the same record at
once. A directory is built under a temporary name beside its target and renamed into place the same way.

A leaf module (the standard library and ``file_modes`` only): every layer may use it, the batch script's light
requeue code included.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rollhpc import file_modes


class RunPaths:
    """The files and folders of one run directory (what submitit's ``JobPaths`` is for one job)."""

    # the resolved config (cli, at the start; read by every rank and by requeue)
    CONFIG = "config.yaml"
    PLAN = "plan.json"  # the world plan (cli / placement.device_mapping)
    WORLD = "world.json"  # every rank's host and pid, written by the controller once the world has formed (rank)
    LAUNCH = "launch.json"  # the local launcher's command and shared memory (launch.local)
    ERROR = "error.json"  # why the run failed, for the user (rank, launch.requeue)
    METRICS = "metrics.jsonl"  # one line per step (observability.metrics)
    RESTARTS = "restarts.jsonl"  # starts, requeues, ends and failures of the run's attempts (launch.requeue)
    FAILED_NODES = "failed-nodes.json"  # nodes the run lost, with why (launch.requeue)
    # the controller's exit status in this attempt (launch.requeue)
    CONTROLLER_EXIT = "controller-exit.json"
    STARTUP_FAILED = "startup-failed.json"  # this attempt's world did not form (launch.requeue)
    STOP_REQUEST = "stop-request"  # checkpoint after this step and stop (controller.stop)
    STARTUP = "startup.json"  # the workers' start-up turns and each rank's build times (controller.startup)
    CLUSTER_CHECK = "cluster_check.json"  # the cluster check's table (pipelines.cluster_check)
    LOGS = "logs"
    TENSORBOARD = "tb"
    ROLLOUTS = "rollouts"
    CHECKPOINTS = "checkpoints"
    SLURM = "slurm"  # the Slurm side: batch scripts, the current job id, rescue jobs (launch.slurm, launch.resubmit)
    JOB_ID = "job_id"  # in slurm/: the run's current job
    BATCH_SCRIPT = "batch.sh"  # in slurm/: the batch text of the run's jobs
    RESCUE_SCRIPT = "rescue.sh"  # in slurm/: the batch text of the rescue jobs (launch.rescue)
    RESCUES = "rescues.json"  # in slurm/: {job id: the id of the rescue job waiting for it}

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunPaths({str(self.root)!r})"

    config = property(lambda self: self.root / self.CONFIG)
    plan = property(lambda self: self.root / self.PLAN)
    world = property(lambda self: self.root / self.WORLD)
    launch = property(lambda self: self.root / self.LAUNCH)
    error = property(lambda self: self.root / self.ERROR)
    metrics = property(lambda self: self.root / self.METRICS)
    restarts = property(lambda self: self.root / self.RESTARTS)
    failed_nodes = property(lambda self: self.root / self.FAILED_NODES)
    controller_exit = property(lambda self: self.root / self.CONTROLLER_EXIT)
    startup_failed = property(lambda self: self.root / self.STARTUP_FAILED)
    stop_request = property(lambda self: self.root / self.STOP_REQUEST)
    startup = property(lambda self: self.root / self.STARTUP)
    cluster_check = property(lambda self: self.root / self.CLUSTER_CHECK)
    logs = property(lambda self: self.root / self.LOGS)
    tensorboard = property(lambda self: self.root / self.TENSORBOARD)
    rollouts = property(lambda self: self.root / self.ROLLOUTS)
    checkpoints = property(lambda self: self.root / self.CHECKPOINTS)
    slurm = property(lambda self: self.root / self.SLURM)
    job_id = property(lambda self: self.slurm / self.JOB_ID)
    batch_script = property(lambda self: self.slurm / self.BATCH_SCRIPT)
    rescue_script = property(lambda self: self.slurm / self.RESCUE_SCRIPT)
    rescues = property(lambda self: self.slurm / self.RESCUES)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that needs a file name (h5py, a library's save); once
    the block ends without an error the file is fsynced and renamed over ``path``; on an error it is removed."""
    path = Path(path)
    fd, tmp = file_modes.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` (temp file, fsync, rename, fsync of the directory)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: object, indent: int | None = None) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=indent).encode())


def read_jsonl(path: Path) -> list[Any]:
    """Every JSON value of a file of one per line (none when the file is absent), skipping a line torn by a
    kill (a run in progress, or one that died mid-write)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def replace_dir(tmp: Path, dst: Path) -> None:
    """Put the finished directory ``tmp`` at ``dst``, moving an existing ``dst`` aside first and deleting it
    only once the new one is in place."""
    if not dst.exists():
        tmp.rename(dst)
        return
    old = dst.parent / f".{dst.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    dst.rename(old)
    tmp.rename(dst)
    shutil.rmtree(old, ignore_errors=True)
