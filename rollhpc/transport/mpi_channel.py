"""Messages over MPI: an envelope plus a payload whose large buffers travel raw.

A message is one header (a pickle of the envelope, the payload's skeleton and its buffer sizes)
followed by one raw MPI message per buffer, all with the same (source, tag): MPI's non-overtaking
rule keeps them in order. A large payload going to every rank of a role (a one-to-all call) can send
only its header point to point and its buffers once, as MPI broadcasts over a communicator of the
controller and that role's ranks (``fanout``): the controller then does not send N copies one after
another, and MPI's tree / scatter-allgather algorithms spread the work over the receivers. Every rank of
the role joins those broadcasts in the order its calls arrive, which is the order they were sent. To a role
whose ranks all share the controller's machine, such a payload is written once into a shared-memory file
(``send_shared``) and every rank maps it copy-on-write: one copy in all, as Ray's object store makes, instead
of one per rank through MPI's shared-memory transport. The files are reused once every rank has dropped its
mapping (a rank says so in its replies): a fresh file's pages must be allocated and zeroed by the kernel,
which costs more than the copy itself. Sends are non-blocking and tracked so a caller never blocks on a busy
receiver; receives are polled so an idle rank sleeps instead of spinning a core (MPICH's blocking receive
busy-waits, which halves the speed of a trainer sharing a CPU with an idle generator).
"""

from __future__ import annotations

import itertools
import mmap
import os
import pickle
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from rollhpc.proc.mpi_shm import FANOUT_PREFIX, SHM_DIR
from rollhpc.transport import wire

TAG_CALL = 11
TAG_REPLY = 12
TAG_RELAY = 13  # a bundle of replies from a rank to its relay (rollhpc.transport.reply_tree)
# one-to-all payloads at least this large travel as broadcasts or in shared memory (below it, N small sends
# are quicker)
FANOUT_MIN_BYTES = 1 << 20
SHARED_DIR = str(SHM_DIR)
SHARED_PREFIX = FANOUT_PREFIX  # + controller pid + a counter: rollhpc.proc.mpi_shm removes those a killed run left
_NONE_HEADER = wire.encode(None)[0]
_ALIGN = 4096  # each buffer starts on a page of the file: its arrays are aligned for any dtype


@dataclass
class Message:
    source: int
    envelope: dict[str, Any]
    payload: object  # whatever the sender sent (wire.decode)


@dataclass
class Encoded:
    """A payload encoded once and sendable to many destinations (one-to-all dispatch)."""

    header: bytes
    buffers: list[memoryview]

    @classmethod
    def of(cls, payload: object) -> Encoded:
        header, buffers = wire.encode(payload)
        return cls(header, buffers)


