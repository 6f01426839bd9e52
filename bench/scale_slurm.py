"""The single controller's world through Slurm as the job's nodes grow: submission, world formation, a small
call's round trip and the requeue path after a lost node, on the local cluster at up to 32 simulated nodes
(issue 36; bench/scale.py measures the same world started locally, at more ranks).

    python bench/scale_slurm.py [--nodes 4,8,16,32] [--ranks-per-node 4] [--slurm-dir DIR]
                                [--out bench/results/scale_slurm.json]

For each node count M, one `rollhpc submit` of a model-free world: the controller and M x R - 1
DiagnosticWorker ranks, R to a node (the CPU het group at R ranks per node), one MPMD srun over M nodes of a
local cluster of max(M) + 2 (slurm/local-cluster.sh: one slurmd per simulated node, all on this machine). The
run's first attempt measures a small call to every rank (round trip, and the controller's own CPU seconds per
call), then keeps calling until the driver kills the last node of the job (``node-crash``: its slurmd and every
task on it SIGKILLed). The controller finds its ranks gone, the batch script submits the run again without
that node (``rollhpc.launch.resubmit``), and the second attempt's world forms and ends the run. Measured, each
from what the driver sees polling every 50 ms (restarts.jsonl, world.json, the pipeline's own record):

  submit_cli_s         `rollhpc submit` itself (plan, sbatch rendering, sbatch)
  job_started_s        submit to the batch script's start event
  world_formed_s       submit to world.json (every rank started by srun, MPI initialised, registered)
  first_call_s         submit to the pipeline's first line on rank 0 (formation, as bench/scale.py counts it)
  requeue_s            node killed to the batch script's requeue event (the failure noticed, classified,
                       the next job submitted). The next job needs the first one's other nodes: the
                       cluster's other nodes are drained, so each run has a pool of M + 1 nodes, one of them
                       spare, as a run in a reservation of its own would
  old_job_ended_s      node killed to the first job's end in Slurm (absent where it ended after the restart)
  restarted_s          node killed to the next job's start event
  reformed_s           node killed to the next attempt's pipeline's first line (the requeue path's wall time)

Every quantity is fitted as a + b*M over the node counts and evaluated at the 4096-GPU plan's 520 nodes
(`moe_4096_selfcheck`: 8,769 ranks). What the local cluster is not, the JSON says beside the fits: every slurmd,
task and MPI rank here shares this machine's 2 cores and its loopback, and Slurm's scheduler has no other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.provenance import commit, write_figure, write_result  # noqa: E402
from bench.scale import SMALL, cpu_per_call, median_call  # noqa: E402
from rollhpc.protocol.pipeline import Pipeline  # noqa: E402
from rollhpc.rundir import atomic_write_json  # noqa: E402

sys.path.insert(0, str(HERE))
import recovery  # noqa: E402  (its local-cluster driver)

PLAN_NODES = 520  # moe_4096_selfcheck: 512 GPU nodes of 8 GPUs, 8 CPU nodes for the controller and reward ranks


class SlurmScaleBench(Pipeline):
    """Rank 0: attempt 0 times small calls, then calls until a rank is lost (the run then fails and requeues);
    the next attempt records its start and ends the run. Each attempt writes RUN_DIR/bench-<attempt>.json."""

    @dataclass(kw_only=True)
    class Options:
        small_calls: int = 30
        wait_for_crash_s: float = 600.0

    def run(self) -> None:
        from rollhpc.proc.attempt import restart_number

        start = time.time()
        attempt = restart_number()
        g = self.workers["probe"]
        out: dict = {"run_start": start, "attempt": attempt, "ranks": len(g) + 1}
        if attempt == 0:
            out["small_s"] = median_call(lambda: g.echo(SMALL), self.options.small_calls)
            out["small_cpu_s"] = cpu_per_call(lambda: g.echo(SMALL), self.options.small_calls)
        atomic_write_json(self.run_ctx.run_dir / f"bench-{attempt}.json", out)
        if attempt == 0:
            deadline = time.monotonic() + self.options.wait_for_crash_s
            # a lost rank fails this call, and with it the attempt
            while time.monotonic() < deadline:
                g.echo(SMALL)
                time.sleep(0.05)
            raise RuntimeError(f"no rank was lost within {self.options.wait_for_crash_s} s")


def events(run_dir: Path) -> list[dict]:
    from rollhpc.rundir.records import read_events

    try:
        return read_events(run_dir)
    except (FileNotFoundError, ValueError):
        return []


def watch(checks: dict, until: str, timeout: float, every: float = 0.05) -> dict[str, float]:
    """The time each check first held (polled together), up to the one named ``until``."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, check in checks.items():
            if name not in seen and check():
                seen[name] = time.time()
        if until in seen:
            return seen
        time.sleep(every)
    raise RuntimeError(
        f"timed out after {timeout:.0f} s waiting for {until} (seen: {sorted(seen)})"
    )


