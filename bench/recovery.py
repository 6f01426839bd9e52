"""Recovery time of checkpoint-and-requeue: from a failure to the first new training step.

Three failures of the same RLVR run (tiny random Qwen2, Megatron trainer, vLLM generator, checkpoint every
2 steps), each measured from the moment of the failure to the moment the first step after the resumed
checkpoint is logged in metrics.jsonl (polled every 50 ms):

  local-kill        the local world is SIGKILLed after step 5; `rollhpc train --resume` is started at once
  slurm-node-crash  the trainer's node dies (slurmd + its processes SIGKILLed) after step 5 and stays down;
                    the controller notices at once, Slurm marks the node DOWN (SlurmdTimeout) and requeues
  slurm-node-back   the same, but the node's slurmd is back 2 s later, before Slurm noticed: the batch
                    script ends the step srun would wait on forever and requeues without the node
  slurm-sync-crash  the trainer's node dies inside a weight sync (the sender held half-way by a test hook,
                    the generator blocked in the broadcast): the generator's gloo error surfaces first and
                    is classified as the echo of the lost trainer (rollhpc.controller.failure), not as a
                    failure of the run's own
  slurm-batch-crash the batch node dies after step 5 (controller, generator, reward worker and the batch
                    script with it) and is back 8 s later: nobody is left to continue the run but the job's
                    rescue job, which Slurm starts once the job has ended NODE_FAIL (rollhpc.launch.rescue)
  slurm-time-limit  Slurm's time-limit warning (--signal=B:USR1@N) arrives: the controller checkpoints after
                    its current step, exits 75, the batch script requeues the job; timed from the warning

Each row also splits the time into its parts (failure noticed / job started again / checkpoint loaded) and
says how many steps were computed twice (work lost). Results: bench/results/recovery.json.

    python bench/recovery.py [--repeats 1] [--slurm-dir DIR]

Slurm: a throw-away cluster is started with slurm/local-cluster.sh (root needed) unless --slurm-dir names a
running one. The cluster's SlurmdTimeout (5 s here) bounds how fast a dead node is noticed; production
clusters use minutes, so their detection part is longer and the rest the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from rollhpc.observability.metrics import read_metrics  # noqa: E402
from rollhpc.rundir.records import read_events  # noqa: E402

STEPS = 10
CLUSTER = REPO / "slurm" / "local-cluster.sh"


def run_args(model: Path) -> list[str]:
    return [
        f"pipeline.options.model_dir={model}",
        "pipeline.options.warm_start=null",
        f"pipeline.options.steps={STEPS}",
        "pipeline.options.eval_every=0",
        "pipeline.options.prompts_per_step=4",
        "pipeline.options.rollout.dynamic_sampling=false",
        "pipeline.options.rollout.oversample=0",
        "pipeline.options.checkpoint.every=2",
        "pipeline.options.loss.entropy_coef=0.05",
    ]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        metrics = read_metrics(path)
    except (FileNotFoundError, ValueError):
        return -1
    return metrics[-1]["step"] if metrics else -1


def step_of_session(run_dir: Path, step: int, restarts: int) -> bool:
    """Whether metrics.jsonl has ``step`` logged by the session that resumed for the ``restarts``-th time."""
    try:
        return any(
            m["step"] == step and m.get("restarts") == restarts
            for m in read_metrics(run_dir / "metrics.jsonl")
        )
    except (FileNotFoundError, ValueError):
        return False


JOB_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def poll(what: str, check, timeout: float, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def file_time(path: Path) -> float:
    return path.stat().st_mtime


def event_after(run_dir: Path, name: str, n: int) -> dict | None:
    found = [e for e in read_events(run_dir) if e["event"] == name]
    return found[n] if len(found) > n else None


def steps_redone(run_dir: Path, failed_after: int) -> int:
    resume = event_after(run_dir, "resume", 0)
    return max(0, failed_after - resume["step"]) if resume else -1


def measure_until_next_step(run_dir: Path, t_fail: float, parts: dict[str, float]) -> dict:
    """Wait for the first step after the resumed checkpoint; returns the row (wall times from t_fail)."""
    resume = poll("the resume", lambda: event_after(run_dir, "resume", 0), 600, every=0.05)
    parts.setdefault("checkpoint_loaded_s", time.time() - t_fail)
    first_new = resume["step"] + 1
    # the resumed session's own line (metrics.jsonl is cut back just after the resume event is logged: the
    # killed session's line for that step may still be there a moment)
    poll(f"step {first_new}", lambda: step_of_session(run_dir, first_new, resume["restarts"]), 300)
    total = time.time() - t_fail
    return {
        "recovery_s": round(total, 2),
        **{k: round(v, 2) for k, v in parts.items()},
        "resumed_from_step": resume["step"],
    }


# -- local ----------------------------------------------------------------------------------------------


def local_kill(model: Path, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "rollhpc.cli", "train", "quickstart", *run_args(model)]
    run_dir = work / "runs" / "quickstart"
    with open(work / "first.log", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        poll("step 5", lambda: last_step(run_dir) >= 5, 300)
        failed_after = last_step(run_dir)
        t_fail = time.time()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with open(work / "resume.log", "w") as out:
        resumed = subprocess.Popen(
            [*cmd[:4], "--resume", *cmd[4:]],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        row = measure_until_next_step(run_dir, t_fail, {})
        rc = resumed.wait(timeout=300)
    row["steps_redone"] = steps_redone(run_dir, failed_after)
    row["finished"] = rc == 0 and last_step(run_dir) == STEPS
    return row


# -- Slurm ----------------------------------------------------------------------------------------------


class Cluster:
    def __init__(self, slurm_dir: Path | None, nodes: int = 4):
        self.started = slurm_dir is None
        self.dir = slurm_dir or Path(tempfile.mkdtemp(prefix="rollhpc-bench-slurm-", dir="/tmp"))
        base_env = {
            k: v for k, v in os.environ.items() if not re.match(r"^(SLURM_|SBATCH_|SRUN_)", k)
        }
        self.env = {
            **base_env,
            "SLURM_CONF": str(self.dir / "etc" / "slurm.conf"),
            "PATH": f"{self.dir / 'bin'}:{base_env.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
        }
        if self.started:
            port = random.randrange(20000, 30000, 64)
            up = {
                **base_env,
                "SLURM_CTLD_PORT": str(port),
                "SLURM_SLURMD_PORT_BASE": str(port),
                "SLURM_NODES": str(nodes),
            }
            subprocess.run(
                ["bash", str(CLUSTER), "up", str(self.dir)],
                env=up,
                check=True,
                capture_output=True,
                timeout=600,
            )

    def script(self, *args: str) -> None:
        subprocess.run(
            ["bash", str(CLUSTER), *args],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def scontrol(self, *args: str) -> str:
        return subprocess.run(
            ["scontrol", *args], env=self.env, capture_output=True, text=True, timeout=60
        ).stdout

    def job_state(self, job_id: str) -> str:
        m = re.search(r"JobState=(\S+)", self.scontrol("show", "job", "-o", job_id))
        return m.group(1) if m else "UNKNOWN"

    def ended(self, run_dir: Path) -> str | None:
        """The state of the run's last job if it has ended and its rescue job has nothing more to do, else None
        (a restart continues the run in a new job: RUN_DIR/slurm/job_id names the current one)."""
        from rollhpc.launch.resubmit import rescue_jobs

        job_id = (run_dir / "slurm" / "job_id").read_text().strip()
        state = self.job_state(job_id)
        rescue = rescue_jobs(run_dir).get(job_id)
        if rescue and self.job_state(rescue) not in (*JOB_ENDED, "UNKNOWN"):
            return None  # it decides whether the run goes on
        return (
            state
            if state in JOB_ENDED and job_id == (run_dir / "slurm" / "job_id").read_text().strip()
            else None
        )

    def wait_done(self, run_dir: Path, timeout: float = 600) -> str:
        """The state of the run's last job once it has ended."""
        return poll("the run's job to end", lambda: self.ended(run_dir), timeout, every=0.5)

    def settle(self, host: str, timeout: float = 60) -> None:
        """After a crashed node's slurmd is back: wait until nothing of the old jobs is left on the cluster.
        A job component that was on the dead node may stay COMPLETING after its slurmd restarts (the new
        slurmd never knew the job); Slurm's backfill then still plans the next repeat's fresh job onto that
        node and holds it back. Marking the node DOWN and resuming it clears that component."""

        def busy() -> bool:
            out = subprocess.run(
                ["squeue", "-h", "-o", "%T"],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.split()
            return bool(out)

        deadline = time.time() + timeout
        forced = False
        while busy():
            if time.time() > deadline:
                raise RuntimeError(
                    f"jobs still in the queue {timeout:.0f} s after the repeat ended"
                )
            if not forced and time.time() > deadline - timeout + 10:
                self.scontrol("update", f"NodeName={host}", "State=DOWN", "Reason=bench-settle")
                self.scontrol("update", f"NodeName={host}", "State=RESUME")
                forced = True
            time.sleep(0.5)

    def down(self) -> None:
        if self.started:
            subprocess.run(
                ["bash", str(CLUSTER), "down", str(self.dir)],
                env=self.env,
                capture_output=True,
                timeout=120,
            )


def submit(
    cluster: Cluster, model: Path, work: Path, *extra: str, env: dict[str, str] | None = None
) -> str:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollhpc.cli",
            "submit",
            "quickstart",
            *run_args(model),
            "run.name=rq",
            f"run.output_dir={work / 'runs'}",
            "roles.train.gpus_per_proc=1",
            "cluster.nodes=4",
            "cluster.cpus_per_node=8",
            "cluster.gpus_per_node=4",
            *extra,
        ],
        cwd=work,
        env={**cluster.env, **(env or {})},
        text=True,
        capture_output=True,
        timeout=120,
    )
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    return (work / "runs" / "rq" / "slurm" / "job_id").read_text().strip()