class MpiChannel:
    """``busy_since``: when the MPI call now running began (None between calls). Every call here should
    return at once or, for a receive whose header has arrived, as soon as its buffers have crossed; one that
    does not is stuck on a peer that is gone (rollhpc.controller.mpi_stall watches it on the controller)."""

    def __init__(
        self,
        comm: MPI.Comm,
        fanout: dict[str, MPI.Comm] | None = None,
        my_fanout: MPI.Comm | None = None,
        shared: dict[str, list[int]] | None = None,
    ):
        self.comm = comm
        # the controller's: role -> (controller + the role's ranks), controller first
        self.fanout = fanout or {}
        # a worker's: the one of its role, where broadcast buffers arrive
        self.my_fanout = my_fanout
        self.fanout_ranks = {
            role: sorted(_world_ranks(c, comm)[1:]) for role, c in self.fanout.items()
        }
        # the controller's: roles on its own machine, whose one-to-all payloads go through shared memory
        self.shared_ranks = {role: sorted(ranks) for role, ranks in (shared or {}).items()}
        self.fanouts_sent = 0
        self.shared_sent = 0
        self.segments = SharedSegments()  # the controller's files for those payloads
        self.released: list[
            str
        ] = []  # a worker's: files whose mapping it has dropped since its last reply
        self._inflight: list[MPI.Request] = []
        self.busy_since: float | None = None
        self.buffers = ReceiveBuffers()

    def send(self, dest: int, tag: int, envelope: dict[str, Any], payload: object = None) -> None:
        self.send_encoded(dest, tag, envelope, Encoded.of(payload))

    def send_encoded(self, dest: int, tag: int, envelope: dict[str, Any], enc: Encoded) -> None:
        self.send_to_each([dest], tag, envelope, enc)

    def send_to_each(
        self, dests: list[int], tag: int, envelope: dict[str, Any], enc: Encoded
    ) -> None:
        """``enc`` to each of ``dests`` in turn (point to point): its header pickled once for all of them, and
        MPI's progress made once after the last send (per send, it would test every send still in flight:
        O(N^2) for a call to N ranks)."""
        sizes = [m.nbytes for m in enc.buffers]
        head = pickle.dumps((envelope, enc.header, sizes), protocol=5)
        self.busy_since = time.monotonic()
        try:
            for dest in dests:
                self._inflight.append(self.comm.Isend([head, MPI.BYTE], dest=dest, tag=tag))
                for m in enc.buffers:
                    self._inflight.append(self.comm.Isend([m, MPI.BYTE], dest=dest, tag=tag))
        finally:
            self.busy_since = None
        self.progress()

    def send_each(self, tag: int, envelopes: dict[int, dict[str, Any]]) -> None:
        """A small envelope of its own (no payload) to each rank, MPI's progress made once after the last."""
        self.busy_since = time.monotonic()
        try:
            for dest, envelope in envelopes.items():
                head = pickle.dumps((envelope, _NONE_HEADER, []), protocol=5)
                self._inflight.append(self.comm.Isend([head, MPI.BYTE], dest=dest, tag=tag))
        finally:
            self.busy_since = None
        self.progress()

    def send_fanout(self, role: str, tag: int, envelope: dict[str, Any], enc: Encoded) -> None:
        """``enc`` to every rank of ``role`` (``fanout_ranks[role]``): the header to each, the buffers as
        broadcasts over the role's fanout communicator. Non-blocking, like ``send_encoded``."""
        comm = self.fanout[role]
        sizes = [m.nbytes for m in enc.buffers]
        head = pickle.dumps(({**envelope, "fanout": True}, enc.header, sizes), protocol=5)
        self.busy_since = time.monotonic()
        try:
            for dest in self.fanout_ranks[role]:
                self._inflight.append(self.comm.Isend([head, MPI.BYTE], dest=dest, tag=tag))
            for m in enc.buffers:
                self._inflight.append(comm.Ibcast([m, MPI.BYTE], root=0))
            self.fanouts_sent += 1
        finally:
            self.busy_since = None
        self.progress()

    def send_shared(self, role: str, tag: int, envelope: dict[str, Any], enc: Encoded) -> bool:
        """``enc`` to every rank of ``role`` (``shared_ranks[role]``, all on this machine): the buffers written
        once into a shared-memory file (a free one of the same size when there is one), its name in the header
        each rank gets. False when the file cannot be written (e.g. a small /dev/shm): nothing was sent."""
        ranks = self.shared_ranks[role]
        try:
            path, offsets = self.segments.write(enc.buffers, ranks)
        except OSError:
            return False
        sizes = [m.nbytes for m in enc.buffers]
        head = pickle.dumps(
            ({**envelope, "shared": (path, offsets)}, enc.header, sizes), protocol=5
        )
        self.busy_since = time.monotonic()
        try:
            for dest in ranks:
                self._inflight.append(self.comm.Isend([head, MPI.BYTE], dest=dest, tag=tag))
            self.shared_sent += 1
        finally:
            self.busy_since = None
        self.progress()
        return True

    def take_released(self) -> list[str]:
        """A worker's: the shared-memory files it no longer maps, to tell the controller in its next reply."""
        out, self.released = self.released, []
        return out

    def progress(self) -> None:
        """Let MPI move pending sends and forget the finished ones (drops references to their buffers)."""
        if self._inflight:
            self.busy_since = time.monotonic()
            try:
                self._inflight = [r for r in self._inflight if not r.Test()]
            finally:
                self.busy_since = None

    def pending_sends(self) -> int:
        return len(self._inflight)

    def flush(self, timeout_s: float) -> bool:
        """Wait for all sends to be taken by their receivers; False if some were not within the timeout."""
        deadline = time.monotonic() + timeout_s
        while self._inflight:
            self.progress()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def poll(self, tag: int, source: int = MPI.ANY_SOURCE) -> Message | None:
        """Receive one whole message if its header has arrived, else return None at once."""
        status = MPI.Status()
        self.busy_since = time.monotonic()
        try:
            if not self.comm.Iprobe(source=source, tag=tag, status=status):
                return None
            src = status.Get_source()
            head = bytearray(status.Get_count(MPI.BYTE))
            self.comm.Recv([head, MPI.BYTE], source=src, tag=tag)
            envelope, header, sizes = pickle.loads(head)
            shared = envelope.pop("shared", None)
            if shared is not None:  # written once into a file on this machine (send_shared)
                buffers = _map_shared(*shared, sizes, self.released)
            else:
                buffers = [self.buffers.get(n) for n in sizes]
                if envelope.pop("fanout", False):
                    self._join_fanout(buffers)
                else:
                    for buf in buffers:
                        self.comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
        finally:
            self.busy_since = None
        return Message(src, envelope, wire.decode(header, buffers))

    def _join_fanout(self, buffers: list[np.ndarray]) -> None:
        """Receive a one-to-all payload's buffers from the controller's broadcasts. Polled, not waited on:
        MPICH's blocking wait spins a core, which a sibling rank still busy with its last call (the broadcast
        completes only when every rank has joined) may need."""
        if self.my_fanout is None:
            raise RuntimeError(
                "a broadcast payload arrived on a rank without a fanout communicator"
            )
        requests = [self.my_fanout.Ibcast([buf, MPI.BYTE], root=0) for buf in buffers]
        backoff = Backoff(hot_s=0.05, max_sleep_s=0.001)
        while not MPI.Request.Testall(requests):
            # waiting on siblings, not stuck: each test returns at once
            self.busy_since = time.monotonic()
            backoff.wait()


