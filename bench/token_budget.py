"""Token-budget micro-batches vs a fixed number of rows per micro-batch, on a batch with a long tail of lengths.

A GRPO batch mixes short and long responses (reasoning traces: most end early, a few run to the limit). The
trainer sorts rows longest first and cuts each micro-batch after its last loss token either way; what differs is
how rows are grouped:

  fixed   ``micro_batch_size`` rows per micro-batch: the micro-batch holding the long rows pads every short row in
          it to the long width (small micro-batches waste less there, but then the many short rows run in many
          small forward/backward passes);
  budget  ``max_tokens_per_micro_batch``: each micro-batch takes as many rows as fit the budget at its longest
          row's width, so the long rows run a few at a time and the short ones in large micro-batches.

One real train role (megatron-core GPTModel, its DDP and optimizer, one rank on CPU) trains the same batches under
each setting: ``--rows`` rows of a ``--prompt``-token prompt and a response of ``--short`` tokens, ``--long-frac``
of them ``--long`` tokens. Reported per setting: the median ``train_time_s`` of a step (the train step alone, as the
worker measures it) over ``--steps`` steps after one warm-up step, and over ``--repeats`` runs; the fastest fixed
setting is the baseline (each side at its best). The losses of both settings are the same (tests/
test_pipeline_parallel.py); here their first-step losses are recorded side by side as a check.

    python bench/token_budget.py [--fixed 4 8 16] [--budgets 2048 4096] [--repeats 2]

Results: bench/results/token_budget.json.
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

from rollhpc.protocol.pipeline import Pipeline  # noqa: E402
from bench.provenance import commit  # noqa: E402

TRAIN = "rollhpc.workers.megatron_policy:MegatronTrainWorker"


class TrainStepBench(Pipeline):
    """The controller program of one run: the same seeded batches through the train role, each step's time and
    loss to RUN_DIR/token_budget.json."""

    @dataclass(kw_only=True)
    class Options:
        rows: int = 64
        prompt: int = 16
        short: int = 48
        long: int = 512
        long_frac: float = 0.1
        vocab: int = 200
        steps: int = 5  # after one warm-up step

    def run(self) -> None:
        from rollhpc.algo.objective import LossConfig
        from rollhpc.batch import TrainingBatch

        o, train = self.options, self.workers["train"]
        rng = np.random.default_rng(0)
        width = o.prompt + o.long
        n_long = max(1, round(o.rows * o.long_frac))
        out: dict = {
            "train_time_s": [],
            "loss": [],
            "micro_batches": [],
            "tokens": [],
            "padded_width": width,
        }
        for step in range(o.steps + 1):
            lengths = np.full(o.rows, o.short)
            lengths[rng.permutation(o.rows)[:n_long]] = o.long
            tokens = rng.integers(1, o.vocab, (o.rows, width))
            positions = np.arange(width - 1)[None, :]
            ends = o.prompt - 1 + lengths  # the last response token's position as a target
            mask = ((positions >= o.prompt - 1) & (positions < ends[:, None])).astype(np.float32)
            # right padding, as RLVR's batches
            tokens[np.arange(width)[None, :] > ends[:, None]] = 0
            batch = TrainingBatch(tokens, mask, rng.standard_normal(o.rows).astype(np.float32))
            stats = train.train_step(batch, LossConfig(kl_coef=0.0))[0]
            if step:  # the first step warms up (allocations, megatron's first-call setup)
                out["train_time_s"].append(stats["train_time_s"])
                out["loss"].append(stats["loss"])
                out["micro_batches"].append(stats["micro_batches"])
                out["tokens"].append(float(mask.sum()))
        (self.run_ctx.run_dir / "token_budget.json").write_text(json.dumps(out))


def _model(root: Path, hidden: int, layers: int) -> Path:
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 200, 10, digits=2, ops=("+",))
    tok = build_tokenizer(list(arithmetic.corpus(train)), 300)
    spec = TinyModelConfig(
        hidden_size=hidden,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 64,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        max_position_embeddings=2048,
    )
    return create_tiny_model(root / "model", spec, tok)


def _run(root: Path, model: Path, name: str, train_options: dict, args: argparse.Namespace) -> dict:
    import yaml

    run_dir = root / "runs" / name
    config = {
        "run": {"name": name, "output_dir": str(root / "runs")},
        "pipeline": {
            "entry": "bench.token_budget:TrainStepBench",
            "options": {
                "rows": args.rows,
                "prompt": args.prompt,
                "short": args.short,
                "long": args.long,
                "long_frac": args.long_frac,
                "steps": args.steps,
            },
        },
        "roles": {
            "train": {
                "worker": TRAIN,
                "procs": 1,
                "options": {
                    "model_dir": str(model),
                    "lr": 1e-5,
                    "skip_zero_advantage": False,
                    **train_options,
                },
            }
        },
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path), "--overwrite"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "token_budget.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument(
        "--fixed", type=int, nargs="+", default=[4, 8, 16], help="micro_batch_size values (rows)"
    )
    ap.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        default=[2048, 4096],
        help="max_tokens_per_micro_batch values (tokens, rows x the micro-batch's longest row)",
    )
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--short", type=int, default=48)
    ap.add_argument("--long", type=int, default=512)
    ap.add_argument("--long-frac", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--repeats", type=int, default=2, help="runs per setting, interleaved (medians over all)"
    )
    ap.add_argument("--out", default=str(HERE / "results" / "token_budget.json"))
    args = ap.parse_args()

    settings = [(f"fixed_{n}", {"micro_batch_size": n}) for n in args.fixed]
    settings += [(f"budget_{b}", {"max_tokens_per_micro_batch": b}) for b in args.budgets]
    with tempfile.TemporaryDirectory(prefix="token_budget_") as tmp:
        root = Path(tmp)
        model = _model(root, args.hidden, args.layers)
        runs: dict[str, list[dict]] = {name: [] for name, _ in settings}
        for repeat in range(args.repeats):
            for name, options in settings:
                got = _run(root, model, f"{name}_r{repeat}", options, args)
                runs[name].append(got)
                print(
                    f"{name:12s} repeat {repeat}: step {statistics.median(got['train_time_s']):.3f} s, "
                    f"{statistics.median(got['micro_batches']):.0f} micro-batches",
                    flush=True,
                )
    results = {}
    for name, options in settings:
        times = [t for r in runs[name] for t in r["train_time_s"]]
        results[name] = {
            "options": options,
            "median_step_s": statistics.median(times),
            "min_step_s": min(times),
            "max_step_s": max(times),
            "micro_batches": runs[name][0]["micro_batches"][0],
            "first_loss": runs[name][0]["loss"][0],
            "steps": len(times),
        }
    fixed = min(
        (n for n in results if n.startswith("fixed")), key=lambda n: results[n]["median_step_s"]
    )
    budget = min(
        (n for n in results if n.startswith("budget")), key=lambda n: results[n]["median_step_s"]
    )
    speedup = results[fixed]["median_step_s"] / results[budget]["median_step_s"]
    out = {
        "bench": "token_budget",
        "commit": commit(),
        "args": vars(args),
        "results": results,
        "best_fixed": fixed,
        "best_budget": budget,
        "speedup": speedup,
        "loss_rel_diff": abs(results[fixed]["first_loss"] - results[budget]["first_loss"])
        / max(abs(results[fixed]["first_loss"]), 1e-12),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
    }
    from rollhpc.rundir import atomic_write_bytes

    atomic_write_bytes(Path(args.out), (json.dumps(out, indent=1) + "\n").encode())
    print(f"\n{'setting':12s} {'step s':>8s} {'range':>15s} {'micro-batches':>14s}")
    for name, r in results.items():
        print(
            f"{name:12s} {r['median_step_s']:8.3f} {r['min_step_s']:6.3f}-{r['max_step_s']:<7.3f} "
            f"{r['micro_batches']:14.0f}"
        )
    print(f"best budget ({budget}) vs best fixed ({fixed}): {speedup:.2f}x -> {args.out}")


if __name__ == "__main__":
    main()
