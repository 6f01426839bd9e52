"""Slurm's ranges: host lists (``node[01-04,7],gpu-a[1-2]x``) expanded in Python, in Slurm's order, and id
lists written as ranges (``0-3,8``) for plans and reports.

A rank checks its host against the plan's node of its het group: the k-th host of that group's node list
(``SLURM_JOB_NODELIST_HET_GROUP_<c>``), which is how Slurm numbers a job's nodes. Every rank of a large job
doing it through ``scontrol show hostnames`` would fork thousands of processes at once, and that command's
set semantics lose the order; the grammar is small enough to parse here.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["expand_hostlist", "id_ranges"]


def _split_top(expr: str) -> list[str]:
    """Split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(expr):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {expr!r}")
        elif ch == "," and depth == 0:
            parts.append(expr[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {expr!r}")
    parts.append(expr[start:])
    return [p for p in parts if p]


def _range_values(spec: str, expr: str) -> list[str]:
    """``01-03,7`` -> ['01', '02', '03', '7'] (a range keeps its first bound's zero padding)."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list {expr!r}")
        if not hi:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in host list {expr!r}")
        out += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(name: str, expr: str) -> list[str]:
    """One comma-free element, possibly with several bracket groups (``rack[1-2]-n[1-2]``)."""
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.find("]", open_at)
    head, spec, tail = name[:open_at], name[open_at + 1 : close_at], name[close_at + 1 :]
    return [head + v + rest for v in _range_values(spec, expr) for rest in _expand_one(tail, expr)]


def expand_hostlist(expr: str) -> list[str]:
    """Every host of a Slurm host list, in order (repeats kept); ValueError for a malformed one."""
    expr = expr.strip()
    return [h for part in _split_top(expr) for h in _expand_one(part, expr)]


def id_ranges(ids: Iterable[int]) -> str:
    """Ids in their order, each run of consecutive ones written ``first-last``: [0, 1, 2, 3, 8] -> "0-3,8"; ""
    for none."""
    spans: list[list[int]] = []
    for i in ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
