"""Disk space for a run's checkpoints: room checked before each save, and a full filesystem or quota told in one
line that says what to do.

Why: on a cluster a long run usually writes to a project filesystem with a quota, and running out of it is a usual
way for a multi-week run to die. What the user read then was the library's words, not the cause: torch's archive
writer reports a short write as ``[enforce fail at inline_container.cc] . unexpected pos 704 vs 598``, wrapped in
megatron's ``CheckpointException`` and two tracebacks. Here the cause is named (which filesystem, how much is free,
how much a checkpoint takes), with what is safe (the newest good checkpoint) and the command that continues.

A checkpoint takes about what the previous one took (the same model and optimizer state), so the room check before
a save compares the newest committed checkpoint's size (its manifest's bytes) with the free space of the
filesystem that holds the checkpoints: a save that cannot fit is not started, and a warning comes while only
``WARN_CHECKPOINTS`` or fewer more would fit. The first save has no size to go by and is only caught if it fails.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from rollhpc.checkpoint.storage import Checkpoint, CheckpointStore, human_bytes

log = logging.getLogger("rollhpc.checkpoint")

# What a write that ran out of space says, whatever library raised it: the OS's ENOSPC / EDQUOT, and torch's
# archive writer (torch.save, distributed checkpoints) reporting a short write
_DISK_FULL = re.compile(
    r"No space left on device|Disk quota exceeded|\bENOSPC\b|\bEDQUOT\b|\[Errno (?:28|122)\]|"
    r"unexpected pos \d+ vs \d+|PytorchStreamWriter failed writing",
    re.IGNORECASE,
)
WARN_CHECKPOINTS = 2  # warn while the filesystem has room for this many more checkpoints, or fewer
MARGIN = (
    1.05  # a save needs the previous checkpoint's size and this share more (its manifest, growth)
)


class OutOfSpace(RuntimeError):
    """The run's filesystem is full or over quota; ``summary`` says which, what is safe and what continues."""

    def __init__(self, summary: str):
        super().__init__(summary)
        self.summary = summary


def is_disk_full(err_type: str, message: str) -> bool:
    """Whether an error (its type name and message) is a write that ran out of space or quota."""
    return bool(_DISK_FULL.search(f"{err_type}: {message}"))


def raised_out_of_space(e: BaseException) -> bool:
    """``is_disk_full`` of an exception: a worker's error by the type and message it reported, any other by its
    own."""
    return is_disk_full(getattr(e, "err_type", type(e).__name__), getattr(e, "message", str(e)))


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds ``path`` (an existing ancestor's, if it does not exist)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    while not os.path.ismount(p):
        p = p.parent
    return p


@dataclass(frozen=True)
class Room:
    """The free space where the checkpoints go, and what one takes."""

    mount: Path
    free: int
    total: int
    newest: Checkpoint | None  # the newest good checkpoint (sizes checked), None before the first
    needed: int | None  # about what the next checkpoint takes: the newest's bytes

    @classmethod
    def of(cls, store: CheckpointStore) -> Room:
        where = store.root if store.root.exists() else store.root.parent
        usage = shutil.disk_usage(where)
        newest = store.latest_good(deep=False)
        needed = int(newest.manifest.nbytes * MARGIN) if newest is not None else None
        return cls(mount_point(where), usage.free, usage.total, newest, needed)

    def fits(self) -> bool:
        return self.needed is None or self.free >= self.needed

    def more_that_fit(self) -> int | None:
        """How many more checkpoints of the newest's size the free space holds (None: no size to go by)."""
        return None if not self.needed else self.free // self.needed

    def describe(self, run_dir: Path) -> str:
        """Where the space ran out, what a checkpoint takes, what is intact, and what continues the run."""
        run_dir = Path(run_dir).resolve()
        parts = [f"{self.mount} has {human_bytes(self.free)} free of {human_bytes(self.total)}"]
        if self.newest is not None and self.needed:
            parts.append(
                f"a checkpoint takes about {human_bytes(self.needed)} (as {self.newest.path.name} did)"
            )
            parts.append(
                f"the newest good checkpoint, {self.newest.path.name} (step {self.newest.step}), is "
                "intact"
            )
        else:
            parts.append("no checkpoint was committed yet")
        parts.append(
            "free space (or raise the quota), then continue with: slurm/resume.sh "
            f"{run_dir} (Slurm), or rollhpc train {run_dir / 'config.yaml'} "
            f"run.output_dir={run_dir.parent} --resume"
        )
        return "; ".join(parts)


def out_of_space(store: CheckpointStore, run_dir: Path, what: str) -> OutOfSpace:
    """The error that ends a run whose ``what`` (a save, a write) ran out of space, in words that say so."""
    return OutOfSpace(f"out of disk space: {what} failed: {Room.of(store).describe(run_dir)}")


def check_room(store: CheckpointStore, run_dir: Path, step: int) -> None:
    """Before checkpoint ``step`` is written: raise ``OutOfSpace`` when it cannot fit (nothing is started, the
    newest good checkpoint stays as it is); warn while only a few more would fit."""
    room = Room.of(store)
    if not room.fits():
        raise OutOfSpace(
            f"out of disk space: checkpoint {step} was not started, it would not fit: "
            f"{room.describe(run_dir)}"
        )
    more = room.more_that_fit()
    if more is not None and more <= WARN_CHECKPOINTS:
        log.warning(
            "disk space: %s has room for %d more checkpoint(s) of %s (%s free): free space before the "
            "run stops for it",
            room.mount,
            more,
            human_bytes(room.needed or 0),
            human_bytes(room.free),
        )
