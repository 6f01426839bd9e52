"""How the single controller's costs grow with the world: model-free worlds of N ranks on this machine, each
quantity fitted and extrapolated to the 8,769 ranks of `moe_4096_selfcheck` (issue 36).

    python bench/scale.py [--ranks 8,32,128,256] [--runs 2] [--reply-tree-min-ranks 128]
                          [--out bench/results/scale.json]
    SCALE_PROFILE=1 python bench/scale.py --ranks 128 --runs 1 --out /tmp/x.json   (rank 0's small calls profiled)

Each world is `rollhpc train` of a config written here: the controller and N DiagnosticWorker ranks (mpi4py,
numpy and rollhpc's worker loop; no torch model), local mpiexec (MPICH, oversubscribed: N ranks on this
machine's cores). Measured per N, the median over --runs fresh worlds:
- world formation: launch (the `rollhpc train` process starting) to the pipeline's first line on rank 0,
  every rank started, MPI initialised, its worker built and registered with the controller;
- round trip of a small call (a ~100-byte payload echoed) to all N and back, and of a 64 MiB one-to-all
  (each rank replies with the size it received), and a gather of N replies of 64 KiB each; for the small call
  and the gather also the controller's own CPU seconds per call (its sends, probes, receives and bookkeeping:
  what rank 0 pays per rank wherever the ranks run, unlike the wall time, which here is N processes taking
  turns on 2 cores), and how many reply messages rank 0 took per small call (N, or the reply tree's top relays:
  --reply-tree-min-ranks and --reply-fan-in, the controller's settings; 0 has every rank reply to rank 0 itself);
- a dead rank: one rank SIGKILLed inside a call, to the `rollhpc train` process's exit (the controller's
  liveness check, its verdict and the world's teardown);
- the run directory's world.json and plan.json: size, and the time to serialise and atomically write them;
  restarts.jsonl's largest line (an attempt's start, naming the 4096-GPU plan's 520 nodes) and its append;
- each rank's resident memory (the probe ranks' VmRSS, median), which bounds N here.
Without a world: `rollhpc plan` and `rollhpc submit --dry-run` of moe_4096_selfcheck (8,769 ranks).
Each quantity is fitted as a + b*N and as a + b*log2(N) (least squares); the fit with the smaller relative
residual is kept and evaluated at 8,769. What the extrapolation assumes is in the JSON beside it: one
machine's shared memory and loopback here, where a real cluster's interconnect has other latencies (a
per-message cost that grows with the ranks the controller talks to is what the fit can show, not the
interconnect's constant). Results: bench/results/scale.json and scale.png (every quantity, points and fit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.provenance import commit, write_figure, write_result  # noqa: E402
from bench.timing import time_calls  # noqa: E402
from rollhpc.protocol.pipeline import Pipeline  # noqa: E402
from rollhpc.rundir import atomic_write_json  # noqa: E402

TARGET_RANKS = 8769  # moe_4096_selfcheck's world
SMALL = {"step": 1, "tokens": list(range(16)), "note": "ping"}
ONE_TO_ALL_BYTES = 64 << 20
GATHER_BYTES = 64 << 10


def median_call(call, n: int, warmup: int = 2) -> float:
    return statistics.median(time_calls(call, n, warmup))


def cpu_per_call(call, n: int) -> float:
    """This process's CPU seconds per call, over ``n`` calls (warm: after median_call's)."""
    t = time.process_time()
    for _ in range(n):
        call()
    return (time.process_time() - t) / n


def _profile(call, n: int, path: Path) -> None:
    """cProfile of ``n`` calls, by own time, into ``path`` (what a fan-out would and would not remove)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(n):
        call()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    path.write_text(text.getvalue())


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class ScaleBench(Pipeline):
    """Rank 0 of a scale world: times calls on the 'probe' group, writes RUN_DIR/bench.json, then kills a rank
    inside a call (the run then fails, as it should: the driver times that)."""

    @dataclass(kw_only=True)
    class Options:
        small_calls: int = 30
        large_calls: int = 3

    def run(self) -> None:
        start = time.time()
        g, o = self.workers["probe"], self.options
        out: dict = {"run_start": start}
        pids = [p["pid"] for p in g.ping()]
        out["rss_bytes_median"] = statistics.median(_rss_bytes(pid) for pid in pids)
        out["small_s"] = median_call(lambda: g.echo(SMALL), o.small_calls)
        ctl = g.controller
        ctl.count_work = True
        taken, sent, took = ctl.messages_taken, ctl.send_cpu_s, ctl.reply_cpu_s
        out["small_cpu_s"] = cpu_per_call(lambda: g.echo(SMALL), o.small_calls)
        out["small_messages"] = (ctl.messages_taken - taken) / o.small_calls
        out["small_send_s"] = (ctl.send_cpu_s - sent) / o.small_calls
        out["small_work_s"] = out["small_send_s"] + (ctl.reply_cpu_s - took) / o.small_calls
        # where rank 0's CPU per small call goes: RUN_DIR/profile.txt
        if os.environ.get("SCALE_PROFILE"):
            _profile(lambda: g.echo(SMALL), o.small_calls, self.run_ctx.run_dir / "profile.txt")
        big = np.random.default_rng(0).integers(0, 255, ONE_TO_ALL_BYTES, dtype=np.uint8)
        out["one_to_all_s"] = median_call(lambda: g.nbytes(big), o.large_calls, warmup=1)
        reply = np.zeros(GATHER_BYTES, dtype=np.uint8)
        # each rank echoes 64 KiB: the controller receives N replies (and sends N small requests)
        out["gather_s"] = median_call(lambda: g.echo(reply), o.small_calls)
        sent, took = ctl.send_cpu_s, ctl.reply_cpu_s
        out["gather_cpu_s"] = cpu_per_call(lambda: g.echo(reply), o.small_calls)
        out["gather_work_s"] = (ctl.send_cpu_s - sent + ctl.reply_cpu_s - took) / o.small_calls
        out["crash_at"] = time.time()
        atomic_write_json(self.run_ctx.run_dir / "bench.json", out)
        g.crash_on(len(g) - 1)  # raises once the controller sees the rank gone


