"""AutoDeviceMapping: which node and GPUs every rank of every role gets, and in which Slurm component.

Rules (after ROLL's device_mapping):
- a GPU role asks for ``procs * gpus_per_proc`` GPUs; with an explicit ``devices`` list it gets exactly
  those global GPU ids (node * gpus_per_node + local id), otherwise fresh GPUs after the used ones;
- roles with the same device list are colocated (they share GPUs and take turns, offloading between
  stages); a list inside another role's list is a partial overlap (e.g. the trainer on GPUs 0-3 of the
  generators' 0-7: only the generator ranks on 0-3 take turns with it), placed with the larger list;
  lists that overlap otherwise are refused;
- the controller and CPU roles (reward, env, ...) share the first component, GPU placement groups get
  one heterogeneous component each;
- within a component, ranks are ordered node by node (every role's ranks of node 0, then node 1...),
  which is the order Slurm's block distribution gives them, so MPI world rank = plan rank.
Pure computation on plain values: plans for thousands of GPUs render in well under a second.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from rollhpc.config import CONTROLLER_ROLE, ConfigError, ExperimentConfig, RoleConfig
from rollhpc.config.cluster import ClusterConfig
from rollhpc.placement.hostlist import id_ranges
from rollhpc.rundir import atomic_write_text
from rollhpc.weight_sync.routing import Routing, RoutingError, route_weights


@dataclass(frozen=True)
class RankPlacement:
    rank: int  # MPI world rank
    role: str
    group_rank: int  # rank within its role
    component: int  # heterogeneous job component (het group)
    node: int  # node index within the component
    gpus: tuple[int, ...]  # local GPU indices on that node (positions in the node's allocated GPUs)


@dataclass
class Component:
    index: int
    roles: list[str]
    nodes: int
    ntasks: int
    ntasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int


@dataclass
class WorldPlan:
    ranks: list[RankPlacement]
    components: list[Component]
    gpus_total: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def ranks_of(self, role: str) -> list[int]:
        """World ranks of a role, in group-rank order."""
        return [
            p.rank
            for p in sorted((p for p in self.ranks if p.role == role), key=lambda p: p.group_rank)
        ]

    def to_json(self) -> str:
        return json.dumps(
            {
                "ranks": [asdict(r) for r in self.ranks],
                "components": [asdict(c) for c in self.components],
                "gpus_total": self.gpus_total,
                "notes": self.notes,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> "WorldPlan":
        d = json.loads(text)
        ranks = [RankPlacement(**{**r, "gpus": tuple(r["gpus"])}) for r in d["ranks"]]
        return cls(ranks, [Component(**c) for c in d["components"]], d["gpus_total"], d["notes"])

    def save(self, path: Path) -> None:
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: Path) -> "WorldPlan":
        return cls.from_json(Path(path).read_text())


def rank_devices(role: RoleConfig, devices: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """Each rank's GPUs, in group-rank order: consecutive slices of ``gpus_per_proc`` of the role's device list
    (``devices`` when the role has none of its own: the GPUs the mapping gave it)."""
    ids, per = role.devices if role.devices is not None else devices, role.gpus_per_proc
    return [tuple(ids[g * per : (g + 1) * per]) for g in range(role.procs)]


def nested_groups(lists: dict[str, Sequence[int]]) -> dict[tuple[int, ...], list[str]]:
    """Roles grouped under the largest device list that holds theirs (lists that meet are nested: see
    ``_explicit_lists``), keyed by that list."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, ids in lists.items():
        root = max((tuple(theirs) for theirs in lists.values() if set(ids) <= set(theirs)), key=len)
        groups.setdefault(root, []).append(name)
    return groups


