"""The cluster check: a run of another experiment's real layout that measures the cluster instead of training.

``configs/cluster_check.yaml`` names the experiment it checks (``check.experiment``, default quickstart); the
loader (``wrap_experiment``, called by rollhpc.cli.experiment) takes that experiment's roles, cluster, controller
and launch sections as they are, so the check runs on the very het groups, nodes, GPUs and cores the real run
would get, and wraps its pipeline. What it measures, in one table (console and RUN_DIR/cluster_check.json):

- each rank: its host against the planned node of its het group, its GPUs (CUDA_VISIBLE_DEVICES, and what CUDA
  counts) against the planned GPUs, its CPU core set against the planned cpus-per-task, its memory after start-up;
- collective bandwidth within a node and between nodes (all-reduce, NCCL on GPUs, gloo on CPUs; bus bandwidth as
  nccl-tests defines it) against ``expected_*_gbps`` when given;
- trainer -> generators: a broadcast of ``weight_sync_mib`` over the same kind of group the weight sync uses, and
  the real sync of one RL step of the checked experiment (its pipeline's own step, timed), unless its model is
  absent here: then every role becomes a model-free DiagnosticWorker on the same layout and the step is skipped.

A failed row ends the run with an error naming it (``fail_on_mismatch``), after the table is written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollhpc import config as config_mod
from rollhpc.pipelines.training import TrainingPipeline
from rollhpc.placement.binding import planned_host
from rollhpc.protocol import probes
from rollhpc.protocol.pipeline import Pipeline
from rollhpc.rundir import RunPaths, atomic_write_json, read_jsonl

log = logging.getLogger("rollhpc.cluster_check")

MIB = 1 << 20
DIAGNOSTIC_WORKER = "rollhpc.workers.diagnostic:DiagnosticWorker"
# the keys of the check's own file; every other override goes to the checked experiment
OWN_KEYS = ("check", "run")


# ---------------------------------------------------------------- loading: the checked experiment, wrapped


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``check.*`` and ``run.*`` overrides belong to the check's file, the rest (cluster.*, roles.*, pipeline.*)
    to the checked experiment."""
    own, rest = [], []
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        (own if key.split(".", 1)[0] in OWN_KEYS else rest).append(o)
    return own, rest


def wrap_experiment(
    check: dict[str, Any], target: dict[str, Any], time_limit_given: bool = False
) -> dict[str, Any]:
    """The check's config from its own file's ``check`` and ``run`` sections and the checked experiment's
    composed dict: the experiment's roles, cluster, controller and launch as they are, its pipeline wrapped.
    When the experiment's inputs (models, data) are not there, its roles become DiagnosticWorkers on the same
    layout and the RL step is skipped, saying why. The job asks for ``check.time_limit``, not the experiment's
    days, unless the command line gave ``cluster.time_limit`` (``time_limit_given``): a short job starts sooner."""
    own = dict(check.get("check") or {})
    limit = own.pop("time_limit", None)
    name = str(own.get("experiment", ""))
    pipeline = target.get("pipeline") or {}
    if pipeline.get("entry", "").endswith(":ClusterCheck"):
        raise config_mod.ConfigError(
            f"check.experiment: {name!r} is a cluster check itself; name the experiment "
            "whose layout to check"
        )
    out = copy.deepcopy(target)
    out["run"] = {**(target.get("run") or {}), **(check.get("run") or {})}
    if limit and not time_limit_given:
        out["cluster"] = {**(out.get("cluster") or {}), "time_limit": str(limit)}
    missing = _missing_inputs(target)
    if missing:
        own["skip_step"] = "; ".join(missing)
        for role in out.get("roles", {}).values():
            role.update(worker=DIAGNOSTIC_WORKER, options={})
    out["pipeline"] = {
        "entry": f"{__name__}:ClusterCheck",
        "options": {**own, "pipeline": copy.deepcopy(pipeline)},
    }
    return out


def _missing_inputs(target: dict[str, Any]) -> list[str]:
    """What the checked experiment would load and is not here (config.missing_inputs of it)."""
    cfg = config_mod.load(copy.deepcopy(target))
    return config_mod.missing_inputs(cfg)


# ---------------------------------------------------------------- the table's rows (pure)


