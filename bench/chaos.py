"""Seeded chaos on the local Slurm: nodes of a running RLVR job crash at chosen or random moments; every round
must end COMPLETED with no person acting (no release, no resubmission by hand), every step logged once and the
final weights of the same run left alone.

Each round submits the run of bench/recovery.py (tiny random Qwen2, Megatron trainer, vLLM generator, reward
worker; the trainer in a het group of its own, so on another node than the batch script) and plays one round
type (``slurm/local-cluster.sh node-crash``, then ``node-start`` after the downtime):

  random          ``--crashes`` crashes at random steps, each of the trainer's node, the batch node or any node
                  of the job, down for a random 0..``--max-down`` s (before or after Slurm's SlurmdTimeout of 5 s)
  sync            the trainer's node dies inside a weight sync (the sender held half-way by a test hook, the
                  generator blocked in the broadcast), back after 2 s
  grad-sync       two trainer ranks on two nodes; the node of the one held before its gradient all-reduce dies
                  while the other waits inside it (a collective of the trainer's own), back after 2 s
  batch-meanwhile the trainer's node dies, and 0.3 s later, while that failure is being handled, the batch node;
                  both back after 8 s: only the job's rescue job is left to continue the run
  batch-back      the batch node dies and is back after 8 s, before Slurm marks it DOWN: what used to leave the
                  job "launch failed requeued held" until a person released it
  world           the trainer's node dies after a random step and is back after 2 s; then, while the restarted
                  attempt's world forms, one of its nodes dies and is back after 8 s

``--nodes N`` spreads the job over N nodes (16+ for issue 36): the trainer's node (two for grad-sync rounds),
and the controller, the generator and N - 3 reward ranks each on a node of its own (the CPU het group at one
rank per node), on a local cluster of N + 4 nodes (spares for the nodes a round takes down). A crash of "any"
node then mostly lands on a reward rank's node. The default, 2, is the small layout: the trainer's node and the
batch node, on 4.

Recovery is timed from each crash to the first training step after the resume. A crash that lands after the
run's last step must not start it again: such a round is finished by the run's own record (its controller's
clean exit or its last step's checkpoint), whatever state Slurm gave the job the node took down.

    python bench/chaos.py [--seed 0] [--rounds 10] [--types random,sync,...] [--crashes 2] [--max-down 20]
                          [--nodes 2] [--slurm-dir DIR]

Results (every crash: round, type, target, node, downtime, recovery; every round: job state, steps logged,
weights match, attempts, how each restart came about) go to bench/results/chaos.json. Exit status 1 if any
round failed.
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

from recovery import (  # noqa: E402 - after the sys.path line above
    STEPS,
    Cluster,
    event_after,
    last_step,
    poll,
    run_args,
    step_of_session,  # noqa: E402
    submit,
)

from bench.provenance import commit, write_result  # noqa: E402
from rollhpc.launch.requeue import finished_run  # noqa: E402
from rollhpc.launch.resubmit import current_job, rescue_jobs  # noqa: E402
from rollhpc.observability.metrics import read_metrics  # noqa: E402
from rollhpc.rundir.records import read_events  # noqa: E402
from rollhpc.testing.fault_injection import HOLD_IN_GRAD_SYNC, HOLD_IN_WEIGHT_SYNC  # noqa: E402

TYPES = ("random", "sync", "grad-sync", "batch-meanwhile", "batch-back", "world")
TARGETS = ("train", "batch", "any")
# one trainer rank per node (4 GPUs each)
TWO_TRAINERS = [
    "roles.train.procs=2",
    "roles.train.gpus_per_proc=4",
]


def reference_weights(model: Path, work: Path, *extra: str) -> str:
    """The final weights' sha256 of the same run left alone (a local world: the run is deterministic)."""
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", "quickstart", *run_args(model), *extra],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        raise RuntimeError(f"reference run failed: {res.stderr[-2000:]}")
    return read_metrics(work / "runs" / "quickstart" / "metrics.jsonl")[-1]["weights_sha256"]


def starts(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == "start"]


def starts_when_formed(run_dir: Path) -> list[str]:
    """The nodes of the run's first attempt, once its world has formed."""
    poll("the world", lambda: (run_dir / "world.json").exists() and starts(run_dir), 600, every=0.1)
    return starts(run_dir)[0]["nodes"]


def nodes_now(run_dir: Path) -> dict:
    """This attempt's train node(s), batch node and every node of the job."""
    world = json.loads((run_dir / "world.json").read_text())
    start = starts(run_dir)[-1]
    return {
        "train": sorted({w["host"] for w in world if w["role"] == "train"}),
        "batch": start["batch_host"],
        "all": start["nodes"],
        "world": world,
    }


