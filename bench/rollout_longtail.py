"""Sample-level rollout scheduling vs a batch barrier, on a long-tail mix of response lengths.

One real vLLM engine (tiny Qwen2 model, CPU, ``ignore_eos`` so every response has exactly its drawn
length) serves K batches of G prompt groups x S samples. Lengths are long-tailed, as reasoning traces
are: most responses are short, a few are very long (``--short``, ``--long``, ``--long-frac``).

  barrier   every batch: all G*S requests start together, the batch ends when the LAST one finishes,
            then all are scored (the reward stage waits for generation, generation for the reward).
  sample    rollhpc's scheduler: requests start one by one up to the engine's capacity, each finished
            sample is scored at once, (1 + oversample) x G groups run, the batch ends as soon as G groups
            are complete and the rest is aborted (discarded).
  partial   the same, with partial rollout: aborted samples keep their tokens and resume in the next batch.

Reported per mode: wall time for K batches, generator idle fraction (time the engine is not stepping),
slot idle fraction (1 - mean running requests / capacity, time-weighted: the cost of the tail), tokens
generated and tokens thrown away. Both modes use the same engine calls (``drive_engine``), prompts,
lengths and seeds. Results: bench/results/rollout_longtail.json.

    python bench/rollout_longtail.py [--batches 4] [--groups 16] [--group-size 4] [--capacity 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


class MeteredEngine:
    """Wraps the engine's step() to record time-weighted occupancy (running requests per step)."""

    def __init__(self, engine, capacity: int):
        self.engine, self.capacity = engine, capacity
        self.busy_s = 0.0
        self.slot_seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        running = self.engine.num_unfinished()
        t = time.perf_counter()
        out = self.engine.step()
        dt = time.perf_counter() - t
        self.busy_s += dt
        self.slot_seconds += dt * min(running, self.capacity)
        return out


def lengths(
    rng: random.Random, n: int, short: tuple[int, int], long: tuple[int, int], long_frac: float
) -> list[int]:
    return [
        rng.randint(*long) if rng.random() < long_frac else rng.randint(*short) for _ in range(n)
    ]


def run_barrier(engine: MeteredEngine, prompts, args) -> dict:
    from rollhpc.rollout.ports import GenerationRequest
    from rollhpc.workers.vllm_generate import drive_engine

    t0 = time.perf_counter()
    tokens = 0
    for b in range(args.batches):
        batch = prompts[b * args.groups : (b + 1) * args.groups]
        adds = [
            GenerationRequest(f"{p.uid}.{i}", list(p.tokens), p.max_tokens, p.uid * 100 + i)
            for p in batch
            for i in range(args.group_size)
        ]
        pending = len(adds)
        done = []
        while pending:  # the barrier: nothing moves on until the last request of the batch is back
            reply = drive_engine(
                engine, adds, [], temperature=1.0, top_p=1.0, max_wait_s=0.05, ignore_eos=True
            )
            adds = []
            pending -= len(reply.finished)
            done += reply.finished
        tokens += sum(len(c.token_ids) for _, c in done)
        _score([c.token_ids for _, c in done])
    wall = time.perf_counter() - t0
    return _summary(engine, wall, tokens, 0, args)


def run_scheduler(engine: MeteredEngine, prompts, args, partial: bool, weights: dict) -> dict:
    from rollhpc.rollout.ports import Done
    from rollhpc.rollout.scheduler import RolloutScheduler
    from rollhpc.rollout.scheduler_config import SchedulerConfig
    from rollhpc.workers.vllm_generate import drive_engine

    class Port:
        def submit(self, adds, aborts):
            return Done(
                drive_engine(
                    engine,
                    adds,
                    aborts,
                    temperature=1.0,
                    top_p=1.0,
                    max_wait_s=0.05,
                    ignore_eos=True,
                )
            )

    class Reward:
        def submit(self, items):
            return Done(_score([resp for _, resp in items]))

    config = SchedulerConfig(
        group_size=args.group_size,
        max_tokens=max(args.long),
        max_inflight_per_generator=args.capacity,
        oversample=args.oversample,
        dynamic_sampling=False,
        partial_rollout=partial,
        max_staleness=1 if partial else 0,
    )
    sched = RolloutScheduler([Port()], [Reward()], config, seed=0)
    stream = iter(prompts)
    t0 = time.perf_counter()
    used = wasted = 0
    for b in range(args.batches):
        groups, stats = sched.collect(stream, args.groups, version=b)
        used += sum(len(s.response) for g in groups for s in g)
        wasted += stats.tokens_discarded
        # what a weight sync does to the engine between batches
        engine.engine.update_weights(weights.items(), version=b + 1)
    wall = time.perf_counter() - t0
    out = _summary(engine, wall, used, wasted, args)
    out["mean_response_len_used"] = used / (args.batches * args.groups * args.group_size)
    return out


