"""rollhpc's side of bench/rlvr_vs_trl.py at one size and setting, run from the source tree given: for comparing two
commits of rollhpc side by side on one machine without TRL (which the comparison itself needs).

    python bench/rlvr_side.py [--tree DIR] [--size small] [--setting parity] [--override KEY=VALUE ...]

``--tree`` is a checkout of rollhpc (default: this one; for another commit, `git worktree add DIR COMMIT` and copy
runs/models/ there, so both start from the same SFT policy). Its bench/rlvr_vs_trl.py runs `rollhpc train` with
the size's and setting's overrides for the size's training wall time; printed as one JSON line: training wall
time, trained steps, samples and samples/s (every sampled row), held-out accuracy at the start, the end and best,
and the median seconds of a step's stages.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--size", default="small")
    ap.add_argument(
        "--setting",
        default="parity",
        help="a setting of bench/rlvr_vs_trl.yaml (lora: rollhpc alone)",
    )
    ap.add_argument("--wall-s", type=float, help="training seconds (default: the size's)")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more config override after the setting's (repeatable), e.g. "
        "roles.generate.options.engine=vllm",
    )
    args = ap.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree), str(tree / "bench")]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    import yaml

    import rlvr_vs_trl as bench

    spec = yaml.safe_load((tree / "bench" / "rlvr_vs_trl.yaml").read_text())
    s, overrides = bench.load_settings(
        spec["sizes"][args.size], spec["settings"][args.setting], args.wall_s
    )
    start = time.time()
    r = bench.run_rollhpc(
        s,
        Path(tempfile.mkdtemp(prefix="rlvr_side_")),
        [*overrides, *args.override, f"run.seed={s.seed}"],
    )
    records = [
        json.loads(line)
        for line in (tree / "runs" / "bench_rollhpc" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    steps = [x for x in records if x["step"] >= 1]
    stages = {
        k: float(
            f"{statistics.median(x[k] for x in steps if k in x):.4g}"
        )  # (logprob_abs_diff: ~1e-7)
        for k in (
            "step_s",
            "rollout_s",
            "old_logprob_s",
            "train_s",
            "weight_sync_s",
            "weight_sync_mb",
            "tokens_per_s",
            "logprob_abs_diff",
        )
        if any(k in x for x in steps)
    }
    accuracy = [a for _, a in r["curve"]]
    print(
        json.dumps(
            {
                "tree": str(tree),
                "size": args.size,
                "setting": args.setting,
                "overrides": args.override,
                "wall_s": round(r["wall_s"], 1),
                "steps": r["steps"],
                "steps_skipped": r["steps_skipped"],
                "samples": r["samples"],
                "samples_per_s": round(r["samples"] / r["wall_s"], 2),
                "accuracy_start": accuracy[0],
                "accuracy_end": accuracy[-1],
                "accuracy_best": max(accuracy),
                "median_stage_s": stages,
                "elapsed_s": round(time.time() - start),
            }
        )
    )


if __name__ == "__main__":
    main()
