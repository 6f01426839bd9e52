"""Human-readable rendering of a WorldPlan: components, then one line per rank, then parallel groups."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from rollhpc.config import CONTROLLER_ROLE, ExperimentConfig
from rollhpc.launch.slurm import component_resources
from rollhpc.parallel import (
    DENSE_GROUP_KINDS,
    EXPERT_GROUP_KINDS,
    ParallelLayout,
    pipeline_stage_layers,
)
from rollhpc.placement.device_mapping import WorldPlan, weight_sync_routing
from rollhpc.placement.hostlist import id_ranges
from rollhpc.placement.memory_plan import ModelShape, dtype_bytes


def render(
    cfg: ExperimentConfig,
    plan: WorldPlan,
    ranks: bool = True,
    groups: bool = False,
    max_groups: int = 4,
) -> Iterator[str]:
    c = cfg.cluster
    yield (
        f"experiment {cfg.run.name}: {plan.world_size} MPI ranks, {plan.gpus_total} GPUs; cluster: "
        f"{c.nodes} nodes x {c.gpus_per_node} GPUs x {c.cpus_per_node} CPUs"
        + (f", partition {c.partition}" if c.partition else "")
    )
    yield "heterogeneous job components (one MPMD srun, world ranks in this order):"
    het = len(plan.components) > 1
    for comp in plan.components:
        yield (
            f"  het group {comp.index}: {', '.join(comp.roles)} | {comp.nodes} node(s), {comp.ntasks} tasks "
            f"({comp.ntasks_per_node}/node), {comp.gpus_per_node} GPUs/node, {comp.cpus_per_task} CPUs/task; "
            f"{component_resources(c, comp, het).describe()}"
        )
    for note in plan.notes:
        yield f"  {note}"
    layouts = {name: role.layout() for name, role in cfg.roles.items()}
    if ranks:
        # the role column fits the longest name
        w = max([12, *(len(name) + 1 for name in cfg.roles)])
        yield f"{'rank':>6} {'role':<{w}} {'grank':>5} {'het':>3} {'node':>4} {'gpus':<7} {'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3}"
        for p in plan.ranks:
            if p.role == CONTROLLER_ROLE:
                yield f"{p.rank:>6} {p.role:<{w}} {0:>5} {p.component:>3} {p.node:>4} {'-':<7}"
                continue
            k = layouts[p.role].coords(p.group_rank)
            yield (
                f"{p.rank:>6} {p.role:<{w}} {p.group_rank:>5} {p.component:>3} {p.node:>4} {id_ranges(p.gpus) or '-':<7} "
                f"{k.tp_rank:>3} {k.cp_rank:>3} {k.dp_rank:>4} {k.pp_rank:>3}"
            )
    for name, role in cfg.roles.items():
        if role.parallel.pp > 1:
            yield from _stages(name, role)
    yield from _weight_sync(cfg, plan)
    if groups:
        for name, layout in layouts.items():
            world_of = plan.ranks_of(name)
            p = cfg.roles[name].parallel
            yield (
                f"role {name}: tp={p.tp} cp={p.cp} pp={p.pp} ep={layout.ep} etp={layout.etp} dp={layout.dp} "
                f"expert-dp={layout.edp}"
                + (f" vpp={p.vpp}" if p.vpp else "")
                + " (groups in world ranks)"
            )
            for kind in _group_kinds(layout):
                gs = layout.groups(kind)
                shown = gs if max_groups <= 0 else gs[:max_groups]
                more = f" ... ({len(gs)} groups)" if len(shown) < len(gs) else ""
                yield (
                    f"  {kind:<16} "
                    + " ".join("[" + id_ranges(world_of[r] for r in g) + "]" for g in shown)
                    + more
                )


def _group_kinds(layout: ParallelLayout) -> list[str]:
    """Megatron's dense groups; expert groups only for MoE layouts (ep > 1 or a separate expert TP)."""
    moe = layout.ep > 1 or layout.etp != layout.tp
    return list(DENSE_GROUP_KINDS) + (list(EXPERT_GROUP_KINDS) if moe else [])


def _layers(r: range) -> str:
    return f"layer {r.start}" if len(r) == 1 else f"layers {r.start}-{r.stop - 1}"


def _stages(name: str, role) -> Iterator[str]:  # noqa: ANN001 - a RoleConfig
    """What each pipeline stage of a role holds: its layers (per virtual stage), the embedding on the
    first stage, the final norm and output layer on the last; read from the model's config.json when
    the role's ``options.model_dir`` is on this machine."""
    p = role.parallel
    chunks = p.vpp or 1
    head = f"role {name}: {p.pp} pipeline stages" + (f" x {chunks} virtual stages" if p.vpp else "")
    model_dir = getattr(role.options, "model_dir", None)
    config = Path(model_dir).expanduser() / "config.json" if isinstance(model_dir, str) else None
    if config is None or not config.is_file():
        yield f"{head} (layers per stage: the model's config.json is not on this machine)"
        return
    hf = json.loads(config.read_text())
    try:
        stages = pipeline_stage_layers(int(hf["num_hidden_layers"]), p.pp, p.vpp)
    except ValueError as e:
        yield f"{head}: {e}; the role will refuse to start"
        return
    tied = bool(hf.get("tie_word_embeddings", False))
    yield f"{head}, {hf['num_hidden_layers']} layers of {model_dir}:"
    for s, ranges in enumerate(stages):
        parts = [", ".join(_layers(r) for r in ranges)]
        if s == 0:
            parts.insert(0, "embedding")
        if s == p.pp - 1:
            parts.append(
                "final norm, output layer" + (" (a copy of the tied embedding)" if tied else "")
            )
        yield f"  stage {s}: " + " + ".join(parts)


def _weight_sync(cfg: ExperimentConfig, plan: WorldPlan) -> Iterator[str]:
    """Each generator's source, transport and bytes per sync (the trainer's weights in its dtype, when the
    model's config.json is on this machine)."""
    routing = weight_sync_routing(cfg, plan)
    if routing is None or not routing.routes:
        return
    train = cfg.roles["train"].options
    model_dir = getattr(train, "model_dir", None)
    shape = ModelShape.from_dir(model_dir) if isinstance(model_dir, str) else None
    dtype = getattr(train, "dtype", "float32")
    size = (
        shape.total * dtype_bytes(dtype)
        if shape is not None and dtype in ("float32", "bfloat16", "float16")
        else None
    )
    yield f"weight sync ({routing.requested}: {routing.mode}), per generator rank:"
    yield from routing.describe(size)
