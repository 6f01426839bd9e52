"""Point-to-point messages over MPI: an envelope plus a payload whose large buffers travel raw.

A message is one header (a pickle of the envelope, the payload's skeleton and its buffer sizes)
followed by one raw MPI message per buffer, all with the same (source, tag): MPI's non-overtaking
rule keeps them in order. Sends are non-blocking and tracked so a caller never blocks on a busy
receiver; receives are polled so an idle rank sleeps instead of spinning a core (MPICH's blocking
receive busy-waits, which halves the speed of a trainer sharing a CPU with an idle generator).
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

from rollhpc.transport import wire

TAG_CALL = 11
TAG_REPLY = 12


@dataclass
class Message:
    source: int
    envelope: dict[str, Any]
    payload: Any


@dataclass
class Encoded:
    """A payload encoded once and sendable to many destinations (one-to-all dispatch)."""

    header: bytes
    buffers: list[memoryview]

    @classmethod
    def of(cls, payload: Any) -> "Encoded":
        header, buffers = wire.encode(payload)
        return cls(header, buffers)


class MpiChannel:
    """``busy_since``: when the MPI call now running began (None between calls). Every call here should
    return at once or, for a receive whose header has arrived, as soon as its buffers have crossed; one that
    does not is stuck on a peer that is gone (rollhpc.controller.mpi_stall watches it on the controller)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self._inflight: list[MPI.Request] = []
        self.busy_since: float | None = None

    def send(self, dest: int, tag: int, envelope: dict[str, Any], payload: Any = None) -> None:
        self.send_encoded(dest, tag, envelope, Encoded.of(payload))

    def send_encoded(self, dest: int, tag: int, envelope: dict[str, Any], enc: Encoded) -> None:
        sizes = [m.nbytes for m in enc.buffers]
        head = pickle.dumps((envelope, enc.header, sizes), protocol=5)
        self.busy_since = time.monotonic()
        try:
            self._inflight.append(self.comm.Isend([head, MPI.BYTE], dest=dest, tag=tag))
            for m in enc.buffers:
                self._inflight.append(self.comm.Isend([m, MPI.BYTE], dest=dest, tag=tag))
        finally:
            self.busy_since = None
        self.progress()

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
            buffers = []
            for n in sizes:
                buf = np.empty(n, dtype=np.uint8)
                self.comm.Recv([buf, MPI.BYTE], source=src, tag=tag)
                buffers.append(buf)
        finally:
            self.busy_since = None
        return Message(src, envelope, wire.decode(header, buffers))


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
