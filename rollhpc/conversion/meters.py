"""What a conversion worker reports while it runs: progress (a tqdm bar on a terminal, a line per 10% on a
log) and its resident memory (VmRSS, and the high-water mark VmHWM, which Linux lets a process reset)."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator, Mapping

import torch
from tqdm import tqdm

from rollhpc.checkpoint.safetensors_io import SafetensorsDir


def log(text: str) -> None:
    print(f"rollhpc convert: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ memory


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; 0 elsewhere)."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident set (VmHWM), or ru_maxrss where /proc lacks it."""
    kib = _status_kib("VmHWM")
    if kib:
        return kib * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, writing 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children_peak_rss_bytes() -> int:
    """Largest peak RSS of this process's waited-for children (megatron's forked checkpoint writers)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


def worker_memory(baseline: int) -> dict[str, int]:
    """A worker's memory report: its peak (its own or its file writers') above ``baseline``."""
    own, children = peak_rss_bytes(), children_peak_rss_bytes()
    return {
        "peak_rss_bytes": max(0, max(own, children) - baseline),
        "baseline_rss_bytes": baseline,
        "own_peak_rss_bytes": own,
        "children_peak_rss_bytes": children,
    }


# ------------------------------------------------------------------ progress


class Progress:
    """A tqdm bar on a terminal; on a log (Slurm), a line per 10%."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.desc, self.enabled, self.done, self._shown = total, desc, enabled, 0, 0
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and self.total:
            tenth = self.done * 10 // self.total
            if tenth != self._shown:
                self._shown = tenth
                log(f"{self.desc}: {self.done}/{self.total} ({100 * self.done // self.total}%)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Ticking(Mapping[str, torch.Tensor]):
    """A Mapping over a SafetensorsDir that advances a progress bar at every tensor read."""

    def __init__(self, tensors: SafetensorsDir, bar: Progress):
        self.tensors, self.bar = tensors, bar

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        self.bar.update()
        return t

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)
