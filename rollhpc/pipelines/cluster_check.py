"""The cluster check: a run of another experiment's real layout that measures the cluster instead of training.

Its options, the loader that wraps the checked experiment and the plan-time hooks are its spec
(rollhpc.pipelines.cluster_check_spec); the table's rows are rollhpc.pipelines.cluster_check_rows. What it
measures, in one table (console and RUN_DIR/cluster_check.json):

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

import dataclasses
import logging
import os
import time
from typing import Any

from rollhpc import config as config_mod
from rollhpc.controller.worker_group import RankProxy
from rollhpc.pipelines.cluster_check_rows import (
    MIB,
    bandwidth_groups,
    bandwidth_rows,
    expected_hosts,
    memory_rows,
    planned_gpu_bytes,
    rank_rows,
    render,
    row,
)
from rollhpc.pipelines.cluster_check_spec import ClusterCheckSpec
from rollhpc.pipelines.training import TrainingPipeline
from rollhpc.placement.device_mapping import WorldPlan
from rollhpc.placement.memory_plan import estimate
from rollhpc.protocol import probes
from rollhpc.protocol.pipeline import Pipeline
from rollhpc.rundir import RunPaths, atomic_write_json, read_jsonl
from rollhpc.transport.rendezvous import rendezvous_host
from rollhpc.weight_sync.broadcast import open_store

log = logging.getLogger("rollhpc.cluster_check")


class CheckFailed(RuntimeError):
    """A failed row: the run ends as an error of its own (a restart would meet the same cluster), and its report
    (RUN_DIR/error.json, the controller's log) carries the table, not a traceback of the check's code."""

    def __init__(self, summary: str, table: str):
        super().__init__(summary)
        self.summary, self.details = summary, table


class ClusterCheck(ClusterCheckSpec, Pipeline):
    """Runs on the checked experiment's workers; ``run`` probes, measures, takes one RL step, writes the table."""

    def run(self) -> None:
        """Probe, measure, take the step, then write and print the table; CheckFailed after that for a failed row."""
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
        self, plan: WorldPlan, probed: dict[int, dict[str, Any]]
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
                return rows + [row(name, "-", "-", "-", False, f"{type(e).__name__}: {why}")], e
        return rows, None

    def _planned_memory(self, plan: WorldPlan) -> dict[tuple[int, int, int], float]:
        """The memory plan's start-up estimate per GPU (``rollhpc plan``'s), from the run's config."""
        config = self.run_ctx.config
        return planned_gpu_bytes(estimate(config, plan)) if config is not None else {}

    def _probe_placements(self, plan: WorldPlan) -> dict[int, dict[str, Any]]:
        """Every rank's placement probe (the controller's own taken here), by world rank."""
        probed = {
            0: {"role": "controller", "rank": 0, "group_rank": 0, **probes.placement(gpus=False)}
        }
        for role, group in self.workers.items():
            has_gpus = any(plan.ranks[r].gpus for r in plan.ranks_of(role))
            for got, world_rank in zip(group.placement_probe(has_gpus), plan.ranks_of(role)):
                probed[world_rank] = got
        return probed

    def _proxy(self, plan: WorldPlan, world_rank: int) -> RankProxy:
        """The worker proxy of one world rank (a measurement calls chosen ranks, not whole roles)."""
        p = plan.ranks[world_rank]
        return self.workers[p.role].at(p.group_rank)

    def _measure(
        self,
        plan: WorldPlan,
        address: tuple[str, int],
        tag: str,
        ranks: list[int],
        op: str,
        sizes: list[int],
    ) -> tuple[list[float], str]:
        """The slowest rank's seconds per op for each size, and the backend used."""
        futures = [
            self._proxy(plan, r).collective_bandwidth.submit(
                probes.CollectiveProbe(address, tag, i, len(ranks), op, sizes, self.options.iters)
            )
            for i, r in enumerate(ranks)
        ]
        results = [f.result() for f in futures]
        return [max(res["seconds"][k] for res in results) for k in range(len(sizes))], results[0][
            "backend"
        ]

    def _bandwidth(
        self, plan: WorldPlan, probed: dict[int, dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """All-reduce within a node and between nodes; the trainer -> generators broadcast."""
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
                row("all_reduce", "-", "-", "-", None, "fewer than two worker ranks to measure")
            )
        rows += self._weight_sync_probe(plan, probed, address)
        return rows

    def _weight_sync_probe(
        self, plan: WorldPlan, probed: dict[int, dict[str, Any]], address: tuple[str, int]
    ) -> list[dict[str, Any]]:
        """A broadcast of ``weight_sync_mib`` from the trainer's rank 0 to every generator rank, over the kind of
        group the broadcast weight sync builds (generators on the trainer's own GPU get CUDA IPC instead)."""
        if "train" not in self.workers or "generate" not in self.workers:
            return [_no_sync_probe("no train and generate roles")]
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
                _no_sync_probe("every generator shares the trainer's GPU (its sync is CUDA IPC)")
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
            return [row("rl step", what, "-", "-", None, why)]
        inner = self._checked_pipeline()
        started = time.perf_counter()
        inner.setup()
        inner.run()
        wall = time.perf_counter() - started
        records = [
            r for r in read_jsonl(RunPaths(self.run_ctx.run_dir).metrics) if r.get("step", 0) >= 1
        ]
        record = records[-1] if records else {}
        rows = [_step_row(what, wall, record)]
        if "weight_sync_s" in record:
            mode = getattr(getattr(inner, "weight_sync", None), "mode", "the pipeline's own")
            rows.append(_sync_row(record, mode))
        return rows

    def _checked_pipeline(self) -> Pipeline:
        """The checked pipeline's runtime on these workers, with its options for one step and the run's config
        naming them (what start-up offloaded too); a training pipeline's held-out evaluation left out."""
        o = self.options
        cls, opts = self.wrapped(o, runtime=True)
        config = self.run_ctx.config
        if config is not None:
            config = dataclasses.replace(
                config, pipeline=config_mod.PipelineConfig(entry=o.pipeline["entry"], options=opts)
            )
        inner = cls(self.workers, dataclasses.replace(self.run_ctx, config=config), opts)
        if isinstance(inner, TrainingPipeline):
            inner.evaluate = lambda: {}  # the held-out evaluation is not what a cluster check times
        return inner


def _no_sync_probe(why: str) -> dict[str, Any]:
    return row("weight sync", "train -> generate", "-", "-", None, why)


def _step_row(what: str, wall: float, record: dict[str, Any]) -> dict[str, Any]:
    """The RL step's row: its step_s from its metrics line (the wall time with its start-up beside it)."""
    step_s = record.get("step_s", wall)
    # a step whose groups all had equal rewards trains nothing and syncs nothing: it ran, but did not check them
    idle = (
        "its groups' rewards were all equal: no update, no weight sync"
        if record.get("skipped")
        else ""
    )
    return row(
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


def _sync_row(record: dict[str, Any], mode: str) -> dict[str, Any]:
    """The step's real weight sync (``mode``: the pipeline's), from its metrics line."""
    mb = record.get("weight_sync_mb")
    rate = (
        f", {mb * MIB / record['weight_sync_s'] / 1e9:.2f} GB/s"
        if mb and record["weight_sync_s"]
        else ""
    )
    return row(
        "weight sync",
        f"the step's real sync ({mode})",
        "-",
        f"{record['weight_sync_s'] * 1e3:.1f} ms" + (f", {mb:.1f} MiB" if mb else "") + rate,
        None,
        seconds=record["weight_sync_s"],
        mib=mb,
    )