def _row(
    check: str, what: str, planned: str, measured: str, ok: bool | None, why: str = "", **data: Any
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


def _cpu_text(cpus: list[int]) -> str:
    """Core ids as ranges: 0-3,8."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def expected_hosts(
    plan: Any, env: Mapping[str, str], one_host: str | None
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
    plan: Any, probed: dict[int, dict[str, Any]], expected: dict[tuple[int, int], str] | None
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
            _row(
                f"rank {p.rank}",
                f"{p.role} {p.group_rank} (het {p.component} node {p.node})",
                f"{want_host or '?'}, {len(p.gpus)} GPU, {comp.cpus_per_task} CPU",
                f"{got['host']}, GPUs {got.get('cuda_visible_devices') or '-'}{cuda}, {len(got['cpus'])} CPU "
                f"[{_cpu_text(got['cpus'])}]{unbound}, rss {got.get('rss', 0) / MIB:.0f} MiB",
                not why,
                "; ".join(why),
                rank=p.rank,
                role=p.role,
                probe=got,
            )
        )
    return rows


def planned_gpu_bytes(memory: Any) -> dict[tuple[int, int, int], float]:
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
    plan: Any, probed: dict[int, dict[str, Any]], planned: dict[tuple[int, int, int], float]
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
            _row(
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
            _row(
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
            _row(
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
    plan: Any, probed: dict[int, dict[str, Any]]
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


# ---------------------------------------------------------------- the pipeline


class CheckFailed(RuntimeError):
    """A failed row: the run ends as an error of its own (a restart would meet the same cluster), and its report
    (RUN_DIR/error.json, the controller's log) carries the table, not a traceback of the check's code."""

    def __init__(self, summary: str, table: str):
        super().__init__(summary)
        self.summary, self.details = summary, table


class ClusterCheck(Pipeline):
    """Runs on the checked experiment's workers; ``run`` probes, measures, takes one RL step, writes the table.

    ``memory_stages`` are the training pipelines' (rlvr, agentic), whose GPU configs are the ones worth checking:
    ``rollhpc plan`` reads them from the entry's class, so a colocated config plans as it would for its real run.
    """

    memory_stages = TrainingPipeline.memory_stages

    @dataclass(kw_only=True)
    class Options:
        experiment: str = ""  # the checked experiment (its name or path: the table's title)
        # its pipeline section: entry and options
        pipeline: dict[str, Any] = field(default_factory=dict)
        allreduce_mib: list[float] = field(default_factory=lambda: [1.0, 16.0, 64.0])
        iters: int = 5  # timed collectives per size (after one warm-up)
        expected_intra_node_gbps: float = (
            0.0  # the fabric's bus bandwidth within a node (0: measure only)
        )
        expected_inter_node_gbps: float = 0.0  # ... and between nodes
        expected_weight_sync_gbps: float = 0.0  # trainer -> generators
        bandwidth_floor: float = 0.5  # a measurement below this share of the expected one fails
        weight_sync_mib: float = 256.0  # the trainer -> generators broadcast's size
        rl_step: bool = (
            True  # take one step of the checked pipeline (timed, with its real weight sync)
        )
        skip_step: str = ""  # set by the loader: why the step cannot run here (the model is absent)
        fail_on_mismatch: bool = (
            True  # a failed row ends the run with an error (after the table is written)
        )

        def __post_init__(self) -> None:
            if self.iters < 1 or not self.allreduce_mib or min(self.allreduce_mib) <= 0:
                raise ValueError("iters must be >= 1 and allreduce_mib a list of positive sizes")
            if not 0 < self.bandwidth_floor <= 1:
                raise ValueError(f"bandwidth_floor: a share in (0, 1], not {self.bandwidth_floor}")

        @functools.cached_property
        def checked(self) -> Any:
            """The checked pipeline's own options (validated), or None when its roles are model-free here."""
            return None if self.skip_step else ClusterCheck.wrapped(self)[1]

        # What start-up, ``rollhpc plan`` and the load-time checks read off ``cfg.pipeline.options``
        # (rank.py's start-up turns, placement's memory plan and weight-sync routing): the checked pipeline's
        # values, so that the check starts its GPUs in the same turns and is planned as its real run would be.
        offload = property(lambda self: bool(getattr(self.checked, "offload", False)))
        weight_sync = property(lambda self: getattr(self.checked, "weight_sync", None))
        weight_sync_bucket_mb = property(
            lambda self: getattr(self.checked, "weight_sync_bucket_mb", None)
        )
        rollout = property(lambda self: getattr(self.checked, "rollout", None))
        eval_max_tokens = property(lambda self: getattr(self.checked, "eval_max_tokens", None))

    # ---- the checked pipeline's class hooks, so that its inputs are checked and built as for its real run
    @staticmethod
    def wrapped(options: Any, runtime: bool = False) -> tuple[type, Any]:
        """The checked pipeline's class and its options for one step (``step_options``), validated: its spec for
        the plan-time hooks (no heavy import on a login node), its runtime class for the ``run``."""
        entry = options.pipeline.get("entry", "")
        load = config_mod.import_object if runtime else config_mod.import_spec
        cls = load(entry, "pipeline.options.pipeline.entry")
        raw = step_options(cls, options.pipeline.get("options") or {})
        return cls, config_mod.component_options(cls, raw, "pipeline.options.pipeline.options")

    @classmethod
    def check_roles(cls, options: Any, roles: dict[str, Any]) -> None:
        """The checked pipeline's role checks (none for the model-free stand-ins)."""
        if not options.skip_step:
            inner, opts = cls.wrapped(options)
            inner.check_roles(opts, roles)

    @classmethod
    def prepare(cls, options: Any, seed: int, roles: dict[str, Any] | None = None) -> None:
        """What the checked pipeline builds before the world starts (a warm start, data), as its real run would."""
        if not options.skip_step:
            inner, opts = cls.wrapped(options)
            inner.prepare(opts, seed, roles)

    @classmethod
    def prepared_paths(cls, options: Any) -> list[str]:
        """The checked pipeline's: what ``prepare`` will build, so the load does not call it missing."""
        if options.skip_step:
            return []
        inner, opts = cls.wrapped(options)
        return inner.prepared_paths(opts)

    @classmethod
    def data_paths(cls, options: Any) -> list[tuple[str, str]]:
        """The checked pipeline's data files, checked at load as for its real run."""
        inner, opts = cls.wrapped(options) if not options.skip_step else (None, None)
        fn = getattr(inner, "data_paths", None)
        return list(fn(opts)) if fn is not None else []

    # ---- the run
    def run(self) -> None:
        """Probe, measure, take the step, then write and print the table; CheckFailed after that for a failed row."""
        from rollhpc.placement.device_mapping import WorldPlan

        run_dir = self.run_ctx.run_dir
        plan = WorldPlan.load(RunPaths(run_dir).plan)
        probed = self._probe_placements(plan)
        hosts = sorted({g["host"] for g in probed.values()})
        rows = rank_rows(
            plan, probed, expected_hosts(plan, os.environ, hosts[0] if len(hosts) == 1 else None)
        )
        rows += memory_rows(plan, probed, self._planned_memory(plan))
        measured, error = self._measured_rows(plan, probed)
        rows += measured
        failed = [r for r in rows if r["ok"] is False]
        title = (
            f"cluster check of {self.options.experiment or '?'}: {plan.world_size} ranks on {len(hosts)} "
            f"host(s) ({', '.join(hosts)}); {len(failed)} of {sum(r['ok'] is not None for r in rows)} "
            f"judged rows failed"
        )
        table = render(title, rows)
        atomic_write_json(
            RunPaths(run_dir).cluster_check,
            {"title": title, "passed": not failed, "rows": rows},
            indent=1,
        )
        log.info("\n%s\n(also in %s)", table, RunPaths(run_dir).cluster_check)
        if error is not None:
            raise error  # the run's failure report classifies it (a lost node, a worker's error) as for any run
        if failed and self.options.fail_on_mismatch:
            raise CheckFailed(
                f"cluster check: {len(failed)} row(s) failed: "
                + "; ".join(f"{r['check']} {r['what']}: {r['why']}" for r in failed[:4])
                + (" ..." if len(failed) > 4 else ""),
                table,
            )

    def _measured_rows(
        self, plan: Any, probed: dict[int, dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], Exception | None]:
        """The bandwidth rows, then the RL step's; the first that raises becomes a failed row (and the error the
        run ends with once the table is written), so the placement and memory rows are never lost with it."""
        rows: list[dict[str, Any]] = []
        for name, section in (
            ("bandwidth", lambda: self._bandwidth(plan, probed)),
            ("rl step", self._rl_step),
        ):
            try:
                rows += section()
            except Exception as e:  # noqa: BLE001 - re-raised by run() after the table is written
                text = str(getattr(e, "summary", "") or e)
                why = text.splitlines()[0][:300] if text else ""
                return rows + [_row(name, "-", "-", "-", False, f"{type(e).__name__}: {why}")], e
        return rows, None

    def _planned_memory(self, plan: Any) -> dict[tuple[int, int, int], float]:
        """The memory plan's start-up estimate per GPU (``rollhpc plan``'s), from the run's config."""
        from rollhpc.placement.memory_plan import estimate

        config = self.run_ctx.config
        return planned_gpu_bytes(estimate(config, plan)) if config is not None else {}

    def _probe_placements(self, plan: Any) -> dict[int, dict[str, Any]]:
        """Every rank's placement probe (the controller's own taken here), by world rank."""
        probed = {
            0: {"role": "controller", "rank": 0, "group_rank": 0, **probes.placement(gpus=False)}
        }
        for role, group in self.workers.items():
            has_gpus = any(plan.ranks[r].gpus for r in plan.ranks_of(role))
            for got, world_rank in zip(group.placement_probe(has_gpus), plan.ranks_of(role)):
                probed[world_rank] = got
        return probed

    def _proxy(self, plan: Any, world_rank: int) -> Any:
        """The worker proxy of one world rank (a measurement calls chosen ranks, not whole roles)."""
        p = plan.ranks[world_rank]
        return self.workers[p.role].at(p.group_rank)

    def _measure(
        self,
        plan: Any,
        address: tuple[str, int],
        tag: str,
        ranks: list[int],
        op: str,
        sizes: list[int],
    ) -> tuple[list[float], str]:
        """The slowest rank's seconds per op for each size, and the backend used."""
        futures = [
            self._proxy(plan, r).collective_bandwidth.submit(
                address, tag, i, len(ranks), op, sizes, self.options.iters
            )
            for i, r in enumerate(ranks)
        ]
        results = [f.result() for f in futures]
        return [max(res["seconds"][k] for res in results) for k in range(len(sizes))], results[0][
            "backend"
        ]

    def _bandwidth(self, plan: Any, probed: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
        """All-reduce within a node and between nodes; the trainer -> generators broadcast."""
        from rollhpc.transport.rendezvous import rendezvous_host
        from rollhpc.weight_sync.broadcast import open_store

        o = self.options
        store = open_store(timeout_s=300.0)  # the controller hosts every probe group's rendezvous
        # the fabric's address where one is configured
        address = (
            rendezvous_host(),
            int(store.port),
        )
        sizes = [int(m * MIB) for m in o.allreduce_mib]
        rows = []
        for i, (check, what, ranks) in enumerate(bandwidth_groups(plan, probed)):
            expected = (
                o.expected_intra_node_gbps if "intra" in check else o.expected_inter_node_gbps
            )
            seconds, backend = self._measure(plan, address, f"ar{i}", ranks, "all_reduce", sizes)
            rows += bandwidth_rows(
                check,
                what,
                "all_reduce",
                sizes,
                seconds,
                len(ranks),
                backend,
                expected,
                o.bandwidth_floor,
            )
        if not rows:
            rows.append(
                _row("all_reduce", "-", "-", "-", None, "fewer than two worker ranks to measure")
            )
        rows += self._weight_sync_probe(plan, probed, address)
        return rows

    def _weight_sync_probe(
        self, plan: Any, probed: dict[int, dict[str, Any]], address: tuple[str, int]
    ) -> list[dict[str, Any]]:
        """A broadcast of ``weight_sync_mib`` from the trainer's rank 0 to every generator rank, over the kind of
        group the broadcast weight sync builds (generators on the trainer's own GPU get CUDA IPC instead)."""
        if "train" not in self.workers or "generate" not in self.workers:
            return [
                _row(
                    "weight sync",
                    "train -> generate",
                    "-",
                    "-",
                    None,
                    "no train and generate roles",
                )
            ]
        src = plan.ranks_of("train")[0]
        dst = [
            r
            for r in plan.ranks_of("generate")
            if not (
                probed[src].get("cuda") and probed[r].get("gpu_id") == probed[src].get("gpu_id")
            )
        ]
        if not dst:
            return [
                _row(
                    "weight sync",
                    "train -> generate",
                    "-",
                    "-",
                    None,
                    "every generator shares the trainer's GPU (its sync is CUDA IPC)",
                )
            ]
        size = int(self.options.weight_sync_mib * MIB)
        seconds, backend = self._measure(plan, address, "ws", [src, *dst], "broadcast", [size])
        hosts = sorted({probed[r]["host"] for r in [src, *dst]})
        return bandwidth_rows(
            "weight sync",
            f"broadcast rank {src} -> {len(dst)} generator(s) on {len(hosts)} host(s)",
            "broadcast",
            [size],
            seconds,
            len(dst) + 1,
            backend,
            self.options.expected_weight_sync_gbps,
            self.options.bandwidth_floor,
        )

    def _rl_step(self) -> list[dict[str, Any]]:
        """One step of the checked pipeline on these workers (its run with steps=1, evaluation and checkpoints
        off), timed; the weight sync it did, from its metrics line."""
        o = self.options
        what = str(o.pipeline.get("entry", "?")).rpartition(":")[2]
        if o.skip_step or not o.rl_step:
            why = f"inputs absent: {o.skip_step}" if o.skip_step else "rl_step: false"
            return [_row("rl step", what, "-", "-", None, why)]
        cls, opts = self.wrapped(o, runtime=True)
        config = self.run_ctx.config
        if config is not None:
            config = dataclasses.replace(
                config, pipeline=config_mod.PipelineConfig(entry=o.pipeline["entry"], options=opts)
            )
        # what start-up offloaded too
        inner = cls(self.workers, dataclasses.replace(self.run_ctx, config=config), opts)
        if isinstance(inner, TrainingPipeline):
            inner.evaluate = lambda: {}  # the held-out evaluation is not what a cluster check times
        started = time.perf_counter()
        inner.setup()
        inner.run()
        wall = time.perf_counter() - started
        records = [
            r for r in read_jsonl(RunPaths(self.run_ctx.run_dir).metrics) if r.get("step", 0) >= 1
        ]
        record = records[-1] if records else {}
        step_s = record.get("step_s", wall)
        # a step whose groups all had equal rewards trains nothing and syncs nothing: it ran, but did not check them
        idle = (
            "its groups' rewards were all equal: no update, no weight sync"
            if record.get("skipped")
            else ""
        )
        rows = [
            _row(
                "rl step",
                f"{what} step 1 ({wall:.1f} s with its start)",
                "-",
                f"{step_s:.2f} s",
                None if idle else True,
                idle,
                step_s=step_s,
                wall_s=wall,
                metrics=record,
            )
        ]
        if "weight_sync_s" in record:
            mb = record.get("weight_sync_mb")
            rate = (
                f", {mb * MIB / record['weight_sync_s'] / 1e9:.2f} GB/s"
                if mb and record["weight_sync_s"]
                else ""
            )
            mode = getattr(getattr(inner, "weight_sync", None), "mode", "the pipeline's own")
            rows.append(
                _row(
                    "weight sync",
                    f"the step's real sync ({mode})",
                    "-",
                    f"{record['weight_sync_s'] * 1e3:.1f} ms"
                    + (f", {mb:.1f} MiB" if mb else "")
                    + rate,
                    None,
                    seconds=record["weight_sync_s"],
                    mib=mb,
                )
            )
        return rows


def step_options(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The checked pipeline's options for one step: ``steps`` 1, and what would outlast it off (rollouts,
    checkpoints and resuming from one, the final export), for the options that pipeline has."""
    names = (
        {f.name for f in dataclasses.fields(getattr(cls, "Options"))}
        if hasattr(cls, "Options")
        else set()
    )
    out = copy.deepcopy(options)
    for key, value in (("steps", 1), ("rollout_every", 0), ("export_hf", "none")):
        if key in names:
            out[key] = value
    if "checkpoint" in names:
        out["checkpoint"] = {
            **(out.get("checkpoint") or {}),
            "at_end": False,
            "resume": False,
            "every": 0,
        }
    return out