def set_nodes(cluster, names: list[str], state: str) -> None:
    for name in names:
        cluster.scontrol(
            "update",
            f"NodeName={name}",
            f"State={state}",
            *(["Reason=bench-pool"] if state == "DRAIN" else []),
        )


def one_job(cluster, nodes: int, per_node: int, work: Path) -> dict:
    import yaml

    name = f"scale-m{nodes}"
    run_dir = work / name
    cfg = {
        "run": {"name": name, "output_dir": str(work)},
        "pipeline": {"entry": "scale_slurm:SlurmScaleBench"},
        "roles": {
            "probe": {
                "worker": "rollhpc.workers.diagnostic:DiagnosticWorker",
                "procs": nodes * per_node - 1,
            }
        },
        "cluster": {
            "nodes": nodes,
            "cpus_per_node": 8,
            "gpus_per_node": 4,
            "max_restarts": 1,
            "cpu_component": {"cpus_per_node": per_node},
        },
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    every = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    every = sorted(set(every), key=lambda n: (len(n), n))
    if len(every) < nodes + 1:
        raise RuntimeError(
            f"the cluster has {len(every)} nodes; a job of {nodes} needs {nodes + 1} (one spare)"
        )
    outside = every[nodes + 1 :]  # the pool: the first M + 1 nodes
    set_nodes(cluster, outside, "DRAIN")
    try:
        return _one_job(cluster, nodes, per_node, work, run_dir, path, env)
    finally:
        set_nodes(cluster, outside, "RESUME")


def _one_job(
    cluster, nodes: int, per_node: int, work: Path, run_dir: Path, path: Path, env: dict
) -> dict:
    t0 = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "submit", str(path)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0:
        raise RuntimeError(f"submit of {nodes} nodes failed:\n{res.stderr[-3000:]}")
    row: dict = {"nodes": nodes, "ranks": nodes * per_node, "submit_cli_s": time.time() - t0}
    starts = lambda: [e for e in events(run_dir) if e["event"] == "start"]  # noqa: E731
    first = watch(
        {
            "job_started": lambda: starts(),
            "world_formed": lambda: (run_dir / "world.json").exists(),
            "first_call": lambda: (run_dir / "bench-0.json").exists(),
        },
        "first_call",
        900,
    )
    row.update({f"{k}_s": v - t0 for k, v in first.items()})
    b0 = json.loads((run_dir / "bench-0.json").read_text())
    row.update(small_s=b0["small_s"], small_cpu_s=b0["small_cpu_s"])
    job_id = starts()[0]["job_id"]
    victim = [n for n in starts()[0]["nodes"] if n != starts()[0]["batch_host"]][-1]
    t_crash = time.time()
    cluster.script("node-crash", str(cluster.dir), victim)
    try:
        second = watch(
            {
                "requeue": lambda: [e for e in events(run_dir) if e["event"] == "requeue"],
                "old_job_ended": lambda: cluster.job_state(job_id) in recovery.JOB_ENDED,
                "restarted": lambda: len(starts()) > 1,
                "reformed": lambda: (run_dir / "bench-1.json").exists(),
            },
            "reformed",
            900,
        )
        row.update({f"{k}_s": v - t_crash for k, v in second.items()})
        requeue = next(e for e in events(run_dir) if e["event"] == "requeue")
        row["requeue_reason"] = requeue.get("reason")
        row["excluded"] = requeue.get("exclude")
        row["crashed_node"] = victim
        row["job_state"] = cluster.wait_done(run_dir, timeout=600)
    finally:
        cluster.script("node-start", str(cluster.dir), victim)
        cluster.settle(victim)
    return row


def fit_line(xs: list[int], ys: list[float]) -> dict:
    import numpy as np

    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return {
        "form": "a + b*M",
        "a": float(a),
        "b": float(b),
        "at_plan_nodes": float(a + b * PLAN_NODES),
    }


def plot(rows: list[dict], fits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(fits)
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2))
    xs = [r["nodes"] for r in rows]
    for ax, key in zip(axes, keys):
        ax.plot(xs, [r[key] for r in rows], "o")
        f = fits[key]
        ax.plot(xs, [f["a"] + f["b"] * x for x in xs], "-", label=f"{f['a']:.2f} + {f['b']:.3f}*M")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("nodes")
        ax.set_ylabel("s")
        ax.legend(fontsize=7)
    write_figure(path, fig, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4,8,16,32", help="node counts of the jobs (comma-separated)")
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument(
        "--slurm-dir",
        type=Path,
        help="a running local-cluster.sh directory (default: start one of max(--nodes) + 2 nodes)",
    )
    p.add_argument("--out", type=Path, default=HERE / "results" / "scale_slurm.json")
    args = p.parse_args()
    try:
        sizes = sorted({int(x) for x in args.nodes.split(",")})
    except ValueError:
        p.error(f"--nodes: comma-separated integers, got {args.nodes!r}")
    if sizes[0] < 2 or args.ranks_per_node < 1:
        p.error("--nodes must be >= 2 each (one node is killed) and --ranks-per-node >= 1")

    cluster = recovery.Cluster(args.slurm_dir, nodes=sizes[-1] + 2)
    # rollhpc's own Slurm calls in this process reach the bench's cluster
    os.environ.update(cluster.env)
    root = Path(tempfile.mkdtemp(prefix="rollhpc-bench-scale-slurm-"))
    rows = []
    try:
        for m in sizes:
            work = root / f"m{m}"
            work.mkdir()
            row = one_job(cluster, m, args.ranks_per_node, work)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        cluster.down()
    keys = [
        "submit_cli_s",
        "job_started_s",
        "world_formed_s",
        "first_call_s",
        "requeue_s",
        "old_job_ended_s",
        "restarted_s",
        "reformed_s",
        "small_s",
        "small_cpu_s",
    ]
    keys = [k for k in keys if all(k in r for r in rows)]
    fits = (
        {k: fit_line([r["nodes"] for r in rows], [r[k] for r in rows]) for k in keys}
        if len(rows) > 1
        else {}
    )
    result = {
        "bench": "scale_slurm",
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ranks_per_node": args.ranks_per_node,
        "cluster_nodes": sizes[-1] + 2,
        "plan_nodes": PLAN_NODES,
        "rows": rows,
        "fits": fits,
        "assumptions": "one machine: every slurmd, srun task and MPI rank shares its 2 cores and loopback, "
        "so times that grow with M include the machine's own load (M x R processes "
        "starting on 2 cores); Slurm's scheduler has no other jobs; SlurmdTimeout is 5 s; "
        "a real cluster adds its interconnect's latencies and its scheduler's queue, and "
        "starts each node's ranks on that node's own cores",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }
    write_result(args.out, result)
    if fits:
        plot(
            rows,
            {k: fits[k] for k in keys if k not in ("small_s", "small_cpu_s")},
            args.out.with_suffix(".png"),
        )
    print(f"results: {args.out}")
    return 0 if all(r.get("job_state") == "COMPLETED" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