def held_line(run_dir: Path, what: str) -> Path | None:
    """The rank log in which a test hook says it holds ``what``."""
    logs = run_dir / "logs"
    return (
        next((p for p in logs.glob("rank*.log") if what in p.read_text(errors="replace")), None)
        if logs.is_dir()
        else None
    )


class Round:
    """One round: the run, its crashes (each a row), and the waits between them."""

    def __init__(self, cluster: Cluster, work: Path, rng: random.Random):
        self.cluster, self.work, self.rng = cluster, work, rng
        self.run_dir = work / "runs" / "rq"
        self.rows: list[dict] = []

    def crash(self, host: str, down_s: float, target: str, back: bool = True) -> float:
        """Crash ``host`` and, unless ``back`` is False (the caller brings it back), start it ``down_s`` later;
        returns the time of the crash."""
        t = time.time()
        self.cluster.script("node-crash", str(self.cluster.dir), host)
        self.rows.append(
            {"step": last_step(self.run_dir), "target": target, "node": host, "down_s": down_s}
        )
        if back:
            time.sleep(down_s)
            self.cluster.script("node-start", str(self.cluster.dir), host)
        return t

    def recovered(self, t_fail: float, resumes: int) -> None:
        """Wait for the first training step after the next resume (none: the run had finished) into the row."""
        row = self.rows[-1]
        try:
            resume = poll(
                "the resume",
                lambda: (
                    event_after(self.run_dir, "resume", resumes)
                    or (
                        self.cluster.ended(self.run_dir)
                        and finished_run(self.run_dir)
                        and "finished"
                    )
                ),
                600,
                every=0.1,
            )
            if resume == "finished":
                row["recovery_s"] = None
            else:
                poll(
                    f"step {resume['step'] + 1}",
                    lambda: step_of_session(self.run_dir, resume["step"] + 1, resume["restarts"]),
                    300,
                )
                row["recovery_s"] = round(time.time() - t_fail, 1)
                row["resumed_from_step"] = resume["step"]
        except RuntimeError as e:
            row["error"] = str(e)
        print(f"  crash {json.dumps(row)}", flush=True)

    def resumes(self) -> int:
        return len([e for e in read_events(self.run_dir) if e["event"] == "resume"])

    # -- the round types ------------------------------------------------------------------------------
    def random(self, crashes: int, max_down: float) -> None:
        for step in sorted(self.rng.sample(range(2, STEPS + 1), crashes)):
            poll(
                f"step {step}",
                lambda: last_step(self.run_dir) >= step and (self.run_dir / "world.json").exists(),
                600,
            )
            nodes = nodes_now(self.run_dir)
            target = self.rng.choice(TARGETS)
            host = {
                "train": nodes["train"][0],
                "batch": nodes["batch"],
                "any": self.rng.choice(nodes["all"]),
            }[target]
            n = self.resumes()
            t = self.crash(host, round(self.rng.uniform(0, max_down), 1), target)
            self.recovered(t, n)
            if "error" in self.rows[-1]:
                return

    def held_collective(self, what: str) -> None:
        """The node of the rank a test hook holds in a collective dies; back after 2 s."""
        log = poll(what, lambda: held_line(self.run_dir, what), 600, every=0.1)
        rank = int(log.name.split("-")[0].removeprefix("rank"))
        host = nodes_now(self.run_dir)["world"][rank]["host"]
        n = self.resumes()
        t = self.crash(host, 2.0, f"rank {rank} in {what.split(' ', 2)[-1]}")
        self.recovered(t, n)

    def batch_meanwhile(self) -> None:
        poll(
            "step 3",
            lambda: last_step(self.run_dir) >= 3 and (self.run_dir / "world.json").exists(),
            600,
        )
        nodes = nodes_now(self.run_dir)
        n = self.resumes()
        t = self.crash(nodes["train"][0], 8.0, "train", back=False)
        time.sleep(0.3)
        self.crash(nodes["batch"], 8.0, "batch while the first is handled", back=False)
        time.sleep(8)
        for host in (nodes["batch"], nodes["train"][0]):
            self.cluster.script("node-start", str(self.cluster.dir), host)
        self.recovered(t, n)

    def batch_back(self) -> None:
        step = self.rng.randrange(2, STEPS - 1)
        poll(
            f"step {step}",
            lambda: last_step(self.run_dir) >= step and (self.run_dir / "world.json").exists(),
            600,
        )
        n = self.resumes()
        t = self.crash(nodes_now(self.run_dir)["batch"], 8.0, "batch")
        self.recovered(t, n)

    def world(self) -> None:
        step = self.rng.randrange(2, STEPS - 2)
        poll(
            f"step {step}",
            lambda: last_step(self.run_dir) >= step and (self.run_dir / "world.json").exists(),
            600,
        )
        attempts, n = len(starts(self.run_dir)), self.resumes()
        t = self.crash(nodes_now(self.run_dir)["train"][0], 2.0, "train")
        nxt = poll(
            "the restarted attempt",
            lambda: len(starts(self.run_dir)) > attempts and starts(self.run_dir)[-1],
            600,
            every=0.05,
        )
        host = [h for h in nxt["nodes"] if h != nxt["batch_host"]][0]
        formed = (self.run_dir / "world.json").exists()
        self.crash(
            host,
            8.0,
            "a node of the restarted attempt while its world forms"
            + (" (too late: it had formed)" if formed else ""),
        )
        self.recovered(t, n)