def run_world(
    n: int, work: Path, small_calls: int, large_calls: int, controller: dict | None = None
) -> dict:
    import yaml

    name = f"scale-n{n}"
    cfg = {
        "run": {"name": name, "output_dir": str(work)},
        "pipeline": {
            "entry": "scale:ScaleBench",
            "options": {"small_calls": small_calls, "large_calls": large_calls},
        },
        "roles": {"probe": {"worker": "rollhpc.workers.diagnostic:DiagnosticWorker", "procs": n}},
    }
    if controller:
        cfg["controller"] = controller
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    launched = time.time()
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path), "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    ended = time.time()
    run_dir = work / name
    bench = run_dir / "bench.json"
    if not bench.is_file():
        raise RuntimeError(
            f"world of {n} ranks gave no measurements (exit {res.returncode}):\n{res.stderr[-3000:]}"
        )
    if res.returncode == 0:
        raise RuntimeError(f"world of {n} ranks exited 0 after one of its ranks was killed")
    b = json.loads(bench.read_text())
    if (run_dir / "profile.txt").is_file():
        print((run_dir / "profile.txt").read_text()[:8000])
    row = {
        "formation_s": b["run_start"] - launched,
        "small_s": b["small_s"],
        "small_cpu_s": b["small_cpu_s"],
        "small_messages": b["small_messages"],
        "small_work_s": b["small_work_s"],
        "small_send_s": b["small_send_s"],
        "gather_work_s": b["gather_work_s"],
        "one_to_all_s": b["one_to_all_s"],
        "gather_s": b["gather_s"],
        "gather_cpu_s": b["gather_cpu_s"],
        "dead_rank_to_exit_s": ended - b["crash_at"],
        "rss_bytes_per_rank": b["rss_bytes_median"],
    }
    for key, fname in (("world_json", "world.json"), ("plan_json", "plan.json")):
        f = run_dir / fname
        if f.is_file():
            data = json.loads(f.read_text())
            t = time.perf_counter()
            tmp = f.with_name(f".{fname}.rewrite")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, run_dir / f"{fname}.copy")
            row[f"{key}_bytes"] = f.stat().st_size
            row[f"{key}_write_s"] = time.perf_counter() - t
    return row


