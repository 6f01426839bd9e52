"""The requests each generator holds, for the rollout scheduler: the least loaded generator in O(log N), and the
generators that need a call, without a pass over all N.

The scheduler runs on rank 0 and handles every sample of every step. Picking a sample's generator by a scan of
all N generators made a batch cost O(samples x N) on rank 0, and looking for generators to call by a pass over
all N made every turn of its loop O(N) (bench/scale_routing.py measured both growing with N).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

__all__ = ["GeneratorLoads"]


class GeneratorLoads:
    """Requests in flight per generator (``loads[g]``), their total, and the least loaded one.

    A heap of (load, generator) entries, one pushed at every change; an entry whose load is no longer its
    generator's is stale and skipped when it comes to the top (and the heap is rebuilt when stale entries
    outnumber live ones). Ties go to the lowest index, as ``min(range(N), key=load)`` gives them."""

    def __init__(self, n: int):
        if n < 1:
            raise ValueError("the scheduler needs at least one generator")
        self._n = [0] * n
        self.total = 0
        self._heap = [(0, g) for g in range(n)]  # sorted, hence a heap
        # generators with requests to send, aborts, or requests held: need a call
        self.wanting: set[int] = set()

    def __len__(self) -> int:
        return len(self._n)

    def __getitem__(self, g: int) -> int:
        return self._n[g]

    def change(self, g: int, by: int) -> None:
        """``by`` requests more (or fewer) at generator ``g``."""
        self._n[g] += by
        self.total += by
        heapq.heappush(self._heap, (self._n[g], g))
        if len(self._heap) > 4 * len(self._n) + 64:
            self._heap = [(load, g) for g, load in enumerate(self._n)]
            heapq.heapify(self._heap)

    def least(self, excluded: Collection[int] = ()) -> int:
        """The least loaded generator outside ``excluded`` (the lowest index among equals)."""
        heap, skipped = self._heap, []
        try:
            while True:
                if not heap:
                    raise ValueError("every generator is excluded: none can take a request")
                load, g = heap[0]
                if load != self._n[g]:
                    heapq.heappop(heap)  # stale
                elif g in excluded:
                    skipped.append(heapq.heappop(heap))
                else:
                    return g
        finally:
            for entry in skipped:
                heapq.heappush(heap, entry)
