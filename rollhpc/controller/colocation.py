"""Time-sharing of colocated roles: before each stage of a step, the roles that share devices with the
stage's roles give up what the stage does not use, and the stage's roles get back what it does.

Which roles share devices comes from the device mapping: GPU roles whose device lists meet (the same list,
or one inside the other: a partial overlap), and within them the ranks whose own GPUs another role uses.
Only those ranks move: with the trainer on GPUs 0-3 of the generators' 0-7, generator ranks 0-3 sleep while
it trains and ranks 4-7 stay resident (and, with async generation, keep generating). On a run without GPUs
every model role shares the host's memory, so with offload on the same calls run there on every rank (each
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollhpc.config import RoleConfig, import_spec
from rollhpc.placement.device_mapping import nested_groups, rank_devices
from rollhpc.protocol.dispatch import remote_methods

if TYPE_CHECKING:
    from rollhpc.controller.worker_group import GroupFuture, WorkerGroup

log = logging.getLogger("rollhpc.colocation")

# what offload_states / reload_states of each kind of role can move (the rest of a stage's parts, such as
# activations, exist only during the stage)
OFFLOADABLE = ("parameters", "gradients", "optimizer", "weights", "kv_cache")


@dataclass(frozen=True)
class Colocation:
    """Which roles take turns: ``sets`` of roles that share devices, and per role the group ranks that share
    theirs with another role of its set (``ranks``; a role's other ranks hold their devices alone)."""

    sets: tuple[frozenset[str], ...] = ()
    ranks: dict[str, frozenset[int]] = field(default_factory=dict)

    def alone(self, role: str, procs: int) -> list[int]:
        """The ranks of ``role`` that never give way to another role (all of them when it shares nothing)."""
        return [g for g in range(procs) if g not in self.ranks.get(role, ())]


def colocation_of(roles: dict[str, RoleConfig]) -> Colocation:
    """The run's colocation from its roles (``cfg.roles``): GPU roles whose device lists meet, and the ranks whose
    GPUs meet another role's; without GPU roles, every role and rank (they share the host). Roles that cannot
    offload (no ``offload_states``) are left out, as are sets of one."""
    movable = [n for n in roles if _offloads(roles[n], n)]
    if not any(r.gpus_per_proc > 0 for r in roles.values()):
        if len(movable) < 2:
            return Colocation()
        return Colocation(
            (frozenset(movable),), {n: frozenset(range(roles[n].procs)) for n in movable}
        )
    lists = {
        n: roles[n].devices
        for n in movable
        if roles[n].gpus_per_proc > 0 and roles[n].devices is not None
    }
    ranks = {}
    for name in lists:
        others = {d for other, ids in lists.items() if other != name for d in ids}
        shared = frozenset(
            g for g, mine in enumerate(rank_devices(roles[name])) if others.intersection(mine)
        )
        if shared:
            ranks[name] = shared
    # roles joined by shared devices: the device mapping nests lists that meet, so they group under the largest
    sets = [
        frozenset(names)
        for names in nested_groups({n: lists[n] for n in ranks}).values()
        if len(names) > 1
    ]
    return Colocation(tuple(sets), ranks)


def _offloads(role: RoleConfig, name: str) -> bool:
    """Whether the role's worker can give up its devices' memory (its spec declares ``offload_states``)."""
    return "offload_states" in remote_methods(import_spec(role.worker, f"roles.{name}.worker"))


def moves_for(
    needed: dict[str, set[str]],
    loaded: dict[str, set[str]],
    colocated: list[set[str]],
    whole: set[str],
) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(what to offload, what to reload), role -> parts, for a stage that needs ``needed`` when ``loaded`` is
    on the devices. Only the sets the stage's roles belong to make room: roles on other devices keep what they
    hold. A role in ``whole`` (a vLLM engine: weights and KV cache sleep together) that holds more than the
    stage needs sleeps whole and wakes what it needs when another role of its set needs room in the stage
    (a weight sync after generating: the trainer's parameters come back while the KV cache goes), and keeps
    all otherwise."""
    affected = {r for group in colocated if group & needed.keys() for r in group}
    drop = {}
    for r in affected:
        extra = loaded[r] - needed.get(r, set())
        if r in whole and needed.get(r) and extra:
            contended = any(
                o != r and o in needed for group in colocated if r in group for o in group
            )
            extra = set(loaded[r]) if contended else set()
        drop[r] = extra
    take = {r: parts - (loaded[r] - drop.get(r, set())) for r, parts in needed.items()}
    return drop, take


class Residency:
    """Drives offload / reload of colocated roles between the stages of a step (``enter(stage)``)."""

    def __init__(
        self,
        workers: dict[str, WorkerGroup],
        stages: dict[str, dict[str, tuple[str, ...]]],
        colocation: Colocation,
        offloaded_at_start: dict[str, list[str]] | None = None,
    ):
        offloaded_at_start = offloaded_at_start or {}
        self.workers = workers  # role -> its WorkerGroup
        self.stages = stages
        self.colocated = [set(s) & set(workers) for s in colocation.sets]
        self.managed = {r for s in self.colocated for r in s}
        # the ranks of each role that move (the others hold their devices alone): a group call when it is all
        self.ranks = {r: sorted(colocation.ranks[r]) for r in self.managed}
        self.whole = {
            r for r in self.managed if getattr(workers[r].worker_cls, "offloads_whole", False)
        }
        # all resident at start, but what the start-up turns offloaded (controller.startup)
        self.loaded: dict[str, set[str]] = {
            r: self._own_parts(r) - set(offloaded_at_start.get(r, ())) for r in self.managed
        }
        self.record: dict[str, Any] = {}
        self.order: list[str] = []  # stages entered since the last step_metrics
        self.current: str | None = None

    def _own_parts(self, role: str) -> set[str]:
        return own_parts(self.stages, role)

    def moving_ranks(self, role: str) -> list[int]:
        """The ranks of ``role`` that give way to the other roles of its set (none when it is not managed)."""
        return self.ranks.get(role, [])

    def enter(self, stage: str) -> None:
        """Offload what ``stage`` does not use from the colocated roles, then reload what it does."""
        if not self.managed:
            return
        needed = {
            r: {p for p in parts if p in OFFLOADABLE}
            for r, parts in self.stages.get(stage, {}).items()
            if r in self.managed
        }
        if not needed or stage == self.current:  # nothing to change
            return
        self.current = stage
        self.order.append(stage)
        drop, take = moves_for(needed, self.loaded, self.colocated, self.whole)
        # a stage entered again adds to its numbers
        entry = self.record.setdefault(
            stage, {"offload_s": 0.0, "reload_s": 0.0, "offloaded_gb": 0.0, "reloaded_gb": 0.0}
        )
        for kind, moves, method in (
            ("offload", drop, "offload_states"),
            ("reload", take, "reload_states"),
        ):
            moves = {r: sorted(p) for r, p in moves.items() if p}
            if not moves:
                continue
            t = time.perf_counter()
            futures = {r: self._submit(r, method, parts) for r, parts in moves.items()}
            replies = {
                r: [x for f in fs for x in _as_list(f.result())] for r, fs in futures.items()
            }
            entry[f"{kind}_s"] += time.perf_counter() - t
            for r, parts in moves.items():
                if kind == "offload":
                    self.loaded[r] -= set(parts)
                else:
                    self.loaded[r] |= set(parts)
                entry[f"{kind}ed_gb"] += sum(x.get("bytes", 0.0) for x in replies[r]) / 1e9
                for key in ("allocated", "reserved"):
                    entry[f"gpu_{key}_gb"] = max(
                        entry.get(f"gpu_{key}_gb", 0.0),
                        max(x.get(key, 0.0) for x in replies[r]) / 1e9,
                    )
            log.debug("stage %s: %s %s", stage, kind, moves)

    def _submit(self, role: str, method: str, parts: list[str]) -> list[GroupFuture]:
        return submit_moves(self.workers[role], self.ranks[role], method, parts)

    def step_metrics(self) -> dict[str, Any]:
        """This step's stages in order and what each moved; clears them for the next step."""
        if not self.order:
            return {}
        out: dict[str, Any] = {"residency/stages": ">".join(self.order)}
        for stage, entry in self.record.items():
            out.update({f"residency/{stage}/{k}": v for k, v in entry.items()})
        self.order, self.record = [], {}
        return out


def own_parts(stages: dict[str, dict[str, tuple[str, ...]]], role: str) -> set[str]:
    """The parts ``role`` holds in some stage that offload can move."""
    return {p for parts in stages.values() for p in parts.get(role, ()) if p in OFFLOADABLE}


def submit_moves(
    group: WorkerGroup, ranks: list[int], method: str, parts: list[str]
) -> list[GroupFuture]:
    """``method(parts)`` on a role's moving ``ranks``: one group call when they are all its ranks, else one per rank."""
    if len(ranks) == len(group):
        return [getattr(group, method).submit(parts)]
    return [getattr(group.at(g), method).submit(parts) for g in ranks]


def offload_after_startup(
    workers: dict[str, WorkerGroup],
    stages: dict[str, dict[str, tuple[str, ...]]],
    colocation: Colocation,
    roles: list[str],
) -> dict[str, list[str]]:
    """After a start-up turn (controller.startup, offload on): its roles' ranks that share GPUs give up what
    they hold (vLLM sleeps, Megatron moves its states to the host) before the next turn loads; returns
    role -> parts offloaded, the state a ``Residency`` starts from."""
    moved, pending = {}, []
    # every role's moves under way at once (roles of one turn sit on different GPUs), then waited for
    for role in roles:
        ranks, parts = sorted(colocation.ranks.get(role, ())), sorted(own_parts(stages, role))
        if not ranks or not parts or role not in workers:
            continue
        pending += submit_moves(workers[role], ranks, "offload_states", parts)
        moved[role] = parts
    for f in pending:
        f.result()
    return moved


def _as_list(reply: object) -> list[Any]:
    return reply if isinstance(reply, list) else [reply]
