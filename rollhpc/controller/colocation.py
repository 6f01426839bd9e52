"""Time-sharing of colocated roles: before each stage of a step, the roles that share devices with the
stage's roles give up what the stage does not use, and the stage's roles get back what it does.

Which roles share devices comes from the device mapping: GPU roles given the same device list. On a run
without GPUs every model role shares the host's memory, so with offload on the same calls run there (each
a no-op move: see rollhpc.workers.offload), which is how CPU tests check the order and the final weights.
Which parts a stage needs comes from the pipeline's ``memory_stages`` (the same table ``rollhpc plan``
sizes memory with): e.g. the generate stage holds the generators' weights and KV cache, the weight sync
the trainer's parameters and the generators' weights, the train stage all of the trainer. Roles on
devices of their own stay resident, and so does a role whose worker has no ``offload_states``.

Offloads go before reloads (memory is freed before it is taken), all the roles' calls of one kind at once.
Each stage's record (what moved, how long it took, the largest GPU memory any rank reported after it)
goes into the step's metrics as ``residency/STAGE/...``, with the order of the stages in ``residency/stages``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rollhpc.controller.dispatch import remote_methods

log = logging.getLogger("rollhpc.colocation")

# what offload_states / reload_states of each kind of role can move (the rest of a stage's parts, such as
# activations, exist only during the stage)
OFFLOADABLE = ("parameters", "gradients", "optimizer", "weights", "kv_cache")


def colocated_sets(cfg: Any) -> list[set[str]]:
    """Roles that share devices: GPU roles with the same device list; without GPU roles, every role (they
    share the host). Roles that cannot offload (no ``offload_states``) are left out, as are sets of one."""
    from rollhpc.config import import_object

    def offloads(name: str) -> bool:
        return "offload_states" in remote_methods(import_object(cfg.roles[name].worker, f"roles.{name}.worker"))

    gpu_roles = {n: r for n, r in cfg.roles.items() if r.gpus_per_proc > 0}
    if not gpu_roles:
        sets = [set(cfg.roles)]
    else:
        by_devices: dict[tuple[int, ...], set[str]] = {}
        for name, role in gpu_roles.items():
            if role.devices is not None:
                by_devices.setdefault(tuple(role.devices), set()).add(name)
        sets = list(by_devices.values())
    sets = [{n for n in s if offloads(n)} for s in sets]
    return [s for s in sets if len(s) > 1]


def moves_for(needed: dict[str, set[str]], loaded: dict[str, set[str]], colocated: list[set[str]],
              whole: set[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(what to offload, what to reload), role -> parts, for a stage that needs ``needed`` when ``loaded`` is
    on the devices. Only the sets the stage's roles belong to make room: roles on other devices keep what they
    hold. A role in ``whole`` (a vLLM engine: weights and KV cache sleep together) keeps all while it needs
    any part."""
    affected = {r for group in colocated if group & needed.keys() for r in group}
    drop = {r: set() if r in whole and needed.get(r) else loaded[r] - needed.get(r, set()) for r in affected}
    take = {r: parts - loaded[r] for r, parts in needed.items()}
    return drop, take


class Residency:
    """Drives offload / reload of colocated roles between the stages of a step (``enter(stage)``)."""

    def __init__(self, groups: dict[str, Any], stages: dict[str, dict[str, tuple[str, ...]]],
                 colocated: list[set[str]]):
        self.groups = groups
        self.stages = stages
        self.colocated = [s & set(groups) for s in colocated]
        self.managed = {r for s in self.colocated for r in s}
        self.whole = {r for r in self.managed if getattr(groups[r].worker_cls, "offloads_whole", False)}
        self.loaded: dict[str, set[str]] = {r: self._own_parts(r) for r in self.managed}  # all resident at start
        self.record: dict[str, Any] = {}
        self.order: list[str] = []  # stages entered since the last step_metrics
        self.current: str | None = None

    def _own_parts(self, role: str) -> set[str]:
        return {p for parts in self.stages.values() for p in parts.get(role, ()) if p in OFFLOADABLE}

    def enter(self, stage: str) -> None:
        """Offload what ``stage`` does not use from the colocated roles, then reload what it does."""
        if not self.managed:
            return
        needed = {r: {p for p in parts if p in OFFLOADABLE} for r, parts in self.stages.get(stage, {}).items()
                  if r in self.managed}
        if not needed or stage == self.current:  # nothing to change
            return
        self.current = stage
        self.order.append(stage)
        drop, take = moves_for(needed, self.loaded, self.colocated, self.whole)
        entry = {"offload_s": 0.0, "reload_s": 0.0, "offloaded_gb": 0.0, "reloaded_gb": 0.0}
        for kind, moves, method in (("offload", drop, "offload_states"), ("reload", take, "reload_states")):
            moves = {r: sorted(p) for r, p in moves.items() if p}
            if not moves:
                continue
            t = time.perf_counter()
            futures = {r: getattr(self.groups[r], method).submit(parts) for r, parts in moves.items()}
            replies = {r: f.result() for r, f in futures.items()}
            entry[f"{kind}_s"] = time.perf_counter() - t
            for r, parts in moves.items():
                if kind == "offload":
                    self.loaded[r] -= set(parts)
                else:
                    self.loaded[r] |= set(parts)
                ranks = replies[r] if isinstance(replies[r], list) else [replies[r]]
                entry[f"{kind}ed_gb"] += sum(x.get("bytes", 0.0) for x in ranks) / 1e9
                for key in ("allocated", "reserved"):
                    entry[f"gpu_{key}_gb"] = max(entry.get(f"gpu_{key}_gb", 0.0),
                                                 max(x.get(key, 0.0) for x in ranks) / 1e9)
            log.debug("stage %s: %s %s", stage, kind, moves)
        self.record[stage] = entry

    def step_metrics(self) -> dict[str, Any]:
        """This step's stages in order and what each moved; clears them for the next step."""
        if not self.order:
            return {}
        out: dict[str, Any] = {"residency/stages": ">".join(self.order)}
        for stage, entry in self.record.items():
            out.update({f"residency/{stage}/{k}": v for k, v in entry.items()})
        self.order, self.record = [], {}
        return out
