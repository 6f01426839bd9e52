"""RLVR on a tiny MoE policy with a mismatched generator: what routing replay, the mismatch correction and the
sequence-level objectives do to the trainer-generator gap and to learning.

The policy is the quickstart's arithmetic task on a Qwen2-MoE warm start (4 routed experts, top 2, a shared
expert; built and fine-tuned once into OUT/models/moe-sft), trained by the Megatron trainer in float32 and
sampled by the torch engine (the engine that returns its routes). Settings:

- matched: the generator in float32, synchronous: the engines agree.
- mismatched: the generator in bfloat16 and async with ``rollout.max_staleness: 2`` (the behaviour log-probs the
  generator's, ``old_logprob_source: generator``): the sampling policy differs from the trained one in precision,
  in routing and in age.
- +r3: the trainer replays the generator's routes (``router_replay: r3``); +r2: its own, recorded in its
  old-log-prob forward (``router_replay: r2``; it needs the trainer's old log-probs, so it runs with +tis).
- +tis: decoupled PPO with truncated importance weights (``old_logprob_source: trainer``,
  ``loss.correction: {weight: token}``).
- +gspo / +cispo: the objective (GSPO with its own clips, CISPO) on top of r3 + tis.

Per run, from its metrics.jsonl: held-out accuracy against steps and wall time, and the step means of
``logprob_abs_diff`` and ``mismatch_kl`` (trainer vs generator, where the step computed the trainer's old
log-probs), ``mismatch_ratio_p95`` and ``train/route_replay_differ_frac`` (with r3: the share of (token, layer)
routes where the generator's experts are not the trainer's own choice). Medians over seeds ->
results/moe_stability.json and results/moe_stability.png.

    python bench/moe_stability.py [--steps 60] [--seeds 0 1 2] [--only matched mismatched ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import REPO, commit, write_figure, write_result

MISMATCHED = [
    "roles.generate.options.dtype=bfloat16",
    "pipeline.options.rollout.max_staleness=2",
    "pipeline.options.old_logprob_source=generator",
]
TIS = [
    "pipeline.options.old_logprob_source=trainer",
    "pipeline.options.loss.correction={weight: token}",
]
R3 = ["roles.train.options.router_replay=r3"]
SETTINGS: dict[str, list[str]] = {
    "matched": ["roles.generate.options.dtype=float32"],
    "mismatched": MISMATCHED,
    "mismatched+r3": [*MISMATCHED, *R3],
    "mismatched+tis": [*MISMATCHED, *TIS],
    "mismatched+r2+tis": [*MISMATCHED, "roles.train.options.router_replay=r2", *TIS],
    "mismatched+r3+tis": [*MISMATCHED, *R3, *TIS],
    "mismatched+r3+tis+gspo": [
        *MISMATCHED,
        *R3,
        *TIS,
        "pipeline.options.loss={objective: gspo, clip_low: 3.0e-4, clip_high: 4.0e-4, "
        "agg: seq-mean-token-mean, correction: {weight: token}}",
    ],
    "mismatched+r3+tis+cispo": [*MISMATCHED, *R3, *TIS, "pipeline.options.loss.objective=cispo"],
}
MEANS = (
    "logprob_abs_diff",
    "mismatch_kl",
    "mismatch_ratio_p95",
    "train/route_replay_differ_frac",
    "step_s",
)


def run(out: Path, name: str, seed: int, steps: int) -> dict:
    """One training run of a setting; its metrics summarised."""
    run_name = f"{name.replace('+', '_')}_s{seed}"
    args = [
        sys.executable,
        "-m",
        "rollhpc.cli",
        "train",
        "quickstart",
        f"run.name={run_name}",
        f"run.output_dir={out / 'runs'}",
        f"run.seed={seed}",
        f"pipeline.options.model_dir={out / 'models' / 'moe-sft'}",
        "pipeline.options.warm_start={seed: 0, spec: {moe: true, tie_word_embeddings: false}}",
        f"pipeline.options.steps={steps}",
        "pipeline.options.eval_every=10",
        "roles.generate.options.engine=torch",
        *SETTINGS[name],
        "--overwrite",
    ]
    t0 = time.perf_counter()
    res = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{run_name} failed:\n{res.stderr[-3000:]}")
    lines = [
        json.loads(x) for x in (out / "runs" / run_name / "metrics.jsonl").read_text().splitlines()
    ]
    evals = [(m["step"], m.get("time"), m["accuracy"]) for m in lines if "accuracy" in m]
    start = lines[0].get("time") or 0.0
    trained = [m for m in lines if m["step"] > 0]
    return {
        "seed": seed,
        "wall_s": round(time.perf_counter() - t0, 1),
        "accuracy": [(s, round((t or start) - start, 2), a) for s, t, a in evals],
        "final_accuracy": evals[-1][2],
        **{
            k: statistics.fmean(m[k] for m in trained if k in m)
            for k in MEANS
            if any(k in m for m in trained)
        },
    }


def summarise(runs: list[dict]) -> dict:
    """Medians over seeds of the per-run numbers."""
    keys = ["final_accuracy", *(k for k in MEANS if k in runs[0])]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results["settings"].items():
        # median accuracy per evaluation step, at the median wall time of that evaluation
        steps = [s for s, _, _ in r["runs"][0]["accuracy"]]
        wall = [
            statistics.median(run["accuracy"][i][1] for run in r["runs"]) for i in range(len(steps))
        ]
        accs = [
            statistics.median(run["accuracy"][i][2] for run in r["runs"]) for i in range(len(steps))
        ]
        acc.plot(wall, accs, marker="o", label=name)
    acc.set(xlabel="wall time (s)", ylabel="held-out accuracy (median of seeds)", title="learning")
    acc.legend(fontsize=7)
    names = [n for n, r in results["settings"].items() if "logprob_abs_diff" in r["median"]]
    gap.bar(
        range(len(names)), [results["settings"][n]["median"]["logprob_abs_diff"] for n in names]
    )
    gap.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    gap.set(ylabel="|trainer - generator| log-prob per token", title="engine gap (steps with both)")
    write_figure(path, fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="+", choices=sorted(SETTINGS), help="these settings alone")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_moe_stability")
    a = ap.parse_args()
    results: dict = {"commit": commit(), "steps": a.steps, "seeds": a.seeds, "settings": {}}
    for name in a.only or SETTINGS:
        runs = []
        for seed in a.seeds:
            runs.append(run(a.out, name, seed, a.steps))
            print(
                f"{name} seed {seed}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'accuracy'})}",
                flush=True,
            )
        results["settings"][name] = {
            "overrides": SETTINGS[name],
            "runs": runs,
            "median": summarise(runs),
        }
    write_result(REPO / "bench" / "results" / "moe_stability.json", results)
    figure(results, REPO / "bench" / "results" / "moe_stability.png")
    for name, r in results["settings"].items():
        print(name, json.dumps(r["median"]))


if __name__ == "__main__":
    main()
