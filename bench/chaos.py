"""Randomized chaos on the local Slurm: nodes of a running RLVR job crash at random steps and come back after
a random while; the run must end COMPLETED, with every step logged once and the final weights of the same
run left alone.

Each round submits the run of bench/recovery.py (tiny random Qwen2, Megatron trainer, vLLM generator, reward
worker; the trainer alone in a het group of its own, so it runs on another node than the batch script) and
crashes ``--crashes`` nodes, one at a time, each at a random step (``slurm/local-cluster.sh node-crash``):
the trainer's node, the batch node (controller, generator, reward worker and the batch script) or a node of
the job chosen at random. The node's slurmd comes back after a random delay between 0 and ``--max-down`` s
(before or after Slurm's SlurmdTimeout of 5 s marks it DOWN). A job Slurm holds after a failed relaunch (a
crashed batch node) is released as ``rollhpc submit --wait`` does with ``cluster.release_held=true``.
Recovery is timed from the crash to the first training step after the resume. A crash that lands after the
run's last step must not start it again.

    python bench/chaos.py [--seed 0] [--rounds 3] [--crashes 2] [--max-down 20] [--slurm-dir DIR]

Results (every crash: round, step, target, node, downtime, recovery; every round: job state, steps logged,
weights match) go to bench/results/chaos.json. Exit status 1 if any round failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from recovery import (STEPS, Cluster, event_after, last_step, poll, run_args, step_of_session,  # noqa: E402
                      submit)

from rollhpc.launch.requeue import read_events  # noqa: E402
from rollhpc.launch.resubmit import current_job  # noqa: E402
from rollhpc.observability.metrics import read_metrics  # noqa: E402

TARGETS = ("train", "batch", "any")


def reference_weights(model: Path, work: Path) -> str:
    """The final weights' sha256 of the same run left alone (a local world: the run is deterministic)."""
    res = subprocess.run([sys.executable, "-m", "rollhpc.cli", "train", "quickstart", *run_args(model)], cwd=work,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"reference run failed: {res.stderr[-2000:]}")
    return read_metrics(work / "runs" / "quickstart" / "metrics.jsonl")[-1]["weights_sha256"]


def nodes_now(run_dir: Path) -> dict[str, str]:
    """This attempt's train node, batch node and every node of the job."""
    world = json.loads((run_dir / "world.json").read_text())
    start = [e for e in read_events(run_dir) if e["event"] == "start"][-1]
    (train,) = {w["host"] for w in world if w["role"] == "train"}
    return {"train": train, "batch": start["batch_host"], "all": start["nodes"]}


