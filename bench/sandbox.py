"""Sandboxed programs per second (rollhpc.sandbox), against plain ``python -c`` start-up of the same interpreter.

A short program (``print(sum(range(100)))``) runs N times in each mode, sequentially and through a pool
of W threads (SandboxPool for the sandbox modes, a ThreadPoolExecutor for plain):
  plain      ``python -I -S -c PROGRAM`` with subprocess.run: the floor (interpreter start-up alone)
  unsafe     Sandbox(unsafe=True): the same interpreter with the launcher (limits, fork, status line), no bwrap
  sandboxed  Sandbox(): bwrap with fresh namespaces, binds, tmpfs, the launcher
Each mode is measured in several rounds (interleaved: every round runs every mode and pool size once) and
the median is reported: programs/s and milliseconds per program (sequential: latency; pooled: wall time
/ N). Every result is checked (stdout "4950"). The machine's load average before and after is recorded:
pooled numbers need otherwise idle cores.

    python bench/sandbox.py [--n 100] [--workers 1,2,4] [--rounds 5]

Results: bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from rollhpc.sandbox import Sandbox, SandboxPool  # noqa: E402
from rollhpc.sandbox.bwrap import bwrap_version  # noqa: E402
from rollhpc.sandbox.pool import available_cpus  # noqa: E402

PROGRAM = "print(sum(range(100)))"


class Plain:
    """``python -I -S -c PROGRAM``; pooled on a ThreadPoolExecutor (the same mechanism as SandboxPool)."""

    def __init__(self, interpreter: str) -> None:
        self.interpreter = interpreter

    def one(self) -> str:
        return subprocess.run(
            [self.interpreter, "-I", "-S", "-c", PROGRAM], capture_output=True, text=True, env={}
        ).stdout

    def many(self, n: int, workers: int) -> list[str]:
        with ThreadPoolExecutor(workers) as ex:
            return list(ex.map(lambda _: self.one(), range(n)))


class Sandboxed:
    """Sandbox.run; pooled through the library's SandboxPool."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    def one(self) -> str:
        return self.sandbox.run(PROGRAM).stdout

    def many(self, n: int, workers: int) -> list[str]:
        with SandboxPool(self.sandbox, workers) as pool:
            return [r.stdout for r in pool.map([PROGRAM] * n)]


def timed(mode, n: int, workers: int) -> float:
    """Seconds for n programs, sequential (workers=0) or on a pool of `workers` threads."""
    t = time.perf_counter()
    outs = [mode.one() for _ in range(n)] if workers == 0 else mode.many(n, workers)
    took = time.perf_counter() - t
    assert all(o == "4950\n" for o in outs), outs[:3]
    return took


def measure(modes: dict, n: int, workers: list[int], rounds: int) -> dict[str, dict]:
    """Median over rounds; each round runs every mode and pool size once, back to back, so that load from
    elsewhere on the machine falls on all of them alike."""
    configs = [(name, w) for name in modes for w in [0, *workers]]
    for name, w in configs:
        timed(modes[name], max(4, n // 20), w)  # warm up (page cache, preflight)
    secs: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    for _ in range(rounds):
        for name, w in configs:
            secs[(name, w)].append(timed(modes[name], n, w))
    out: dict[str, dict] = {name: {} for name in modes}
    for (name, w), times in secs.items():
        med = statistics.median(times)
        out[name]["sequential" if w == 0 else f"pool_{w}"] = {
            "programs_per_s": round(n / med, 1),
            "ms_per_program": round(1000 * med / n, 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100, help="programs per measurement")
    ap.add_argument("--workers", default="1,2,4", help="pool sizes (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "sandbox.json"))
    args = ap.parse_args()
    workers = [int(w) for w in args.workers.split(",")]

    load_before = os.getloadavg()
    sb = Sandbox()
    unsafe = Sandbox(unsafe=True, interpreter=sb.interpreter.path)
    modes = {
        "plain": Plain(sb.interpreter.path),
        "unsafe": Sandboxed(unsafe),
        "sandboxed": Sandboxed(sb),
    }
    results = measure(modes, args.n, workers, args.rounds)
    for name, rows in results.items():
        print(
            f"{name:<10} "
            + "  ".join(
                f"{k} {v['programs_per_s']:7.1f}/s ({v['ms_per_program']:.1f} ms)"
                for k, v in rows.items()
            ),
            flush=True,
        )
    seq = results["sandboxed"]["sequential"]["ms_per_program"]
    out = {
        "benchmark": "sandbox",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "cpus_available": available_cpus(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "bwrap": sb.bwrap,
            "bwrap_version": ".".join(map(str, bwrap_version(sb.bwrap) or ())),
            "interpreter": f"{sb.interpreter.path} ({sb.interpreter.version})",
            "bwrap_as_uid": sb.host_uid,
            # other work on the machine shows here: pooled numbers mean little when it is busy
            "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
            "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {
            "program": PROGRAM,
            "n": args.n,
            "rounds": args.rounds,
            "workers": workers,
            "limits": sb.limits.to_dict(),
        },
        "results": results,
        "sandbox_pool_default_workers": available_cpus(),
        "sandbox_overhead_ms_sequential": round(
            seq - results["plain"]["sequential"]["ms_per_program"], 2
        ),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"sandbox overhead per program (sequential): {out['sandbox_overhead_ms_sequential']} ms; wrote {args.out}"
    )


if __name__ == "__main__":
    main()