def _explicit_lists(cfg: ExperimentConfig, cluster: ClusterConfig) -> dict[str, tuple[int, ...]]:
    """The GPU roles' explicit device lists, checked: their size, no repeats, inside the cluster, and lists
    that share a GPU are equal or one holds the other."""
    capacity = cluster.nodes * cluster.gpus_per_node
    lists: dict[str, tuple[int, ...]] = {}
    for name, role in cfg.roles.items():
        if role.gpus_per_proc < 0:
            raise ConfigError(f"roles.{name}.gpus_per_proc: must be >= 0")
        if role.gpus_per_proc == 0:
            if role.devices:
                raise ConfigError(
                    f"roles.{name}.devices: a CPU role (gpus_per_proc: 0) cannot have GPUs"
                )
            continue
        if cluster.gpus_per_node == 0:
            raise ConfigError(
                f"roles.{name}: asks for {role.gpus_per_proc} GPU(s) per rank but cluster.gpus_per_node is 0"
            )
        if role.gpus_per_proc > cluster.gpus_per_node:
            raise ConfigError(
                f"roles.{name}.gpus_per_proc: {role.gpus_per_proc} GPUs per rank do not fit on a node "
                f"of {cluster.gpus_per_node}"
            )
        if role.devices is None:
            continue
        ids = tuple(role.devices)
        need = role.procs * role.gpus_per_proc
        if len(ids) != need:
            raise ConfigError(
                f"roles.{name}.devices: {len(ids)} GPUs listed but procs x gpus_per_proc = "
                f"{role.procs} x {role.gpus_per_proc} = {need}"
            )
        if len(set(ids)) != len(ids):
            raise ConfigError(f"roles.{name}.devices: GPU ids repeat")
        bad = [i for i in ids if not 0 <= i < capacity]
        if bad:
            raise ConfigError(
                f"roles.{name}.devices: GPU ids {bad[:5]} outside the cluster's {capacity} GPUs "
                f"({cluster.nodes} nodes x {cluster.gpus_per_node})"
            )
        for other, theirs in lists.items():
            mine, their_set = set(ids), set(theirs)
            if mine & their_set and not (mine <= their_set or their_set <= mine):
                raise ConfigError(
                    f"roles.{name}.devices: shares GPU {min(mine & their_set)} with role {other!r} but "
                    "neither list holds the other: colocated roles use the same list, or one role's "
                    "list inside the other's (a partial overlap)"
                )
        lists[name] = ids
    return lists


def _gpu_groups(cfg: ExperimentConfig, cluster: ClusterConfig) -> list[tuple[list[str], list[int]]]:
    """Placement groups of GPU roles: (roles, global GPU ids), explicit lists first (a list inside another
    joins the larger one's group), then fresh GPUs."""
    capacity = cluster.nodes * cluster.gpus_per_node
    lists = _explicit_lists(cfg, cluster)
    explicit = {i for ids in lists.values() for i in ids}
    used = set(explicit)
    out = [(roles, list(ids)) for ids, roles in nested_groups(lists).items()]
    cursor = 0
    for name, role in cfg.roles.items():
        if role.gpus_per_proc == 0 or role.devices is not None:
            continue
        need = role.procs * role.gpus_per_proc
        ids: list[int] = []
        while len(ids) < need and cursor < capacity:
            if cursor not in used:
                # a rank's GPUs must sit on one node: skip to the next node if this one cannot hold them
                room = cluster.gpus_per_node - cursor % cluster.gpus_per_node
                if len(ids) % role.gpus_per_proc == 0 and room < role.gpus_per_proc:
                    cursor += room
                    continue
                ids.append(cursor)
            cursor += 1
        if len(ids) < need:
            total = len(explicit) + sum(
                r.procs * r.gpus_per_proc for r in cfg.roles.values() if r.devices is None
            )
            raise ConfigError(
                f"roles.{name}: needs {need} GPUs but the cluster has no {need} free GPUs left "
                f"({capacity} in all: {cluster.nodes} nodes x {cluster.gpus_per_node}; the roles ask "
                f"for {total}, colocated ones counted once)"
            )
        used.update(ids)
        out.append(([name], ids))
    return out


