"""Worker start-up in turns: roles that share GPUs build one after the other, never at once.

vLLM sizes its KV cache from what it measures while it starts: free memory, then everything in use on the
device, other processes' included, counts against its budget. A Megatron rank allocating on the same GPU at
that moment shrinks the cache or fails the start ("No available memory for the cache blocks"; memory freed
meanwhile gives "Error in memory profiling"). So the roles of each set of shared GPUs get turns: those whose
workers measure free memory at start (``measures_free_memory``: vLLM) first, then the others in the config's
order. With offload on, a role that has built gives up its GPU memory (``offload_states``: vLLM sleeps,
Megatron moves its states to the host) before the next turn loads, which is the start-up stage
``rollhpc plan`` sizes (rollhpc.placement.memory_plan). Sets on different GPUs take their turns side by side;
roles that share no GPU (CPU roles, GPU roles alone) build in the first turn. Without GPUs nothing is shared
and everything builds at once.

Each rank's construction times come back with its "ready" reply; RUN_DIR/startup.json records them per turn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollhpc.config import RoleConfig, import_spec
from rollhpc.placement.device_mapping import nested_groups
from rollhpc.rundir import RunPaths, atomic_write_json

if TYPE_CHECKING:
    from rollhpc.controller.runtime import Controller

log = logging.getLogger("rollhpc.startup")

__all__ = ["build_in_turns", "startup_turns"]


def _measures_free_memory(role: RoleConfig, name: str) -> bool:
    spec = import_spec(role.worker, f"roles.{name}.worker")
    return bool(getattr(spec, "measures_free_memory", False))


def startup_turns(roles: dict[str, RoleConfig]) -> list[list[str]]:
    """The roles that build in each turn (``roles``: cfg.roles). Roles share GPUs when their explicit device
    lists meet (the device mapping nests such lists); within such a set, free-memory measurers first, then
    config order, one role a turn."""
    lists = {
        n: r.devices for n, r in roles.items() if r.gpus_per_proc > 0 and r.devices is not None
    }
    sets = [names for names in nested_groups(lists).values() if len(names) > 1]
    ordered = [
        sorted(names, key=lambda n: (not _measures_free_memory(roles[n], n), list(roles).index(n)))
        for names in sets
    ]
    turns: list[list[str]] = [[] for _ in range(max((len(s) for s in ordered), default=1))]
    for names in ordered:
        for k, name in enumerate(names):
            turns[k].append(name)
    shared = {n for names in sets for n in names}
    turns[0] = [n for n in roles if n not in shared or n in turns[0]]
    return turns


def build_in_turns(
    ctl: Controller,
    ranks_of: Callable[[str], list[int]],
    turns: list[list[str]],
    run_dir: Path | str,
    timeout_s: float,
    between: Callable[[list[str]], dict[str, list[str]]] | None = None,
    overlap: Callable[[], None] | None = None,
) -> dict[str, list[str]]:
    """Tell each turn's ranks to build and wait until they are ready, turn after turn; ``between(turn)``
    (offload on): after a turn, its roles give up their GPU memory, returning role -> parts offloaded.
    ``overlap``: the controller's own start-up work, done while the first turn builds. Returns every role's
    parts offloaded at start; writes RUN_DIR/startup.json."""
    record: list[dict[str, Any]] = []
    offloaded: dict[str, list[str]] = {}
    for k, turn in enumerate(turns):
        ranks = [r for role in turn for r in ranks_of(role)]
        t = time.time()
        ctl.build(ranks)
        if k == 0 and overlap is not None:
            overlap()
        ready = ctl.wait(
            [(r, 0) for r in ranks],
            "worker start-up" + (f" (turn {k + 1}: {', '.join(turn)})" if len(turns) > 1 else ""),
            timeout_s,
        )
        entry = {
            "turn": k,
            "roles": turn,
            "sent": t,
            "ready": time.time(),
            "ranks": {str(r): ready[r].get("built") for r in ranks},
        }
        if between is not None and k + 1 < len(turns):
            moved = between(turn)
            offloaded.update(moved)
            entry["offloaded"] = moved
        record.append(entry)
        if len(turns) > 1:
            log.info(
                "start-up turn %d of %d: %s ready in %.1f s",
                k + 1,
                len(turns),
                ", ".join(turn),
                entry["ready"] - t,
            )
    atomic_write_json(RunPaths(run_dir).startup, {"turns": record}, indent=1)
    return offloaded