def cli_seconds(args: list[str], runs: int = 3) -> float:
    """Median wall seconds of a `rollhpc` command (a login node's work: no world)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "rollhpc.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            cwd=tempfile.gettempdir(),
            timeout=600,
        )
        times.append(time.perf_counter() - t)
        if res.returncode != 0:
            raise RuntimeError(f"rollhpc {' '.join(args)} failed:\n{res.stderr[-2000:]}")
    return statistics.median(times)


def restarts_record(nodes: int = 520, lines: int = 20) -> dict:
    """restarts.jsonl's largest line, an attempt's start (it names every node of the allocation), at the 4096-GPU
    plan's 520 nodes: its bytes and the time to append it as the batch script does (``records.log_event``: one
    line per start, requeue or end; nothing per rank)."""
    import contextlib
    import io

    from rollhpc.rundir import RunPaths
    from rollhpc.rundir.records import log_event

    event = {
        "event": "start",
        "job_id": "1234567",
        "restart": 3,
        "slurm_restart_count": 0,
        "nodes": [f"gpu-node-{i:04d}" for i in range(nodes)],
        "batch_host": "gpu-node-0000",
        "previous_attempt": "requeue",
    }
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):
        t = time.perf_counter()
        for _ in range(lines):
            log_event(Path(tmp), event)
        spent = time.perf_counter() - t
        size = RunPaths(Path(tmp)).restarts.stat().st_size
    return {"nodes": nodes, "start_line_bytes": size / lines, "append_s": spent / lines}


def fit(ns: list[int], ys: list[float]) -> dict:
    """a + b*N or a + b*log2(N), whichever leaves the smaller relative residual; its value at TARGET_RANKS."""
    x = np.asarray(ns, dtype=float)
    y = np.asarray(ys, dtype=float)
    best = None
    for kind, feature in (("linear", x), ("log", np.log2(x))):
        design = np.stack([np.ones_like(feature), feature], axis=1)
        (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
        residual = float(
            np.sqrt(np.mean(((design @ [a, b]) - y) ** 2)) / max(float(np.mean(np.abs(y))), 1e-12)
        )
        at = a + b * (TARGET_RANKS if kind == "linear" else np.log2(TARGET_RANKS))
        if best is None or residual < best["relative_residual"]:
            best = {
                "model": kind,
                "a": float(a),
                "b": float(b),
                "relative_residual": residual,
                "at_target": float(at),
            }
    return best


def plot(results: dict, fits: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(fits)
    cols = 3
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    ns = sorted(int(n) for n in results)
    for ax, key in zip(axes.flat, keys):
        ys = [results[str(n)][key] for n in ns]
        ax.plot(ns, ys, "o", label="measured")
        f = fits[key]
        grid = np.geomspace(min(ns), TARGET_RANKS, 50)
        model = f["a"] + f["b"] * (grid if f["model"] == "linear" else np.log2(grid))
        ax.plot(
            grid, model, "-", label=f"{f['model']} fit -> {f['at_target']:.3g} at {TARGET_RANKS}"
        )
        ax.set_xscale("log")
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("ranks")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    write_figure(path, fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ranks", default="8,32,128", help="world sizes (probe ranks), comma-separated"
    )
    ap.add_argument("--runs", type=int, default=2, help="fresh worlds per size (medians)")
    ap.add_argument("--small-calls", type=int, default=30)
    ap.add_argument("--large-calls", type=int, default=3)
    ap.add_argument(
        "--reply-tree-min-ranks",
        type=int,
        default=None,
        help="controller.reply_tree_min_ranks of the worlds (default: the config's; 0: no reply trees)",
    )
    ap.add_argument(
        "--reply-fan-in",
        type=int,
        default=None,
        help="controller.reply_fan_in (default: the config's)",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "scale.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.ranks.split(",")]
    results: dict = {}
    from rollhpc.config import ControllerConfig

    given = {"reply_tree_min_ranks": args.reply_tree_min_ranks, "reply_fan_in": args.reply_fan_in}
    controller = {k: v for k, v in given.items() if v is not None}
    defaults = ControllerConfig()
    settings = {k: controller.get(k, getattr(defaults, k)) for k in given}
    with tempfile.TemporaryDirectory(prefix="scale_") as tmp:
        for n in sizes:
            runs = []
            for k in range(args.runs):
                work = Path(tmp) / f"n{n}_run{k}"
                work.mkdir()
                runs.append(run_world(n, work, args.small_calls, args.large_calls, controller))
            results[str(n)] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            r = results[str(n)]
            print(
                f"N={n}: formation {r['formation_s']:.1f} s, small {r['small_s'] * 1e3:.2f} ms (rank 0's CPU "
                f"{r['small_cpu_s'] * 1e3:.2f} ms, its work {r['small_work_s'] * 1e3:.2f} ms of which sends "
                f"{r['small_send_s'] * 1e3:.2f}, {r['small_messages']:.0f} messages), 64 MiB one-to-all "
                f"{r['one_to_all_s']:.3f} s, gather {r['gather_s'] * 1e3:.2f} ms (work "
                f"{r['gather_work_s'] * 1e3:.2f}), dead rank -> exit {r['dead_rank_to_exit_s']:.1f} s, "
                f"{r['rss_bytes_per_rank'] / 2**20:.0f} MiB per rank",
                flush=True,
            )
    keys = [
        k
        for k in results[str(sizes[0])]
        if k not in ("rss_bytes_per_rank", "small_messages", "small_send_s")
    ]
    fits = (
        {k: fit(sizes, [results[str(n)][k] for n in sizes]) for k in keys}
        if len(sizes) >= 2
        else {}
    )
    login = {
        "plan_s": cli_seconds(["plan", "moe_4096_selfcheck", "--no-ranks"]),
        "submit_dry_run_s": cli_seconds(["submit", "moe_4096_selfcheck", "--dry-run"]),
        "restarts_jsonl": restarts_record(),
    }
    out = {
        "bench": "scale",
        "commit": commit(),
        "target_ranks": TARGET_RANKS,
        "sizes": sizes,
        "controller": settings,
        "results": results,
        "fits": fits,
        "at_8769_login_node": login,
        "assumptions": "one machine: MPICH shared memory and loopback, every rank on 2 cores (oversubscribed); "
        "the fits carry how a cost grows with the ranks the controller talks to, not a real "
        "interconnect's latency or bandwidth",
        "machine": {
            "cpus": os.cpu_count(),
            "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(args.out, out)
    if fits:
        plot(results, fits, args.out.with_suffix(".png"))
    print(json.dumps({"fits": fits, "login": login}, indent=1))


if __name__ == "__main__":
    main()