def spread(nodes: int) -> tuple[list[str], list[str]]:
    """The run's and the Slurm job's overrides that put the job on ``nodes`` nodes (module docstring); none for
    the small layout. The spread run scores 16 prompts x 8 samples a step, ~10 a reward rank, and its steps
    last long enough (~0.5 s) for a crash to land inside the run rather than after its last step."""
    if nodes <= 2:
        return [], []
    return (
        [f"roles.reward.procs={nodes - 3}", "pipeline.options.prompts_per_step=16"],
        ["cluster.cpu_component.cpus_per_node=1", f"cluster.nodes={nodes + 1}"],
    )


def one_round(
    cluster: Cluster,
    model: Path,
    work: Path,
    rng: random.Random,
    kind: str,
    crashes: int,
    max_down: float,
    references: dict[str, str],
    layout: list[str],
) -> dict:
    run_dir = work / "runs" / "rq"
    extra, env = ([], {})
    if kind == "sync":
        env = {HOLD_IN_WEIGHT_SYNC: f"{rng.randrange(3, STEPS)}:120"}
    elif kind == "grad-sync":
        extra, env = TWO_TRAINERS, {HOLD_IN_GRAD_SYNC: f"{rng.randrange(3, STEPS)}:120"}
    job_id = submit(cluster, model, work, *layout, *extra, env=env)
    if layout:
        print(f"  job {job_id} on {len(starts_when_formed(run_dir))} nodes", flush=True)
    r = Round(cluster, work, rng)
    try:
        if kind == "random":
            r.random(crashes, max_down)
        elif kind == "sync":
            r.held_collective(f"holding the weight sync {env[HOLD_IN_WEIGHT_SYNC].split(':')[0]} ")
        elif kind == "grad-sync":
            r.held_collective(
                f"holding the gradient all-reduce of train call {env[HOLD_IN_GRAD_SYNC].split(':')[0]} "
            )
        elif kind == "batch-meanwhile":
            r.batch_meanwhile()
        elif kind == "batch-back":
            r.batch_back()
        else:
            r.world()
        state = poll("the run's job to end", lambda: cluster.ended(run_dir), 900, every=0.5)
    except RuntimeError as e:
        r.rows.append({"error": str(e)})
        state = cluster.job_state(current_job(run_dir))
        subprocess.run(
            ["scancel", current_job(run_dir), job_id, *rescue_jobs(run_dir).values()],
            env=cluster.env,
            capture_output=True,
            timeout=60,
        )
    metrics = (
        read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    )
    events = read_events(run_dir)
    reference = references["two-trainers" if kind == "grad-sync" else "one-trainer"]
    # finished by the run's own record (a clean controller exit, or its last step's checkpoint): a node lost after
    # the last step ends the job NODE_FAIL, and nothing is started again
    return {
        "type": kind,
        "job_state": state,
        "finished": bool(finished_run(run_dir)),
        "crashes": r.rows,
        "steps_once": [m["step"] for m in metrics] == list(range(STEPS + 1)),
        "weights_match": bool(metrics) and metrics[-1].get("weights_sha256") == reference,
        "attempts": sum(e["event"] == "start" for e in events),
        "restarts": [
            {
                "by": e.get("by", "batch script"),
                "reason": e.get("reason"),
                "failure": (e.get("failure") or {}).get("kind"),
            }
            for e in events
            if e["event"] == "requeue"
        ],
        "released_by_hand": [e for e in events if e["event"] == "release"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument(
        "--types", default=",".join(TYPES), help=f"round types to mix (of {', '.join(TYPES)})"
    )
    p.add_argument("--crashes", type=int, default=2, help="node crashes per random round")
    p.add_argument(
        "--max-down",
        type=float,
        default=20.0,
        help="a crashed node's slurmd returns within this (s)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=2,
        help="nodes the job spans (module docstring); 3 or more adds "
        "a reward rank per node beyond 3",
    )
    p.add_argument(
        "--slurm-dir", type=Path, help="a running local-cluster.sh directory (default: start one)"
    )
    p.add_argument(
        "--out",
        type=Path,
        help="default: bench/results/chaos.json, chaos_<N>_nodes.json with --nodes N > 2",
    )
    args = p.parse_args()
    if args.nodes < 2:
        p.error("--nodes must be >= 2")
    if not 1 <= args.crashes < STEPS:
        p.error(f"--crashes must be between 1 and {STEPS - 1}")
    args.out = args.out or HERE / "results" / (
        "chaos.json" if args.nodes <= 2 else f"chaos_{args.nodes}_nodes.json"
    )
    types = args.types.split(",")
    if unknown := set(types) - set(TYPES):
        p.error(f"unknown round type(s) {sorted(unknown)}; known: {', '.join(TYPES)}")

    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    rng = random.Random(args.seed)
    # every type once per len(types) rounds, in a seeded order
    plan = [t for _ in range(-(-args.rounds // len(types))) for t in rng.sample(types, len(types))][
        : args.rounds
    ]
    root = Path(tempfile.mkdtemp(prefix="rollhpc-bench-chaos-"))
    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    model = create_tiny_model(
        root / "tiny", TinyModelConfig(), build_tokenizer(list(arithmetic.corpus(train)), 300)
    )
    references = {}
    for name, extra in (("one-trainer", []), ("two-trainers", TWO_TRAINERS)):
        if name == "one-trainer" or "grad-sync" in plan:
            (root / f"reference-{name}").mkdir()
            references[name] = reference_weights(
                model,
                root / f"reference-{name}",
                *spread(args.nodes)[0],
                *[x.replace("gpus_per_proc=4", "gpus_per_proc=0") for x in extra],
            )
    cluster = Cluster(args.slurm_dir, nodes=max(4, args.nodes + 4))
    # rollhpc's own Slurm calls in this process reach the bench's cluster
    os.environ.update(cluster.env)
    rounds = []
    try:
        for i, kind in enumerate(plan):
            work = root / f"round-{i}"
            work.mkdir()
            print(f"round {i} ({kind}):", flush=True)
            result = one_round(
                cluster,
                model,
                work,
                rng,
                kind,
                args.crashes,
                args.max_down,
                references,
                [x for part in spread(args.nodes) for x in part],
            )
            print(
                f"round {i}: {json.dumps({k: v for k, v in result.items() if k != 'crashes'})}",
                flush=True,
            )
            rounds.append(result)
            for host in {c["node"] for c in result["crashes"] if "node" in c}:
                try:  # nothing of the round left on the cluster before the next
                    cluster.settle(host)
                except (
                    RuntimeError
                ) as e:  # a component that stays COMPLETING on a node that came back
                    print(f"  settle: {e}; the next round goes on", flush=True)
    finally:
        cluster.down()
    ok = [
        r["finished"]
        and r["steps_once"]
        and r["weights_match"]
        and not r["released_by_hand"]
        and not any("error" in c for c in r["crashes"])
        for r in rounds
    ]
    times = [
        c["recovery_s"] for r in rounds for c in r["crashes"] if c.get("recovery_s") is not None
    ]
    summary = {
        "rounds_ok": sum(ok),
        "rounds": len(rounds),
        "types": {t: plan.count(t) for t in types},
        "recovery_s_median": statistics.median(times) if times else None,
        "recovery_s_max": max(times) if times else None,
        "crashes_timed": len(times),
    }
    result = {
        "benchmark": "chaos",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": commit(),
        "seed": args.seed,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {
            "job_nodes": args.nodes,
            "cluster_nodes": max(4, args.nodes + 4),
            "layout_overrides": [x for part in spread(args.nodes) for x in part],
            "crashes_per_random_round": args.crashes,
            "max_down_s": args.max_down,
            "steps": STEPS,
            "checkpoint_every": 2,
            "slurmd_timeout_s": 5,
            "manual_steps": "none",
        },
        "summary": summary,
        "rounds": rounds,
    }
    write_result(args.out, result)
    print(
        f"{summary['rounds_ok']}/{summary['rounds']} rounds finished with every step once, the "
        f"uninterrupted weights and no manual step; recovery median {summary['recovery_s_median']} s, worst "
        f"{summary['recovery_s_max']} s ({summary['crashes_timed']} crashes timed)"
    )
    print(f"results: {args.out}")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
