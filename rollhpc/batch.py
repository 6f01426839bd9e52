"""Batch: named arrays (numpy or torch) sharing a leading batch dimension, plus unsplit metadata.

The unit that worker groups split across data-parallel ranks and concatenate back. It is a plain
container on purpose: it pickles through the transport with its arrays sent as raw buffers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np


def _concat(values: list[Any]) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(values[0], torch.Tensor):
        return torch.cat(values, dim=0)
    return np.concatenate(values, axis=0)


@dataclass
class Batch:
    data: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = {k: len(v) for k, v in self.data.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields differ in leading size: {sizes}")

    def __len__(self) -> int:
        return len(next(iter(self.data.values()))) if self.data else 0

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def keys(self) -> Iterator[str]:
        return iter(self.data)

    def split(self, n: int) -> list["Batch"]:
        """n contiguous chunks whose sizes differ by at most one (the first ones are larger)."""
        if n < 1:
            raise ValueError("cannot split into fewer than one chunk")
        size, rest = divmod(len(self), n)
        bounds = [0]
        for i in range(n):
            bounds.append(bounds[-1] + size + (1 if i < rest else 0))
        return [Batch({k: v[a:b] for k, v in self.data.items()}, dict(self.meta)) for a, b in zip(bounds, bounds[1:])]

    @staticmethod
    def concat(parts: list["Batch"]) -> "Batch":
        if not parts:
            raise ValueError("nothing to concatenate")
        keys = list(parts[0].data)
        for p in parts[1:]:
            if list(p.data) != keys:
                raise ValueError(f"batches have different fields: {keys} vs {list(p.data)}")
        return Batch({k: _concat([p.data[k] for p in parts]) for k in keys}, dict(parts[0].meta))
