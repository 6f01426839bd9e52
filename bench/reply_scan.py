"""What the controller pays to learn that a call to N ranks has all its replies (issue 36): its wait looked at
every key from the start after each message, O(N) per reply and O(N^2) per call when replies come back in the
order the call went out (the usual order: in reverse, the first key is missing until the end and each look stops
there at once). ``rollhpc.controller.runtime.first_missing`` carries its place from one look to the next: each key is
looked at once.

    python bench/reply_scan.py [--ranks 128,1024,8769] [--out bench/results/reply_scan.json]

Rank 0's own bookkeeping only, the same dict lookups its wait makes: replies arrive one by one into the inbox (in
rank order, as the call went out, and in reverse), and after each the call's keys are looked at the
old way (``all`` from the start) and the new way. The MPI receive of each reply costs the same either way and is
left out (bench/scale.py's ``small_cpu_s`` has the whole call). Seconds per call, the median of 5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.provenance import commit, write_result  # noqa: E402
from rollhpc.controller.runtime import first_missing  # noqa: E402


def scan_all(keys: list, arrivals: list) -> int:
    """The wait before: after each reply, ``all(k in inbox for k in keys)``. Returns the lookups made."""
    inbox: dict = {}
    looked = 0
    for key in arrivals:
        inbox[key] = None
        for k in keys:
            looked += 1
            if k not in inbox:
                break
    return looked


def scan_cursor(keys: list, arrivals: list) -> int:
    inbox: dict = {}
    done = 0
    for key in arrivals:
        inbox[key] = None
        done = first_missing(keys, inbox, done)
    assert done == len(keys)
    return done


def seconds(fn, keys: list, arrivals: list, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(keys, arrivals)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="128,1024,8769")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "reply_scan.json")
    args = ap.parse_args()
    rows = {}
    for n in (int(x) for x in args.ranks.split(",")):
        keys = [(rank, 7) for rank in range(1, n + 1)]
        for order, arrivals in (("in_order", keys), ("reverse", keys[::-1])):
            row = {
                "before_s": seconds(scan_all, keys, arrivals),
                "after_s": seconds(scan_cursor, keys, arrivals),
                "before_lookups": scan_all(keys, arrivals),
                "after_lookups": n,
            }
            rows[f"{n}_{order}"] = row
            print(
                f"N={n} {order}: before {row['before_s'] * 1e3:.2f} ms ({row['before_lookups']} lookups), "
                f"after {row['after_s'] * 1e3:.3f} ms",
                flush=True,
            )
    out = {
        "bench": "reply_scan",
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": f"{os.cpu_count()} cores",
        "results": rows,
    }
    write_result(args.out, out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
