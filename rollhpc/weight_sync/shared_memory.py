"""Host slots for the streamed weight sync (``weight_sync.slots``): files in /dev/shm, mapped by every process.

The CPU counterpart of ``weight_sync.cuda_ipc`` for a trainer and generators on one host (``weight_sync: ipc``
on CPU; ``weight_sync.routing``): the trainer's rank 0 packs buckets into ``IN_FLIGHT_BUCKETS`` slots, each a
file in /dev/shm (tmpfs: POSIX shared memory, what ``shm_open`` gives) mapped ``MAP_SHARED`` with
``torch.from_file``, so an unrelated MPI rank opens it by name. A receiver maps a slot once and copies each bucket
out of it; once every receiver has mapped a slot (acknowledged its first bucket) its name is unlinked, so a
killed process leaves no file behind past that moment; the pages go when the last mapping does. No Python
``multiprocessing.shared_memory``: its resource tracker would unlink a receiver's attachment at the receiver's
exit and a mapping torch holds cannot be closed while tensors view it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from rollhpc.weight_sync.slot_memory import SlotHandle

__all__ = ["SLOT_PREFIX", "ShmSlots"]

SLOT_PREFIX = "rollhpc_slot_"  # + pid and a counter
_ids = itertools.count()


def _shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


class ShmSlots:
    """Slots in host shared memory (sender), and the receiver's mapping of them."""

    kind = "shared_memory"
    device = torch.device("cpu")
    keep_mapped = True  # a receiver maps a slot once: its name is unlinked after every receiver has (mapped_by_all)

    def __init__(self) -> None:
        self._paths: set[str] = set()  # slot files this sender made and has not unlinked yet

    # -- sender
    def allocate(self, nbytes: int) -> tuple[torch.Tensor, str, SlotHandle]:
        """A new slot file of ``nbytes``, mapped: the buffer, its id, and the (path, size) a receiver opens."""
        path = str(_shm_dir() / f"{SLOT_PREFIX}{os.getpid()}_{next(_ids)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._paths.add(path)
        return (
            torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8),
            path,
            (path, nbytes),
        )

    def ready(self) -> None:
        """Nothing to wait for: the copies into the mapping are done when they return."""

    def mapped_by_all(self, handle: SlotHandle) -> None:
        """Every receiver holds the slot mapped: its name can go (the pages stay while mapped)."""
        self._unlink(handle[0])

    def close(self) -> None:
        """Unlink whatever slot is still named (a sync that stopped early)."""
        for path in list(self._paths):
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        self._paths.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    # -- receiver
    def open(self, handle: SlotHandle) -> torch.Tensor:
        """The sender's slot mapped into this process (no copy). Opened without O_CREAT first and mapped through
        that descriptor: ``torch.from_file`` creates a missing file, which would leave a slot behind if the
        sender unlinked it meanwhile (a sender that stopped)."""
        path, nbytes = handle
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"weight sync: the sender's slot {path} is gone (the sender stopped?)"
            ) from None
        try:
            return torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8
            )
        finally:
            os.close(fd)

    def copy_out(self, view: torch.Tensor) -> torch.Tensor:
        """A bucket in this process's own memory (the slot is refilled once acknowledged)."""
        return view.clone()
