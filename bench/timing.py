"""Timing a call as the benchmarks do: a few warm-up calls first (connections, caches, lazy imports), then each
call on the wall clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def time_calls(call: Callable[[], Any], n: int, warmup: int = 0) -> list[float]:
    """Seconds of each of ``n`` calls of ``call``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        call()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        call()
        out.append(time.perf_counter() - t)
    return out