def holding_weight_sync(run_dir: Path, nth: int) -> bool:
    """Whether the trainer's log says the test hook holds its ``nth`` weight sync half-way."""
    return any(
        f"holding the weight sync {nth} " in p.read_text(errors="replace")
        for p in (run_dir / "logs").glob("rank*-train.log")
    )


def slurm_node_crash(
    cluster: Cluster,
    model: Path,
    work: Path,
    back_after_s: float | None = None,
    target: str = "train",
    in_sync: bool = False,
) -> dict:
    """A node of the run dies after step 5 (``target``: the trainer's, or the batch node); it stays down (Slurm
    marks it DOWN after SlurmdTimeout), or with ``back_after_s`` its slurmd returns that soon. ``in_sync``: the
    crash lands inside the 6th weight sync, the sender held there by ROLLHPC_TEST_HOLD_IN_WEIGHT_SYNC."""
    run_dir = work / "runs" / "rq"
    job_id = submit(
        cluster, model, work, env={"ROLLHPC_TEST_HOLD_IN_WEIGHT_SYNC": "6:120"} if in_sync else None
    )
    if in_sync:
        poll("the 6th weight sync, held", lambda: holding_weight_sync(run_dir, 6), 300, every=0.1)
    else:
        poll("step 5", lambda: last_step(run_dir) >= 5, 300)
    if target == "train":
        world = json.loads((run_dir / "world.json").read_text())
        (host,) = {w["host"] for w in world if w["role"] == "train"}
    else:
        host = [e for e in read_events(run_dir) if e["event"] == "start"][-1]["batch_host"]
    failed_after = last_step(run_dir)
    t_fail = time.time()
    cluster.script("node-crash", str(cluster.dir), host)
    if back_after_s is not None:
        time.sleep(back_after_s)
        cluster.script("node-start", str(cluster.dir), host)
    parts: dict[str, float] = {}
    try:
        # the attempt is over once the batch script (or the rescue job) has arranged the restart (a new job), or
        # Slurm ended it
        poll(
            "the attempt to end",
            lambda: event_after(run_dir, "requeue", 0) or cluster.job_state(job_id) != "RUNNING",
            300,
            every=0.1,
        )
        parts["attempt_ended_s"] = time.time() - t_fail
        poll("the next start", lambda: event_after(run_dir, "start", 1), 300, every=0.1)
        parts["job_started_again_s"] = time.time() - t_fail
        row = measure_until_next_step(run_dir, t_fail, parts)
        state = cluster.wait_done(run_dir)
    finally:
        cluster.script("node-start", str(cluster.dir), host)
        cluster.settle(host)
    requeue = event_after(run_dir, "requeue", 0) or {}
    row["restarted_by"] = requeue.get("by", "batch script")
    row["failure"] = (requeue.get("failure") or {}).get("kind")
    row["steps_redone"] = steps_redone(run_dir, failed_after)
    row["finished"] = state == "COMPLETED" and last_step(run_dir) == STEPS
    return row