class ReceiveBuffers:
    """Receive buffers, the large ones (``min_bytes`` and up) reused once nothing refers to them any more.

    Why: a fresh large array is a fresh mmap whose pages fault in one by one on the first write, and the
    kernel zeroes each of them: receiving 64 MiB into new memory on 8 ranks of a 2-core node spent more
    time faulting pages than copying. A buffer handed out lives inside the decoded payload (arrays are
    views of it), so it is free again exactly when the caller has dropped every part of that payload.
    At most ``max_bytes`` are kept beyond what callers hold."""

    def __init__(self, min_bytes: int = 1 << 20, max_bytes: int = 512 << 20):
        self.min_bytes, self.max_bytes = min_bytes, max_bytes
        self._kept: list[np.ndarray] = []  # oldest first
        self.reused = 0

    def get(self, n: int) -> np.ndarray:
        if n < self.min_bytes:
            return np.empty(n, dtype=np.uint8)
        for i in range(len(self._kept)):
            # the list's and the call's
            if self._kept[i].nbytes == n and sys.getrefcount(self._kept[i]) == 2:
                buf = self._kept.pop(i)
                self._kept.append(buf)
                self.reused += 1
                return buf
        buf = np.empty(n, dtype=np.uint8)
        self._kept.append(buf)
        while sum(b.nbytes for b in self._kept) > self.max_bytes:
            self._kept.pop(0)  # a caller still holding it keeps it alive; it is just not reused
        return buf


