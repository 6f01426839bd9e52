"""``rollhpc report``: plots and a summary of runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    # the figures are drawn with matplotlib: imported once the command runs, not for --help
    from rollhpc.observability.report import load_run, summarize, write_report

    try:
        runs = [load_run(d) for d in args.run_dirs]
    except FileNotFoundError as e:
        print(f"rollhpc report: {e}", file=sys.stderr)
        return 2
    out = args.out or args.run_dirs[0] / "report"
    written = write_report(args.run_dirs, out)
    for run in runs:
        print("\n".join(summarize(run)))
    print(f"rollhpc report: {', '.join(p.name for p in written)} in {out}", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:

    rp = sub.add_parser(
        "report",
        help="plots and a summary of one run, or several compared on the same axes",
        description="Write PNG figures of a run (finished or in progress) and a text summary: "
        "learning.png (reward and held-out accuracy against step and against wall time, restarts "
        "and requeues from restarts.jsonl marked as dashed lines), throughput.png (tokens/s, the "
        "generators' idle fraction), stages.png (each step's time by stage: rollout, old "
        "log-probs, reference, train, weight sync, evaluation, the rest), training.png (loss, "
        "gradient norm, clip fraction, response length, entropy, KL: each one logged, raw and "
        "smoothed), summary.txt. Given several runs, each curve is one run (named by its "
        "directory where two share a name). Files are replaced atomically.",
        epilog="Example: rollhpc report runs/quickstart runs/quickstart_pp2 --out cmp/. "
        "Exit status: 0, or 2 when a RUN_DIR has no metrics.jsonl.",
    )
    rp.add_argument(
        "run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories, runs/NAME"
    )
    rp.add_argument(
        "--out", type=Path, metavar="DIR", help="where the files go (default: FIRST_RUN_DIR/report)"
    )
    rp.set_defaults(func=cmd_report)