class Holds:
    """What a user waiting with ``rollhpc submit --wait`` and ``cluster.release_held=true`` gets: a job Slurm
    holds after a failed launch (its batch node crashed: "launch failed requeued held") is released once per
    attempt by rollhpc's own HoldWatch (logged in restarts.jsonl), instead of waiting for a person."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._watch = None

    def __call__(self) -> None:
        from rollhpc.launch.slurm import HoldWatch

        job = current_job(self.run_dir)
        if self._watch is None or self._watch.job_id != job:
            self._watch = HoldWatch(job, True, self.run_dir, grace_s=5.0)
        self._watch.poll()


def one_round(cluster: Cluster, model: Path, work: Path, rng: random.Random, crashes: int, max_down: float,
              reference: str) -> dict:
    run_dir = work / "runs" / "rq"
    job_id = submit(cluster, model, work)
    holds = Holds(run_dir)
    at_steps = sorted(rng.sample(range(2, STEPS + 1), crashes))
    rows = []
    for step in at_steps:
        poll(f"step {step}", lambda: last_step(run_dir) >= step and (run_dir / "world.json").exists(), 600)
        nodes = nodes_now(run_dir)
        target = rng.choice(TARGETS)
        host = nodes[target] if target != "any" else rng.choice(nodes["all"])
        down = round(rng.uniform(0, max_down), 1)
        resumes = len([e for e in read_events(run_dir) if e["event"] == "resume"])
        crashed_after = last_step(run_dir)
        t_fail = time.time()
        cluster.script("node-crash", str(cluster.dir), host)
        time.sleep(down)
        cluster.script("node-start", str(cluster.dir), host)
        row = {"step": crashed_after, "target": target, "node": host, "down_s": down}
        try:  # the first step after the next resume; none if the run had already finished
            resume = poll("the resume", lambda: holds() or event_after(run_dir, "resume", resumes) or (
                cluster.job_state(current_job(run_dir)) == "COMPLETED" and "finished"), 600, every=0.1)
            if resume == "finished":
                row["recovery_s"] = None
            else:
                poll(f"step {resume['step'] + 1}",
                     lambda: step_of_session(run_dir, resume["step"] + 1, resume["restarts"]), 300)
                row["recovery_s"] = round(time.time() - t_fail, 1)
                row["resumed_from_step"] = resume["step"]
        except RuntimeError as e:
            row["error"] = str(e)
        print(f"  crash {json.dumps(row)}", flush=True)
        rows.append(row)
        if "error" in row:
            break
    try:
        state = poll("the run's job to end", lambda: holds() or cluster.ended(run_dir), 900, every=0.5)
    except RuntimeError:
        state = cluster.job_state(current_job(run_dir))
        subprocess.run(["scancel", current_job(run_dir), job_id], env=cluster.env, capture_output=True, timeout=60)
    metrics = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    events = read_events(run_dir)
    return {"job_state": state, "crashes": rows,
            "steps_once": [m["step"] for m in metrics] == list(range(STEPS + 1)),
            "weights_match": bool(metrics) and metrics[-1].get("weights_sha256") == reference,
            "attempts": sum(e["event"] == "start" for e in events),
            "requeues": [e.get("reason") for e in events if e["event"] == "requeue"],
            "held_and_released": [e.get("reason") for e in events if e["event"] == "release"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--crashes", type=int, default=2, help="node crashes per round")
    p.add_argument("--max-down", type=float, default=20.0, help="a crashed node's slurmd returns within this (s)")
    p.add_argument("--slurm-dir", type=Path, help="a running local-cluster.sh directory (default: start one)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "chaos.json")
    args = p.parse_args()
    if not 1 <= args.crashes < STEPS:
        p.error(f"--crashes must be between 1 and {STEPS - 1}")

    from rollhpc.models.tiny import TinyModelSpec, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="rollhpc-bench-chaos-"))
    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    model = create_tiny_model(root / "tiny", TinyModelSpec(), build_tokenizer(list(arithmetic.corpus(train)), 300))
    (root / "reference").mkdir()
    reference = reference_weights(model, root / "reference")
    cluster = Cluster(args.slurm_dir)
    os.environ.update(cluster.env)  # rollhpc's own Slurm calls in this process (HoldWatch) reach the bench's cluster
    rounds = []
    try:
        for i in range(args.rounds):
            work = root / f"round-{i}"
            work.mkdir()
            print(f"round {i}:", flush=True)
            result = one_round(cluster, model, work, rng, args.crashes, args.max_down, reference)
            print(f"round {i}: {json.dumps({k: v for k, v in result.items() if k != 'crashes'})}", flush=True)
            rounds.append(result)
    finally:
        cluster.down()
    ok = [r["job_state"] == "COMPLETED" and r["steps_once"] and r["weights_match"] for r in rounds]
    times = [c["recovery_s"] for r in rounds for c in r["crashes"] if c.get("recovery_s") is not None]
    summary = {"rounds_ok": sum(ok), "rounds": len(rounds),
               "recovery_s_median": statistics.median(times) if times else None,
               "recovery_s_max": max(times) if times else None}
    result = {"benchmark": "chaos", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seed": args.seed,
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "settings": {"crashes_per_round": args.crashes, "max_down_s": args.max_down, "steps": STEPS,
                           "checkpoint_every": 2, "slurmd_timeout_s": 5, "held_job_released_after_s": 5},
              "summary": summary, "rounds": rounds}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    print(f"{summary['rounds_ok']}/{summary['rounds']} rounds ended COMPLETED with every step once and the "
          f"uninterrupted weights; recovery median {summary['recovery_s_median']} s, max {summary['recovery_s_max']} s")
    print(f"results: {args.out}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