def slurm_time_limit(cluster: Cluster, model: Path, work: Path) -> dict:
    """The warning is due 60 s after the start (limit 3 min, warning 120 s before); checkpoint 6 of the first
    attempt is held back until it has come, so the warning finds the run mid-way."""
    run_dir = work / "runs" / "rq"
    job_id = submit(
        cluster,
        model,
        work,
        "cluster.time_limit=00:03:00",
        "cluster.stop_before_limit_s=120",
        env={"ROLLHPC_TEST_CHECKPOINT_DELAY": "6:170"},
    )
    stop_file = run_dir / "stop-request"
    poll("the time-limit warning", stop_file.exists, 300, every=0.02)
    t_fail = time.time()
    failed_after = last_step(run_dir)
    parts: dict[str, float] = {}
    requeue = poll("the requeue", lambda: event_after(run_dir, "requeue", 0), 300, every=0.05)
    parts["checkpoint_saved_and_requeued_s"] = time.time() - t_fail
    # the next job gets room: its own warning would otherwise come a minute after its start
    for comp in re.findall(
        r"JobId=(\S+)", cluster.scontrol("show", "job", "-o", requeue.get("new_job_id", job_id))
    ):
        cluster.scontrol("update", f"JobId={comp}", "TimeLimit=00:10:00")
    poll("the next start", lambda: event_after(run_dir, "start", 1), 300, every=0.1)
    parts["job_started_again_s"] = time.time() - t_fail
    row = measure_until_next_step(run_dir, t_fail, parts)
    state = cluster.wait_done(run_dir)
    row["steps_redone"] = steps_redone(run_dir, failed_after)
    row["finished"] = state == "COMPLETED" and last_step(run_dir) == STEPS
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each scenario (the median is reported)"
    )
    p.add_argument(
        "--slurm-dir", type=Path, help="a running local-cluster.sh directory (default: start one)"
    )
    p.add_argument(
        "--scenarios",
        default="local-kill,slurm-node-crash,slurm-node-back,slurm-sync-crash,"
        "slurm-batch-crash,slurm-time-limit",
    )
    p.add_argument("--out", type=Path, default=HERE / "results" / "recovery.json")
    args = p.parse_args()

    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    root = Path(tempfile.mkdtemp(prefix="rollhpc-bench-recovery-"))
    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    model = create_tiny_model(
        root / "tiny", TinyModelConfig(), build_tokenizer(list(arithmetic.corpus(train)), 300)
    )
    scenarios = args.scenarios.split(",")
    cluster = Cluster(args.slurm_dir) if any(s.startswith("slurm") for s in scenarios) else None
    rows: dict[str, list[dict]] = {}
    runners = {
        "local-kill": lambda work: local_kill(model, work),
        "slurm-node-crash": lambda work: slurm_node_crash(cluster, model, work),
        "slurm-node-back": lambda work: slurm_node_crash(cluster, model, work, back_after_s=2.0),
        "slurm-sync-crash": lambda work: slurm_node_crash(cluster, model, work, in_sync=True),
        "slurm-batch-crash": lambda work: slurm_node_crash(
            cluster, model, work, back_after_s=8.0, target="batch"
        ),
        "slurm-time-limit": lambda work: slurm_time_limit(cluster, model, work),
    }
    if unknown := [n for n in scenarios if n not in runners]:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {', '.join(runners)}")
    try:
        for name in scenarios:
            for i in range(args.repeats):
                work = root / f"{name}-{i}"
                work.mkdir()
                try:
                    row = runners[name](work)
                except (
                    RuntimeError
                ) as e:  # a run that did not recover: recorded, and the next one goes on
                    row = {"error": str(e), "finished": False}
                    run_dir = work / "runs" / "rq"
                    # its jobs and rescues
                    if cluster is not None and (run_dir / "slurm" / "job_id").exists():
                        from rollhpc.launch.resubmit import rescue_jobs

                        jobs = [
                            (run_dir / "slurm" / "job_id").read_text().strip(),
                            *(x for kv in rescue_jobs(run_dir).items() for x in kv),
                        ]
                        subprocess.run(
                            ["scancel", *jobs], env=cluster.env, capture_output=True, timeout=60
                        )
                print(f"{name} #{i}: {json.dumps(row)}", flush=True)
                rows.setdefault(name, []).append(row)
    finally:
        if cluster is not None:
            cluster.down()
    summary = {}
    for name, rs in rows.items():
        done = [
            r["recovery_s"] for r in rs if r.get("finished") and r.get("recovery_s") is not None
        ]
        summary[name] = {
            "finished": len(done),
            "runs_total": len(rs),
            "recovery_s_median": statistics.median(done) if done else None,
            "recovery_s_max": max(done) if done else None,
            "runs": rs,
        }
    result = {
        "benchmark": "recovery",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "run": {
            "steps": STEPS,
            "checkpoint_every": 2,
            "model": "tiny random Qwen2 (TinyModelConfig())",
            "roles": "controller, megatron train, vllm generate, math reward (4 MPI ranks)",
        },
        "slurmd_timeout_s": 5,
        "scenarios": summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(args.out)
    for name, s in summary.items():
        median = "-" if s["recovery_s_median"] is None else f"{s['recovery_s_median']:.1f} s"
        print(
            f"{name:18s} {s['finished']}/{s['runs_total']} finished; failure -> first new step: {median} (median)"
        )
    print(f"results: {args.out}")
    return 0 if all(s["finished"] == s["runs_total"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
