"""A role with no model, for checking a world: echo payloads, sleep, fail, crash, hang.

Used by ``rollhpc train selfcheck``, by the transport tests (every dispatch mode, every failure
kind, on real MPI processes) and by bench/dispatch.py (round-trip cost of the transport itself).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from rollhpc.batch import Batch
from rollhpc.protocol.worker import Collect, Dispatch, Worker, register


class DiagnosticWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def echo(self, value: object) -> object:
        return value

    @register(Dispatch.ONE_TO_ALL, Collect.DP_LEADERS)
    def echo_from_leaders(self, value: object) -> list[object]:
        return [(self.ctx.coords.dp_rank, value)]

    @register(Dispatch.RANK_ZERO)
    def whoami(self) -> int:
        return self.ctx.group_rank

    @register(Dispatch.DP_SPLIT)
    def tag_rows(self, batch: Batch) -> Batch:
        """Returns the rows it got with the dp rank that handled them."""
        n = len(batch)
        return Batch(
            {**batch.data, "dp_rank": np.full(n, self.ctx.coords.dp_rank, dtype=np.int64)},
            batch.meta,
        )

    @register(Dispatch.DP_SPLIT)
    def count_items(self, items: list, scale: int = 1) -> list[tuple[int, int]]:
        return [(self.ctx.coords.dp_rank, len(items) * scale)]

    @register(Dispatch.ONE_TO_ALL)
    def nbytes(self, array: np.ndarray) -> int:
        """A one-to-all payload's delivery alone: a small reply, no work on the data."""
        return int(np.asarray(array).nbytes)

    @register(Dispatch.ONE_TO_ALL)
    def checksum(self, array: np.ndarray) -> int:
        return int(np.asarray(array).view(np.uint8).sum(dtype=np.uint64))

    @register(Dispatch.ONE_TO_ALL)
    def role_allreduce(self, value: int) -> int:
        from mpi4py import MPI

        return self.ctx.role_comm.allreduce(value, op=MPI.SUM)

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    @register(Dispatch.ONE_TO_ALL)
    def sleep_on(self, group_rank: int, seconds: float) -> int:
        """Only ``group_rank`` sleeps; the others answer at once (a slow relay of a reply tree)."""
        if self.ctx.group_rank == group_rank:
            time.sleep(seconds)
        return self.ctx.world_rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, group_rank: int, message: str, others_sleep_s: float = 0.0) -> None:
        if self.ctx.group_rank == group_rank:
            raise RuntimeError(message)
        time.sleep(others_sleep_s)

    @register(Dispatch.ONE_TO_ALL)
    def crash_on(self, group_rank: int, after_s: float = 0.0) -> None:
        """SIGKILL this process mid-call: the failure nothing inside the process can report."""
        time.sleep(after_s)
        if self.ctx.group_rank == group_rank:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)

    @register(Dispatch.ONE_TO_ALL)
    def hang_on(self, group_rank: int) -> None:
        while self.ctx.group_rank == group_rank:
            time.sleep(0.1)
