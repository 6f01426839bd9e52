"""``SandboxPool``: many sandboxed programs at once, one thread per running sandbox.

Each worker thread starts one bwrap process and waits on its pipes; the waiting happens outside the
GIL, so threads are enough (no process pool, nothing to pickle). The default size is the number of CPUs
this process may run on (``os.sched_getaffinity``: a Slurm allocation's cores, not the node's), since
the programs themselves are what uses the CPUs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from rollhpc.sandbox.result import SandboxResult
from rollhpc.sandbox.sandbox import Sandbox


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class SandboxPool:
    def __init__(self, sandbox: Sandbox, workers: int | None = None) -> None:
        self.sandbox = sandbox
        self.workers = workers or available_cpus()
        self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox")

    def submit(
        self, source: str, stdin: str = "", timeout: float | None = None
    ) -> Future[SandboxResult]:
        return self._executor.submit(self.sandbox.run, source, stdin, timeout)

    def map(
        self, jobs: Iterable[str | tuple[str, str]], timeout: float | None = None
    ) -> list[SandboxResult]:
        """Results in the order of ``jobs``: each a source, or (source, stdin)."""
        futures = [
            self.submit(*((job, "") if isinstance(job, str) else job), timeout=timeout)
            for job in jobs
        ]
        return [f.result() for f in futures]

    def close(self, cancel_pending: bool = False) -> None:
        """Wait for running programs (each ends by its deadline) and stop the threads."""
        self._executor.shutdown(wait=True, cancel_futures=cancel_pending)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel_pending=exc[0] is not None)
