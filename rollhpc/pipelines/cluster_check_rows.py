"""The cluster check's table (rollhpc.pipelines.cluster_check), row by row: pure functions of the plan and what
the ranks reported, so that each verdict is tested without a cluster. A row is a dict: ``check``, ``what``,
``planned``, ``measured``, ``ok`` (None: nothing to judge), ``why``, and the raw values the JSON keeps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollhpc.placement.binding import planned_host
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.placement.hostlist import id_ranges
from rollhpc.placement.memory_plan import MemoryPlan

MIB = 1 << 20


def row(
    check: str,
    what: str,
    planned: str,
    measured: str,
    ok: bool | None,
    why: str = "",
    **data: object,
) -> dict[str, Any]:
    """One row of the table; ``ok`` None: nothing to judge. ``data``: the raw values, kept in the JSON only."""
    return {
        "check": check,
        "what": what,
        "planned": planned,
        "measured": measured,
        "ok": ok,
        "why": why,
        **data,
    }


def expected_hosts(
    plan: WorldPlan, env: Mapping[str, str], one_host: str | None
) -> dict[tuple[int, int], str] | None:
    """The host each (het group, node) of the plan should be: the node's place in its het group's Slurm node list
    (placement.binding.planned_host, the check each rank made at start-up). Without those lists, a world all on
    ``one_host`` (``rollhpc train``, inside an allocation too) is a local one: that host for every node; else
    None, and only consistency is checked."""
    out: dict[tuple[int, int], str | None] = {}
    for p in plan.ranks:
        out.setdefault((p.component, p.node), planned_host(p, plan, env))
    if all(out.values()):
        return {k: str(v) for k, v in out.items()}
    return dict.fromkeys(out, one_host) if one_host is not None else None


def rank_rows(
    plan: WorldPlan, probed: dict[int, dict[str, Any]], expected: dict[tuple[int, int], str] | None
) -> list[dict[str, Any]]:
    """One row per rank: host, GPUs and cores against the plan. A row fails for a host other than its node's, a
    GPU count other than planned (visible devices, and CUDA's count where CUDA is), fewer cores than the het
    group's cpus-per-task, or, without Slurm's node lists, ranks of one planned node on several hosts or of several
    planned nodes on one host."""
    hosts_of: dict[tuple[int, int], set[str]] = {}
    nodes_on: dict[str, set[tuple[int, int]]] = {}
    for p in plan.ranks:
        hosts_of.setdefault((p.component, p.node), set()).add(probed[p.rank]["host"])
        nodes_on.setdefault(probed[p.rank]["host"], set()).add((p.component, p.node))
    rows = []
    for p in plan.ranks:
        got = probed[p.rank]
        comp = plan.components[p.component]
        want_host = expected.get((p.component, p.node)) if expected is not None else None
        visible = [d for d in (got.get("cuda_visible_devices") or "").split(",") if d]
        why = []
        if want_host is not None and got["host"] != want_host:
            why.append(f"on {got['host']}, planned {want_host}")
        elif expected is None and len(hosts_of[(p.component, p.node)]) > 1:
            why.append(f"its planned node's ranks are on {sorted(hosts_of[(p.component, p.node)])}")
        elif expected is None and len(nodes_on[got["host"]]) > 1:
            why.append(
                f"{got['host']} holds planned nodes {sorted(nodes_on[got['host']])} (het group, node)"
            )
        if p.gpus and len(visible) != len(p.gpus):
            why.append(
                f"sees {len(visible)} GPUs (CUDA_VISIBLE_DEVICES={got.get('cuda_visible_devices')}), "
                f"planned {len(p.gpus)}"
            )
        elif p.gpus and got.get("cuda") and got.get("device_count") != len(p.gpus):
            why.append(f"CUDA counts {got.get('device_count')} GPUs, planned {len(p.gpus)}")
        if len(got["cpus"]) < comp.cpus_per_task:
            why.append(f"{len(got['cpus'])} CPU cores, planned {comp.cpus_per_task}")
        cuda = f", cuda {got['device_count']}" if got.get("cuda") else ""
        unbound = " (all: unbound)" if len(got["cpus"]) == got.get("host_cpus") else ""
        rows.append(
            row(
                f"rank {p.rank}",
                f"{p.role} {p.group_rank} (het {p.component} node {p.node})",
                f"{want_host or '?'}, {len(p.gpus)} GPU, {comp.cpus_per_task} CPU",
                f"{got['host']}, GPUs {got.get('cuda_visible_devices') or '-'}{cuda}, {len(got['cpus'])} CPU "
                f"[{id_ranges(sorted(got['cpus']))}]{unbound}, rss {got.get('rss', 0) / MIB:.0f} MiB",
                not why,
                "; ".join(why),
                rank=p.rank,
                role=p.role,
                probe=got,
            )
        )
    return rows


def planned_gpu_bytes(memory: MemoryPlan) -> dict[tuple[int, int, int], float]:
    """What the memory plan (placement.memory_plan.estimate) gives each GPU (het group, node, position) at
    start-up: the start-up stage's peak with offload on, everything held at once with it off, which the memory in
    use after start-up should not pass. GPUs whose roles could not be estimated are left out."""
    out: dict[tuple[int, int, int], float] = {}
    for g in memory.groups:
        if g.parts:
            value = g.stages.get("startup", g.resident) if memory.offload else g.resident
            out.update({gid: value for gid in g.gpus})
    return out


def memory_rows(
    plan: WorldPlan, probed: dict[int, dict[str, Any]], planned: dict[tuple[int, int, int], float]
) -> list[dict[str, Any]]:
    """Each GPU's memory in use after start-up, every process on it counted (colocated roles share one), beside
    the plan's start-up estimate for it. No verdict: a GPU above its estimate says the memory plan undercounts."""
    seen: dict[tuple[int, int, int], tuple[str, dict[str, Any]]] = {}
    users: dict[tuple[int, int, int], list[int]] = {}
    for p in plan.ranks:
        got = probed[p.rank]
        ids = (got.get("cuda_visible_devices") or "").split(",")
        for i, m in enumerate((got.get("gpu_memory") or [])[: len(p.gpus)]):
            gid = (p.component, p.node, p.gpus[i])
            seen.setdefault(gid, (f"{got['host']}:{ids[i] if i < len(ids) else i}", m))
            users.setdefault(gid, []).append(p.rank)
    if not seen:
        return [
            row(
                "gpu memory",
                "after start-up",
                "-",
                "no GPU on any rank (each rank's rss is in its row)",
                None,
            )
        ]
    rows = []
    for gid, (name, m) in sorted(seen.items()):
        est = planned.get(gid)
        above = " (above the plan)" if est is not None and m["used"] > est else ""
        rows.append(
            row(
                "gpu memory",
                f"GPU {name} (het {gid[0]} node {gid[1]} GPU {gid[2]}; ranks "
                f"{','.join(map(str, users[gid]))})",
                (f"{est / 2**30:.1f} GiB" if est is not None else "not estimated")
                + f" of {m['total'] / 2**30:.1f} GiB",
                f"{m['used'] / 2**30:.2f} GiB in use{above}",
                None,
                gpu=name,
                used=m["used"],
                total=m["total"],
                planned_bytes=est,
            )
        )
    return rows


def bus_gbps(op: str, nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algorithm, bus) bandwidth in GB/s as nccl-tests defines them: algbw = bytes / time; an all-reduce moves
    2(n-1)/n of it over each rank's link, a broadcast all of it."""
    alg = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return alg, alg * (2 * (ranks - 1) / ranks if op == "all_reduce" else 1.0)


def bandwidth_rows(
    check: str,
    what: str,
    op: str,
    sizes: list[int],
    seconds: list[float],
    ranks: int,
    backend: str,
    expected_gbps: float,
    floor: float,
) -> list[dict[str, Any]]:
    """One row per size; the largest size is judged against ``floor`` x ``expected_gbps`` (none: no verdict)."""
    rows = []
    for i, (size, s) in enumerate(zip(sizes, seconds)):
        alg, bus = bus_gbps(op, size, s, ranks)
        judged = expected_gbps > 0 and i == len(sizes) - 1
        ok = bus >= floor * expected_gbps if judged else None
        why = f"below {floor:g} x the expected {expected_gbps:g} GB/s" if ok is False else ""
        rows.append(
            row(
                check,
                f"{what}, {size / MIB:g} MiB",
                f"{expected_gbps:g} GB/s" if judged else "-",
                f"bus {bus:.2f} GB/s (alg {alg:.2f}, {s * 1e3:.2f} ms, {backend})",
                ok,
                why,
                op=op,
                bytes=size,
                seconds=s,
                ranks=ranks,
                busbw_gbps=bus,
                algbw_gbps=alg,
            )
        )
    return rows


def bandwidth_groups(
    plan: WorldPlan, probed: dict[int, dict[str, Any]]
) -> list[tuple[str, str, list[int]]]:
    """(check, what, world ranks) to measure: the worker ranks of the host that has most of them, and one rank per
    host. On GPUs only ranks with CUDA, one per GPU (NCCL refuses two ranks of one device)."""
    workers = [p.rank for p in plan.ranks if p.rank != 0]
    if any(probed[r].get("cuda") for r in workers):
        by_gpu: dict[str, int] = {}
        for r in workers:
            if probed[r].get("cuda"):
                by_gpu.setdefault(probed[r]["gpu_id"], r)
        workers = sorted(by_gpu.values())
    by_host: dict[str, list[int]] = {}
    for r in workers:
        by_host.setdefault(probed[r]["host"], []).append(r)
    out = []
    host, ranks = max(by_host.items(), key=lambda kv: len(kv[1]), default=("", []))
    if len(ranks) >= 2:
        out.append(
            ("all_reduce intra-node", f"{host}, ranks {','.join(map(str, ranks[:8]))}", ranks[:8])
        )
    if len(by_host) >= 2:
        firsts = [rs[0] for rs in by_host.values()]
        out.append(
            (
                "all_reduce inter-node",
                f"{len(firsts)} hosts, ranks {','.join(map(str, firsts))}",
                firsts,
            )
        )
    return out


def render(title: str, rows: list[dict[str, Any]]) -> str:
    """The one table: check, what, planned, measured, result (ok, FAIL: why, skipped: why, or - for no verdict)."""

    def result(r: dict[str, Any]) -> str:
        if r["ok"] is None:
            return f"skipped: {r['why']}" if r["why"] else "-"
        return "ok" if r["ok"] else f"FAIL: {r['why']}"

    head = ("check", "what", "planned", "measured", "result")
    body = [(r["check"], r["what"], r["planned"], r["measured"], result(r)) for r in rows]
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(4)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  " + head[4]]
    lines.append("-" * len(lines[-1]))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in body
    ]
    return "\n".join(lines)