class SharedSegments:
    """The controller's shared-memory files for one-to-all payloads, each held by the ranks that may still map
    it. A file every holder has released (``release``: the ranks report it in their replies) is free and is
    written again for the next payload of its size; at most ``keep_bytes`` of free files are kept. The
    controller writes through a shared mapping of each file that it keeps (a copy into pages already there
    runs at memory speed; a write() into a tmpfs file is about 3x slower here), in slices copied by a few
    threads at once, as Ray's object store copies a large object in."""

    def __init__(self, keep_bytes: int = 1 << 30):
        self.keep_bytes = keep_bytes
        self.holders: dict[str, set[int]] = {}  # file -> ranks that may map it
        self.maps: dict[str, mmap.mmap] = {}  # file -> the controller's writable mapping of it
        self.free: list[str] = []  # oldest first
        self.reused = 0
        self._ids = itertools.count()

    def write(self, buffers: list[memoryview], ranks: list[int]) -> tuple[str, list[int]]:
        offsets, total = wire.layout([m.nbytes for m in buffers], _ALIGN)
        path = next((p for p in self.free if len(self.maps[p]) == total), None)
        if path is not None:
            self.free.remove(path)
            self.reused += 1
        else:
            path = os.path.join(SHARED_DIR, f"{SHARED_PREFIX}{os.getpid()}_{next(self._ids)}")
            try:
                self.maps[path] = _create_shared(path, total)
            except OSError:
                self._remove(path)
                raise
        target = np.frombuffer(self.maps[path], dtype=np.uint8)
        pieces = []
        for m, pos in zip(buffers, offsets):
            src = np.frombuffer(m, dtype=np.uint8)
            pieces += [
                (target[pos + i : pos + min(i + _SLICE, src.size)], src[i : i + _SLICE])
                for i in range(0, src.size, _SLICE)
            ]
        if len(pieces) > 1:
            list(_copiers().map(lambda p: np.copyto(*p), pieces))
        else:
            for dst, src in pieces:
                np.copyto(dst, src)
        del target
        self.holders[path] = set(ranks)
        return path, offsets

    def release(self, rank: int, paths: list[str]) -> None:
        for path in paths:
            holders = self.holders.get(path)
            if holders is None:
                continue
            holders.discard(rank)
            if not holders:
                del self.holders[path]
                self.free.append(path)
        while self.free and sum(len(self.maps[p]) for p in self.free) > self.keep_bytes:
            self._remove(self.free.pop(0))

    def remove_all(self) -> None:
        """The run ends: every file goes (a rank still mapping one keeps its pages until it exits)."""
        for path in [*self.holders, *self.free]:
            self._remove(path)
        self.holders.clear()
        self.free.clear()

    def _remove(self, path: str) -> None:
        mem = self.maps.pop(path, None)
        if mem is not None:
            try:
                mem.close()
            except BufferError:  # a copy still running into it: the mapping goes with its last view
                pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _create_shared(path: str, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path``, mapped shared and writable. Its pages are allocated on the first
    write, so a file that does not fit fails here (fallocate) rather than with SIGBUS in the copy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


_SLICE = 8 << 20
_pool: ThreadPoolExecutor | None = None


def _copiers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(
            max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="shm-copy"
        )
    return _pool


def _map_shared(
    path: str, offsets: list[int], sizes: list[int], released: list[str]
) -> list[np.ndarray]:
    """The buffers of a shared-memory payload as arrays over one private (copy-on-write) mapping of its file:
    nothing is copied until a page is written, and what a rank writes stays its own, as with a received copy.
    When the last array is gone the mapping is dropped and ``path`` goes into ``released``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        mem = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    arrays = [
        np.frombuffer(mem, dtype=np.uint8, count=n, offset=off) for off, n in zip(offsets, sizes)
    ]
    weakref.finalize(mem, released.append, path)
    return arrays


def _world_ranks(sub: MPI.Comm, world: MPI.Comm) -> list[int]:
    """The ranks in ``world`` of ``sub``'s ranks 0..n-1."""
    g_sub, g_world = sub.Get_group(), world.Get_group()
    try:
        return list(g_sub.Translate_ranks(list(range(sub.Get_size())), g_world))
    finally:
        g_sub.Free()
        g_world.Free()


class Backoff:
    """Polling pace: right after activity, poll hot but yield the core to others (low latency for
    back-to-back calls); once idle for ``hot_s``, sleep longer and longer up to ``max_sleep_s``
    (an idle role must not steal CPU from a busy one on the same cores)."""

    def __init__(self, hot_s: float = 0.002, max_sleep_s: float = 0.002):
        self.hot_s = hot_s
        self.max_sleep_s = max_sleep_s
        self._since = time.monotonic()
        self._sleep = 0.0

    def reset(self) -> None:
        self._since = time.monotonic()
        self._sleep = 0.0

    def wait(self) -> None:
        if time.monotonic() - self._since < self.hot_s:
            os.sched_yield()
            return
        self._sleep = min(self.max_sleep_s, self._sleep * 2 if self._sleep else 2e-5)
        time.sleep(self._sleep)