def overlap_notes(cfg: ExperimentConfig, roles: list[str], ids: list[int]) -> list[str]:
    """What ``rollhpc plan`` says of a placement group: which roles share its GPUs and, for roles whose list
    is inside the group's (a partial overlap), which ranks of the others share their GPUs and which hold theirs
    alone (with offload on and async generation, generators there keep generating during training)."""
    if len(roles) < 2:
        return []
    notes = [f"colocated on GPUs {id_ranges(ids)}: {', '.join(roles)}"]
    inner: dict[frozenset[int], list[str]] = {}  # a nested device set -> the roles on it
    for name in roles:
        devices = cfg.roles[name].devices
        if devices is not None and set(devices) != set(ids):
            inner.setdefault(frozenset(devices), []).append(name)
    for devices, names in inner.items():
        sharing = []
        for other in roles:
            if not devices < set(cfg.roles[other].devices or ids):
                continue
            per_rank = rank_devices(cfg.roles[other], ids)
            shared = [g for g, mine in enumerate(per_rank) if devices.intersection(mine)]
            alone = [g for g in range(len(per_rank)) if g not in shared]
            sharing.append(
                f"{other} ranks {id_ranges(shared)} take turns with "
                f"{'it' if len(names) == 1 else 'them'}, ranks {id_ranges(alone) if alone else 'none'} "
                "hold their GPUs alone"
            )
        notes.append(
            f"partial overlap: {', '.join(names)} on GPUs {id_ranges(sorted(devices))} only; "
            + "; ".join(sharing)
            + " (with offload on and async generation, those alone keep generating "
            "during training)"
        )
    return notes


def plan_world(cfg: ExperimentConfig, cluster: ClusterConfig | None = None) -> WorldPlan:
    """Place every rank. Raises ConfigError naming the role and the numbers when it cannot."""
    cluster = cluster or cfg.cluster
    if cluster.nodes < 1:
        raise ConfigError("cluster.nodes: must be >= 1")
    ranks: list[RankPlacement] = []
    cpu_component, cpus_per_node = _place_cpu_component(cfg, cluster, ranks)
    components = [cpu_component]
    notes: list[str] = []
    gpu_total = 0
    for roles, ids in _gpu_groups(cfg, cluster):
        components.append(_place_gpu_group(cfg, cluster, roles, ids, len(components), ranks))
        notes += overlap_notes(cfg, roles, ids)
        gpu_total += len(ids)
    _check_cpu_nodes(cluster, cpu_component, cpus_per_node)
    plan = WorldPlan(ranks, components, gpu_total, notes)
    # a layout whose weight sync would fail at the first sync fails here
    weight_sync_routing(cfg, plan)
    return plan


def _cpu_node_cpus(cluster: ClusterConfig) -> int:
    return cluster.cpu_component.cpus_per_node or cluster.cpus_per_node