def _score(responses) -> list[float]:
    return [float(len(r) % 2) for r in responses]


def _summary(
    engine: MeteredEngine, wall: float, used_tokens: int, wasted_tokens: int, args
) -> dict:
    return {
        "wall_s": round(wall, 3),
        "generator_idle_fraction": round(1 - engine.busy_s / wall, 4),
        "slot_idle_fraction": round(1 - engine.slot_seconds / (engine.capacity * wall), 4),
        "tokens_used": used_tokens,
        "tokens_discarded": wasted_tokens,
        "batches": args.batches,
        "samples_per_batch": args.groups * args.group_size,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=64, help="requests the engine runs at once")
    ap.add_argument("--oversample", type=float, default=0.5)
    ap.add_argument("--short", type=int, nargs=2, default=(8, 32))
    ap.add_argument("--long", type=int, nargs=2, default=(160, 240))
    ap.add_argument("--long-frac", type=float, default=0.1)
    ap.add_argument(
        "--model-dir", type=Path, help="HF checkpoint (default: a fresh tiny random model)"
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "rollout_longtail.json")
    args = ap.parse_args()

    from rollhpc.engines.vllm_engine import VllmGenerator
    from rollhpc.rollout.types import Prompt

    model_dir = args.model_dir
    if model_dir is None:
        from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
        from rollhpc.tasks import arithmetic

        train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
        model_dir = create_tiny_model(
            Path(tempfile.mkdtemp()) / "tiny",
            TinyModelConfig(max_position_embeddings=512),
            build_tokenizer(list(arithmetic.corpus(train)), 300),
        )
    engine = VllmGenerator(
        model_dir,
        max_model_len=max(args.long) + 16,
        cpu_kv_cache_bytes=256 << 20,
        dtype="float32",
        max_num_seqs=args.capacity,
    )
    from safetensors.torch import load_file

    # "synced" between batches, unchanged
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    rng = random.Random(0)
    n_prompts = args.batches * args.groups * 8  # the scheduler may start more groups than it keeps
    lens = lengths(rng, n_prompts, tuple(args.short), tuple(args.long), args.long_frac)
    prompts = [
        Prompt(i, (5, 6, 7, 10 + i % 50), None, max_tokens=lens[i]) for i in range(n_prompts)
    ]
    # warm up the engine (first steps allocate and compile)
    engine.generate([[1, 2, 3]], max_tokens=4, temperature=0.0)
    results = {}
    for mode in ("barrier", "sample", "partial"):
        metered = MeteredEngine(engine, args.capacity)
        results[mode] = (
            run_barrier(metered, prompts, args)
            if mode == "barrier"
            else run_scheduler(metered, prompts, args, partial=mode == "partial", weights=weights)
        )
        print(
            f"{mode:8s} wall {results[mode]['wall_s']:7.2f} s  generator idle {results[mode]['generator_idle_fraction']:.3f}"
            f"  slot idle {results[mode]['slot_idle_fraction']:.3f}  tokens used {results[mode]['tokens_used']}"
            f"  discarded {results[mode]['tokens_discarded']}",
            flush=True,
        )
    report = {
        "settings": {
            k: (list(v) if isinstance(v, tuple) else str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "results": results,
        "speedup_sample_vs_barrier": round(
            results["barrier"]["wall_s"] / results["sample"]["wall_s"], 3
        ),
        "speedup_partial_vs_barrier": round(
            results["barrier"]["wall_s"] / results["partial"]["wall_s"], 3
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
