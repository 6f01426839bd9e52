"""metrics.jsonl: one JSON object per step, flushed at once so a crash loses at most the current step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollhpc.rundir import atomic_write_bytes


class MetricsLog:
    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, sort_keys=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the records up to ``last_step`` (a resume from that step's checkpoint), atomically; returns
    how many were dropped. A torn last line (the process died while writing it) is dropped too."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if isinstance(record, dict) and record.get("step", 0) <= last_step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_bytes(path, "".join(f"{line}\n" for line in kept).encode())
    return dropped
