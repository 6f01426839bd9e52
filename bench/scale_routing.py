"""How many per-sample messages the single controller routes per second as the generators grow (issue 36):
the real rollout scheduler on rank 0 driving N generator ranks and N/8 reward ranks whose work is scripted (no
model), so what is timed is the controller: its sends, its polls over the replies, its bookkeeping per sample.

    python bench/scale_routing.py [--ranks 8,32,128] [--steps 5] [--own-core] [--out bench/results/scale_routing.json]

Each world is `rollhpc train` of a config written here (local mpiexec, MPICH, oversubscribed). A step is one
`RolloutScheduler.collect` of 4 x N groups of 8 samples (32 samples per generator), 16 tokens each: the scheduler
hands each generator up to `max_inflight_per_generator` requests, a generator's call returns at once with the 2
oldest of the requests it holds finished (tokens and log-probs made up; a real engine's call returns when a
request or two finish), and finished samples are scored by the reward ranks in the calls the scheduler makes. Measured per N, the median over --steps (after one
warm-up step): the step's wall seconds, the controller's CPU seconds in it, the calls it made (generator and reward)
and the calls and samples per second. The generators answer instantly, so the rate is the controller's ceiling:
real generators take seconds per call, and the step time of a real run is theirs unless this ceiling is near.

``--own-core``: rank 0 runs alone on CPU 0 and every other rank on the other CPUs (sched_setaffinity), so the
controller's CPU per sample is its own work and not what taking turns with N processes on one core adds (cache
refills, its polls waiting for a core); its default output is then bench/results/scale_routing_own_core.json.
What it showed (``own_core_tried`` in results/scale_routing.json): rank 0 then polls for replies the whole time
the other ranks take turns on their core, so its CPU seconds are its polling, not its routing work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from rollhpc.engines.completion import Completion  # noqa: E402
from rollhpc.protocol.pipeline import Pipeline  # noqa: E402
from rollhpc.protocol.worker import Dispatch, Worker, register  # noqa: E402
from rollhpc.rollout.ports import GenerationReply, GenerationRequest  # noqa: E402
from rollhpc.rundir import atomic_write_json  # noqa: E402

OWN_CORE = "ROUTING_OWN_CORE"  # set: rank 0 on CPU 0, the other ranks on the rest
GROUP_SIZE = 8
GROUPS_PER_GENERATOR = 4
RESPONSE_TOKENS = 16
FINISH_PER_CALL = 2  # requests a generator call finishes (the rest stay in flight)


def pin(controller: bool) -> None:
    """With OWN_CORE set: the controller to CPU 0, any other rank to the CPUs but 0."""
    cpus = sorted(os.sched_getaffinity(0))
    if os.environ.get(OWN_CORE) and len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[0]} if controller else set(cpus[1:]))


class ScriptedGenerateWorker(Worker):
    """A generator rank without a model: each call finishes the FINISH_PER_CALL oldest requests it holds (as a
    real engine's call returns once a request or two of its batch finish), at once."""

    def __init__(self, ctx: Any, options: Any):
        super().__init__(ctx, options)
        pin(controller=False)
        self.live: dict[str, GenerationRequest] = {}

    @register(Dispatch.ONE_TO_ALL)
    def rollout(self, adds: list[GenerationRequest], aborts: list[str]) -> GenerationReply:
        aborted = [
            (rid, Completion([], [], "abort", 0)) for rid in aborts if self.live.pop(rid, None)
        ]
        self.live.update((r.id, r) for r in adds)
        finished = []
        for rid in list(self.live)[:FINISH_PER_CALL]:
            r = self.live.pop(rid)
            n = min(r.max_tokens, RESPONSE_TOKENS)
            finished.append(
                (
                    rid,
                    Completion(
                        [(len(r.prompt) + i) % 97 + 3 for i in range(n)], [-0.5] * n, "length", 0
                    ),
                )
            )
        return GenerationReply(finished=finished, aborted=aborted)


class ScriptedRewardWorker(Worker):
    """A reward rank without a verifier: 1 for responses whose first token is even (groups are mixed)."""

    def __init__(self, ctx: Any, options: Any):
        super().__init__(ctx, options)
        pin(controller=False)

    @register(Dispatch.DP_SPLIT)
    def score(self, items: list[tuple[Any, list[int]]]) -> list[float]:
        return [float((example + len(ids)) % 2) for example, ids in items]


class _Counted:
    """A port that counts its calls."""

    def __init__(self, port: Any, counter: dict[str, int], key: str):
        self.port, self.counter, self.key = port, counter, key

    def submit(self, *args: Any) -> Any:
        self.counter[self.key] += 1
        return self.port.submit(*args)


class RoutingBench(Pipeline):
    """Rank 0: ``steps`` + 1 collects through the real scheduler; RUN_DIR/bench.json holds each step's numbers."""

    @dataclass(kw_only=True)
    class Options:
        steps: int = 5

    def run(self) -> None:
        from rollhpc.rollout.scheduler import RolloutScheduler
        from rollhpc.rollout.scheduler_config import SchedulerConfig
        from rollhpc.rollout.types import Prompt

        pin(controller=True)
        gen, rew = self.workers["generate"], self.workers["reward"]
        calls = {"generate": 0, "reward": 0}
        generators = [_Counted(gen.at(i).rollout, calls, "generate") for i in range(len(gen))]
        rewards = [_Counted(rew.at(i).score, calls, "reward") for i in range(len(rew))]
        config = SchedulerConfig(
            group_size=GROUP_SIZE,
            max_tokens=RESPONSE_TOKENS,
            max_inflight_per_generator=64,
            oversample=0.0,
            dynamic_sampling=False,
        )
        scheduler = RolloutScheduler(generators, rewards, config, seed=0)
        uids = count()

        def prompts():
            while True:
                uid = next(uids)
                yield Prompt(uid=uid, tokens=tuple(range(3, 3 + 8 + uid % 5)), example=uid)

        stream = prompts()
        n_groups = GROUPS_PER_GENERATOR * len(gen)
        steps = []
        profiler = None
        if os.environ.get("ROUTING_PROFILE"):  # where rank 0's time goes: RUN_DIR/profile.txt
            import cProfile

            profiler = cProfile.Profile()
        for step in range(self.options.steps + 1):
            if profiler is not None and step == 1:
                profiler.enable()
            before = dict(calls)
            cpu, t = time.process_time(), time.perf_counter()
            groups, _ = scheduler.collect(stream, n_groups, version=0)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
            assert len(groups) == n_groups and all(len(g) == GROUP_SIZE for g in groups)
            if step:  # step 0 warms up
                steps.append(
                    {
                        "wall_s": wall,
                        "controller_cpu_s": cpu,
                        "samples": n_groups * GROUP_SIZE,
                        **{f"{k}_calls": calls[k] - before[k] for k in calls},
                    }
                )
        if profiler is not None:
            import io
            import pstats

            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            (self.run_ctx.run_dir / "profile.txt").write_text(text.getvalue())
        atomic_write_json(
            self.run_ctx.run_dir / "bench.json",
            {"generators": len(gen), "reward_ranks": len(rew), "steps": steps},
        )


def run_world(n: int, work: Path, steps: int, own_core: bool = False) -> dict:
    import yaml

    name = f"routing-n{n}"
    cfg = {
        "run": {"name": name, "output_dir": str(work)},
        "pipeline": {"entry": "scale_routing:RoutingBench", "options": {"steps": steps}},
        "roles": {
            "generate": {"worker": "scale_routing:ScriptedGenerateWorker", "procs": n},
            "reward": {"worker": "scale_routing:ScriptedRewardWorker", "procs": max(1, n // 8)},
        },
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(REPO)]))
    if own_core:
        env[OWN_CORE] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "rollhpc.cli", "train", str(path), "--overwrite"],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    bench = work / name / "bench.json"
    if res.returncode != 0 or not bench.is_file():
        raise RuntimeError(
            f"routing world of {n} generators failed (exit {res.returncode}):\n{res.stderr[-3000:]}"
        )
    b = json.loads(bench.read_text())
    if (work / name / "profile.txt").is_file():
        print((work / name / "profile.txt").read_text()[:6000])
    rows = b["steps"]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    calls = [r["generate_calls"] + r["reward_calls"] for r in rows]
    return {
        "generators": b["generators"],
        "reward_ranks": b["reward_ranks"],
        "samples_per_step": rows[0]["samples"],
        "step_s": med("wall_s"),
        "controller_cpu_s": med("controller_cpu_s"),
        "generate_calls": med("generate_calls"),
        "reward_calls": med("reward_calls"),
        "calls_per_s": statistics.median(c / r["wall_s"] for c, r in zip(calls, rows)),
        "samples_per_s": statistics.median(r["samples"] / r["wall_s"] for r in rows),
        "steps": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ranks", default="8,32,128", help="generator ranks per world, comma-separated"
    )
    ap.add_argument(
        "--steps", type=int, default=5, help="timed collects per world (after one warm-up)"
    )
    ap.add_argument(
        "--own-core", action="store_true", help="rank 0 alone on CPU 0, the other ranks on the rest"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.out = (
        args.out or HERE / "results" / f"scale_routing{'_own_core' if args.own_core else ''}.json"
    )
    from bench.provenance import commit, write_result

    results = {}
    with tempfile.TemporaryDirectory(prefix="scale_routing_") as tmp:
        for n in (int(x) for x in args.ranks.split(",")):
            t = time.perf_counter()
            results[str(n)] = run_world(n, Path(tmp), args.steps, args.own_core)
            r = results[str(n)]
            print(
                f"[routing] N={n}: step {r['step_s']:.3f} s for {r['samples_per_step']} samples, "
                f"{r['calls_per_s']:.0f} calls/s, {r['samples_per_s']:.0f} samples/s, controller CPU "
                f"{r['controller_cpu_s']:.3f} s ({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
    out = {
        "what": __doc__.split("\n\n")[0],
        "commit": commit(),
        "machine": f"{os.cpu_count()} cores, local mpiexec",
        "own_core": args.own_core,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results,
    }
    write_result(args.out, out)
    print(f"[routing] wrote {args.out}")


if __name__ == "__main__":
    main()
