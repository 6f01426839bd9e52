"""Runs the rollout scheduler against a real in-process vLLM engine (tiny random model) and prints
what it saw as JSON: run in a subprocess by tests/world/test_rollout_scheduler.py (vLLM configures the
process it lives in)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model_dir: str) -> None:
    from rollhpc.engines.vllm_engine import VllmGenerator
    from rollhpc.rollout.ports import Done
    from rollhpc.rollout.scheduler import RolloutScheduler
    from rollhpc.rollout.scheduler_config import SchedulerConfig
    from rollhpc.rollout.types import Prompt
    from rollhpc.workers.engine_loop import EngineLoop

    engine = VllmGenerator(model_dir, max_model_len=128, cpu_kv_cache_bytes=32 << 20)
    # as the generate role steps it
    loop = EngineLoop(engine, temperature=1.0, top_p=1.0, ignore_eos=True)

    class EnginePort:
        def submit(self, adds, aborts):
            return Done(loop.call(adds, aborts, max_wait_s=0.05))

    class RewardPort:  # odd prompts always score 0 (uniform groups); even ones by the first token's parity
        def submit(self, items):
            return Done([float(uid % 2 == 0 and resp[0] % 2 == 0) for uid, resp in items])

    def prompts(lengths):
        uid = 0
        while True:
            for n in lengths:
                yield Prompt(uid, (5, 6, 7, uid % 50 + 10), uid, max_tokens=n)
                uid += 1

    out = {}
    # A: dynamic sampling keeps only groups with differing rewards
    sched = RolloutScheduler(
        [EnginePort()],
        [RewardPort()],
        SchedulerConfig(group_size=4, max_tokens=6, oversample=0.5, dynamic_sampling=True),
        seed=1,
    )
    groups, stats = sched.collect(prompts([6]), 4, version=0)
    out["A"] = {
        "uids": [g[0].prompt.uid for g in groups],
        "sizes": [len(g) for g in groups],
        "rewards": [[s.reward for s in g] for g in groups],
        "indices": [[s.index for s in g] for g in groups],
        "lens": sorted({len(s.response) for g in groups for s in g}),
        "logprob_lens_ok": all(len(s.logprobs) == len(s.response) for g in groups for s in g),
        "versions": sorted({s.version for g in groups for s in g}),
        "dropped": stats.groups_dropped_uniform,
        "unfinished": engine.num_unfinished(),
        "idle": stats.generator_idle_fraction,
    }
    # B: long-tail lengths, batch fills from the short ones, the long ones are aborted
    cfg = SchedulerConfig(group_size=2, max_tokens=40, oversample=1.0, dynamic_sampling=False)
    sched = RolloutScheduler([EnginePort()], [RewardPort()], cfg, seed=2)
    groups, stats = sched.collect(prompts([40, 3, 3, 3]), 2, version=0)
    out["B"] = {
        "lens": [[len(s.response) for s in g] for g in groups],
        "aborted": stats.samples_aborted,
        "unfinished": engine.num_unfinished(),
        "started": stats.groups_started,
    }
    # C: partial rollout: aborted partials resume under the next version; their tokens are kept
    cfg = SchedulerConfig(
        group_size=2,
        max_tokens=40,
        oversample=1.0,
        dynamic_sampling=False,
        partial_rollout=True,
        max_staleness=1,
    )
    sched = RolloutScheduler([EnginePort()], [RewardPort()], cfg, seed=3)
    stream = prompts([40, 3, 3, 3])
    first, s1 = sched.collect(stream, 2, version=0)
    partial_lens = sorted(len(s.response) for s in sched.carry_partials)
    buffered = len(sched.buffer)  # short groups that finished after the batch was full
    sched.buffer = []
    from safetensors.torch import load_file

    with loop.lock:
        engine.update_weights(
            load_file(str(Path(model_dir) / "model.safetensors")).items(), version=1
        )
    # no new prompts: it must finish the carried group
    second, s2 = sched.collect(iter(()), 1, version=1)
    resumed = [s for g in second for s in g if s.resumes > 0]
    out["C"] = {
        "partial_lens": partial_lens,
        "buffered": buffered,
        "resumed": s2.samples_resumed,
        "resumed_lens": [len(s.response) for s in resumed],
        "resumed_versions": [s.version for s in resumed],
        "resumed_logprobs_ok": all(len(s.logprobs) == len(s.response) for s in resumed),
        "second_uids": [g[0].prompt.uid for g in second],
        "carried_after": len(sched.carry),
        "unfinished": engine.num_unfinished(),
    }
    # D: groups left in the buffer go stale
    sched.buffer = [g for g in second]
    _, s3 = sched.collect(stream, 1, version=3)
    out["D"] = {"stale": s3.groups_dropped_stale, "buffer_left": len(sched.buffer)}
    loop.close()
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
