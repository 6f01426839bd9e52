"""Round-trip cost of calling a worker group: rollhpc over MPI vs a Ray actor group, side by side.

For N = 1..8 workers, the controller (driver) calls every worker and gathers the replies:
  small: a ~100-byte payload echoed back        -> latency per round trip (us), calls/s
  one-to-all: a 64 MiB numpy array to every worker, each replies with its size
                                                 -> seconds per call, GB/s delivered (N x 64 MiB)
  large: a 64 MiB numpy array echoed back        -> seconds per round trip, GB/s moved (2 x N x 64 MiB)
rollhpc sends a one-to-all payload of 1 MiB or more to a group on other machines as MPI broadcasts over a
communicator of the controller and the group, and to a group on its own machine as one shared-memory file
that every worker maps copy-on-write (controller.one_to_all: auto; rollhpc.transport.mpi_channel); Ray puts
it in its object store once and every actor maps it (its best practice for one-to-all). The systems rollhpc-net-p2p and
rollhpc-net-broadcast run rollhpc with MPI's shared memory turned off (MPIR_CVAR_NOLOCAL=1, OFI over tcp),
so its messages take the network path as between machines, with one_to_all p2p and broadcast.
Each configuration is measured in several independent runs (new world / new actors each time) and
the median over runs of the per-run median is reported. Results: bench/results/dispatch.json.

    python bench/dispatch.py [--workers 1,2,4,8] [--runs 3] [--small-calls 300] [--large-calls 5]

Ray is a benchmark-only dependency (requirements/bench.txt, `make bench` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.timing import time_calls  # noqa: E402
from rollhpc.protocol.pipeline import Pipeline  # noqa: E402

LARGE_BYTES = 64 << 20
SMALL = {"step": 1, "tokens": list(range(16)), "note": "ping"}


class DispatchBench(Pipeline):
    """Runs inside a rollhpc world (rank 0): times echo calls on the 'probe' group."""

    @dataclass(kw_only=True)
    class Options:
        small_calls: int = 300
        large_calls: int = 5

    def run(self) -> None:
        g = self.workers["probe"]
        big = np.random.default_rng(0).integers(0, 255, LARGE_BYTES, dtype=np.uint8)
        small = time_calls(lambda: g.echo(SMALL), self.options.small_calls, warmup=3)

        def large_call():
            back = g.echo(big)
            assert all(b.nbytes == LARGE_BYTES for b in back)

        def one_to_all_call():
            assert g.nbytes(big) == [LARGE_BYTES] * len(g)

        one_to_all = time_calls(one_to_all_call, self.options.large_calls, warmup=1)
        large = time_calls(large_call, self.options.large_calls, warmup=1)
        (self.run_ctx.run_dir / "bench.json").write_text(
            json.dumps({"small_s": small, "one_to_all_s": one_to_all, "large_s": large})
        )


NETWORK_PATH = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def run_rollhpc(
    n: int, small_calls: int, large_calls: int, workdir: Path, system: str = "rollhpc"
) -> dict:
    import yaml

    cfg = {
        "run": {"name": f"dispatch-n{n}", "output_dir": str(workdir)},
        "pipeline": {
            "entry": "dispatch:DispatchBench",
            "options": {"small_calls": small_calls, "large_calls": large_calls},
        },
        "roles": {"probe": {"worker": "rollhpc.workers.diagnostic:DiagnosticWorker", "procs": n}},
        "controller": {
            "one_to_all": system.removeprefix("rollhpc-net-") if system != "rollhpc" else "auto"
        },
    }
    path = workdir / f"dispatch-n{n}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    if system.startswith("rollhpc-net-"):
        env.update(NETWORK_PATH)
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path), "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        raise RuntimeError(f"rollhpc world with {n} workers failed:\n{res.stderr[-3000:]}")
    return json.loads((workdir / f"dispatch-n{n}" / "bench.json").read_text())


def run_ray(n: int, small_calls: int, large_calls: int) -> dict:
    import ray

    @ray.remote(num_cpus=0)
    class Echo:
        def echo(self, value):
            return value

        def nbytes(self, value):
            return int(value.nbytes)

    actors = [Echo.remote() for _ in range(n)]
    ray.get([a.echo.remote(None) for a in actors])
    small = time_calls(
        lambda: ray.get([a.echo.remote(SMALL) for a in actors]), small_calls, warmup=3
    )
    big = np.random.default_rng(0).integers(0, 255, LARGE_BYTES, dtype=np.uint8)

    def large_call():
        ref = ray.put(big)  # Ray's best practice for one-to-all: one copy into the object store
        back = ray.get([a.echo.remote(ref) for a in actors])
        assert all(b.nbytes == LARGE_BYTES for b in back)
        del back, ref

    def one_to_all_call():
        ref = ray.put(big)
        assert ray.get([a.nbytes.remote(ref) for a in actors]) == [LARGE_BYTES] * n
        del ref

    one_to_all = time_calls(one_to_all_call, large_calls, warmup=1)
    large = time_calls(large_call, large_calls, warmup=1)
    for a in actors:
        ray.kill(a)
    return {"small_s": small, "one_to_all_s": one_to_all, "large_s": large}


def summarize(runs: list[dict], n: int) -> dict:
    small = statistics.median(statistics.median(r["small_s"]) for r in runs)
    one_to_all = statistics.median(statistics.median(r["one_to_all_s"]) for r in runs)
    large = statistics.median(statistics.median(r["large_s"]) for r in runs)
    return {
        "small_latency_us": round(small * 1e6, 1),
        "small_calls_per_s": round(1 / small, 1),
        "one_to_all_s": round(one_to_all, 4),
        "one_to_all_GBps": round(n * LARGE_BYTES / one_to_all / 1e9, 3),
        "large_roundtrip_s": round(large, 4),
        "large_GBps": round(2 * n * LARGE_BYTES / large / 1e9, 3),
        "runs": len(runs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small-calls", type=int, default=300)
    ap.add_argument("--large-calls", type=int, default=5)
    ap.add_argument("--systems", default="rollhpc,ray,rollhpc-net-p2p,rollhpc-net-broadcast")
    ap.add_argument("--out", default=str(HERE / "results" / "dispatch.json"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.workers.split(",")]
    systems = args.systems.split(",")
    results: dict = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "payload_large_bytes": LARGE_BYTES,
        "small_payload": SMALL,
        "results": {s: {} for s in systems},
    }
    if "ray" in systems:
        import ray

        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            logging_level="ERROR",
            object_store_memory=4 << 30,
        )
        results["machine"]["ray"] = ray.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            for system in systems:
                runs = []
                for _ in range(args.runs):
                    if system.startswith("rollhpc"):
                        runs.append(
                            run_rollhpc(n, args.small_calls, args.large_calls, Path(tmp), system)
                        )
                    else:
                        runs.append(run_ray(n, args.small_calls, args.large_calls))
                results["results"][system][str(n)] = summarize(runs, n)
                r = results["results"][system][str(n)]
                print(
                    f"N={n} {system:>8}: small {r['small_latency_us']:>9.1f} us ({r['small_calls_per_s']:>8.1f}/s)  "
                    f"64MiB one-to-all {r['one_to_all_s']:.3f} s  "
                    f"64MiB echo {r['large_roundtrip_s']:.3f} s ({r['large_GBps']:.2f} GB/s)",
                    flush=True,
                )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(results, indent=1))
    tmp_out.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