def _place_cpu_component(
    cfg: ExperimentConfig, cluster: ClusterConfig, ranks: list[RankPlacement]
) -> tuple[Component, int]:
    """Component 0: the controller and every CPU role, its ranks appended to ``ranks``; and how many of its
    ranks share a node."""
    cpu_roles = [n for n, r in cfg.roles.items() if r.gpus_per_proc == 0]
    members = [(CONTROLLER_ROLE, 0, 1)] + [
        (n, g, cfg.roles[n].cpus_per_proc) for n in cpu_roles for g in range(cfg.roles[n].procs)
    ]
    cpus_per_task = max(c for _, _, c in members)
    cpu_node_cpus = _cpu_node_cpus(cluster)
    wide = [n for n in cpu_roles if cfg.roles[n].cpus_per_proc > cpu_node_cpus]
    if wide:
        key = (
            "cluster.cpu_component.cpus_per_node"
            if cluster.cpu_component.cpus_per_node
            else "cluster.cpus_per_node"
        )
        raise ConfigError(
            f"roles.{wide[0]}.cpus_per_proc: {cfg.roles[wide[0]].cpus_per_proc} CPUs per rank do not "
            f"fit on a node of the controller's het group ({key} = {cpu_node_cpus})"
        )
    per_node = max(1, cpu_node_cpus // cpus_per_task)
    for i, (role, g, _) in enumerate(members):
        ranks.append(RankPlacement(len(ranks), role, g, 0, i // per_node, ()))
    component = Component(
        0,
        [CONTROLLER_ROLE, *cpu_roles],
        math.ceil(len(members) / per_node),
        len(members),
        min(per_node, len(members)),
        0,
        cpus_per_task,
    )
    return component, per_node


def _check_cpu_nodes(cluster: ClusterConfig, component: Component, per_node: int) -> None:
    """Component 0 fits the nodes its het group may have."""
    cpu_nodes = cluster.cpu_component.nodes or cluster.nodes
    if component.nodes > cpu_nodes:
        key = "cluster.cpu_component.nodes" if cluster.cpu_component.nodes else "cluster.nodes"
        raise ConfigError(
            f"the controller and CPU roles need {component.nodes} nodes ({component.ntasks} ranks, "
            f"{per_node} per node of {_cpu_node_cpus(cluster)} CPUs) but {key} is {cpu_nodes}"
        )


def _node_positions(
    ids: list[int], gpus_per_node: int
) -> tuple[int, dict[int, tuple[int, int]], int]:
    """A placement group's GPUs on its nodes: how many nodes, each global id's (node index in the component,
    position among the node's used GPUs), and the most GPUs used on one node."""
    node_ids = sorted({i // gpus_per_node for i in ids})
    local_of = {}
    per_node_gpus = 0
    for k, node in enumerate(node_ids):
        on_node = sorted(i for i in ids if i // gpus_per_node == node)
        per_node_gpus = max(per_node_gpus, len(on_node))
        for pos, i in enumerate(on_node):
            local_of[i] = (k, pos)
    return len(node_ids), local_of, per_node_gpus


def _place_gpu_group(
    cfg: ExperimentConfig,
    cluster: ClusterConfig,
    roles: list[str],
    ids: list[int],
    comp: int,
    ranks: list[RankPlacement],
) -> Component:
    """Component ``comp``: one placement group's roles on GPUs ``ids``, their ranks appended to ``ranks`` node
    by node."""
    n_nodes, local_of, per_node_gpus = _node_positions(ids, cluster.gpus_per_node)
    tasks_on: list[list[RankPlacement]] = [[] for _ in range(n_nodes)]
    for name in roles:
        for g, mine in enumerate(rank_devices(cfg.roles[name], ids)):
            nodes = {local_of[i][0] for i in mine}
            if len(nodes) > 1:
                raise ConfigError(
                    f"roles.{name}: rank {g} would drive GPUs {list(mine)} on {len(nodes)} nodes; "
                    f"a rank's GPUs must be on one node"
                )
            k = nodes.pop()
            tasks_on[k].append(
                RankPlacement(-1, name, g, comp, k, tuple(local_of[i][1] for i in mine))
            )
    for node_tasks in tasks_on:
        for p in node_tasks:
            ranks.append(
                RankPlacement(len(ranks), p.role, p.group_rank, p.component, p.node, p.gpus)
            )
    ntasks = sum(len(t) for t in tasks_on)
    per_node_tasks = max(len(t) for t in tasks_on)
    if any(len(t) != per_node_tasks for t in tasks_on[:-1]):
        raise ConfigError(
            f"roles {roles}: uneven ranks per node {[len(t) for t in tasks_on]}; only the last "
            f"node of a placement group may hold fewer"
        )
    cpt = max(cfg.roles[n].cpus_per_proc for n in roles)
    if per_node_tasks * cpt > cluster.cpus_per_node:
        raise ConfigError(
            f"roles {roles}: {per_node_tasks} ranks x {cpt} CPUs on a node exceed "
            f"cluster.cpus_per_node = {cluster.cpus_per_node}"
        )
    return Component(comp, roles, n_nodes, ntasks, per_node_tasks, per_node_gpus, cpt)


def weight_sync_routing(cfg: ExperimentConfig, plan: WorldPlan) -> Routing | None:
    """The weight sync's routing for a pipeline with a ``weight_sync`` option (a ``weight_sync.routing.Routing``),
    or None (no such option, or ``relay``, which forms no group). Raises ConfigError for a layout no sync serves."""
    options = cfg.pipeline.options
    mode = (
        options.get("weight_sync", "auto")
        if isinstance(options, dict)
        else getattr(options, "weight_sync", None)
    )
    if mode is None or mode == "relay" or "train" not in cfg.roles or "generate" not in cfg.roles:
        return None
    try:
        return route_weights(plan, mode)
    except RoutingError as e:
        raise ConfigError(f"pipeline.options.weight_sync={mode}: {e}") from None
