"""Runs VllmGenerator once for tests/world/test_vllm_engine.py and writes what it saw as JSON.

    python tests/support/vllm_engine_probe.py SPEC.json RESULT.json

SPEC names two checkpoints (a, b) and the prompts; the test owns every comparison. vLLM needs a
``__main__`` guard and ~20 s to start, so one process runs all the checks on one engine. With
``"engine_process": "separate"`` in SPEC it runs the shorter GPU-default checks instead (``separate``): the engine
core in a process of its own, compiled, unseeded.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path


def checkpoint_tensors(model_dir: str):
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def greedy(engine, prompts, max_tokens):
    out = engine.generate(
        prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=None, ignore_eos=True
    )
    return [
        {
            "token_ids": c[0].token_ids,
            "logprobs": c[0].logprobs,
            "finish_reason": c[0].finish_reason,
        }
        for c in out
    ]


def engine_config(engine) -> dict:
    """What vLLM itself was built with (its config, as the client process holds it) and what the engine chose."""
    config = engine.llm.llm_engine.vllm_config
    return {
        "enforce_eager": config.model_config.enforce_eager,
        "compilation_mode": config.compilation_config.mode.name,
        "engine_core_client": type(engine.llm.llm_engine.engine_core).__name__,
        "weight_transfer": engine.weight_transfer,
        "choices": asdict(engine.choices),
    }


def separate(spec: dict) -> dict:
    """The GPU defaults forced on CPU: the engine core in its own process (and vLLM's worker in a third), compiled
    (dynamo with its eager backend: VLLM_CPU_CI_ENV spares inductor's C++ build), requests unseeded. Generation,
    the step API with abort, and a weight update through the weight-transfer protocol."""
    from rollhpc.engines.vllm_engine import VllmGenerator

    os.environ["VLLM_CPU_CI_ENV"] = "1"
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    t0 = time.perf_counter()
    engine = VllmGenerator(
        spec["model_a"],
        seed=0,
        max_model_len=256,
        cpu_kv_cache_bytes=64 << 20,
        dtype="float32",
        enforce_eager=False,
        seeded_sampling=False,
        engine_process="separate",
    )
    res: dict = {"start_s": time.perf_counter() - t0, "engine_config": engine_config(engine)}
    res["greedy_a"] = greedy(engine, prompts, max_tokens)

    def sample(seed):
        out = engine.generate(prompts, n=2, temperature=1.0, max_tokens=max_tokens, seed=seed)
        return [[c.token_ids for c in per_prompt] for per_prompt in out]

    res["sample_seed7"], res["sample_seed7_again"] = sample(7), sample(7)
    engine.add_request(
        "cut", prompts[0], temperature=0.0, max_tokens=max_tokens, seed=3, ignore_eos=True
    )
    for _ in range(4):
        engine.step()
    ((_, partial),) = engine.abort(["cut"])
    res["partial"] = as_dict(partial)
    t0 = time.perf_counter()
    engine.update_weights(checkpoint_tensors(spec["model_b"]), version=1)
    res["update_weights_s"] = time.perf_counter() - t0
    res["greedy_b"] = greedy(engine, prompts, max_tokens)
    engine.sleep()
    engine.wake_up()
    res["greedy_b_after_wake"] = greedy(engine, prompts[:1], max_tokens)
    return res


def as_dict(c) -> dict:
    return {
        "token_ids": c.token_ids,
        "logprobs": c.logprobs,
        "finish_reason": c.finish_reason,
        "version": c.version,
    }


def error(call) -> str:
    """The exception type ``call()`` raises, or "none"."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test compares the type name
        return type(e).__name__
    return "none"


def step_api(engine, prompts, max_tokens, weights_a) -> dict:
    """add_request / step / abort on the engine holding a's weights (version 2)."""
    res: dict = {}
    greedy = {"temperature": 0.0, "max_tokens": max_tokens}

    # Requests added one by one with a step after each (later ones join a running batch), then
    # driven to the end with run_until; with and without EOS.
    for key, ignore_eos in (("greedy", True), ("greedy_eos", False)):
        done = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{key}-{i}", prompt, ignore_eos=ignore_eos, **greedy)
            done.update(engine.step())
        while engine.num_unfinished():
            done.update(engine.run_until(min_finished=1))
        res[key] = [as_dict(done[f"{key}-{i}"]) for i in range(len(prompts))]

    # Each request comes back from the step it finishes in.
    engine.add_request("short", prompts[0], temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("long", prompts[1], temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    res["unfinished_ids"] = engine.unfinished_ids()
    finished_at, lengths, step = {}, {}, 0
    while engine.num_unfinished() and step < 100:
        for rid, c in engine.step():
            finished_at[rid], lengths[rid] = step, len(c.token_ids)
        step += 1
    res["finished_at"], res["lengths"] = finished_at, lengths

    # Abort mid-way, keep the partial, swap in (the same) weights as version 3, resume from the
    # partial: a partial rollout whose two halves carry different versions.
    engine.add_request("cut", prompts[0], ignore_eos=True, **greedy)
    res["cut_before_abort"] = [rid for _ in range(4) for rid, _ in engine.step()]
    aborted = engine.abort(["cut", "never-added"])
    res["aborted_ids"] = [rid for rid, _ in aborted]
    res["partial"] = as_dict(aborted[0][1])
    res["abort_again"] = [rid for rid, _ in engine.abort(["cut"])]
    res["unfinished_after_abort"] = [
        engine.num_unfinished(),
        engine.llm.llm_engine.get_num_unfinished_requests(),
        engine.llm.llm_engine.has_unfinished_requests(),
    ]
    engine.update_weights(weights_a, version=3)
    partial = res["partial"]["token_ids"]
    engine.add_request(
        "resume",
        prompts[0] + partial,
        temperature=0.0,
        max_tokens=max_tokens - len(partial),
        ignore_eos=True,
    )
    ((rid, resumed),) = engine.run_until(min_finished=1)
    res["resumed"] = as_dict(resumed)

    # Misuse: a live id again, and calls that need an idle engine.
    engine.add_request("dup", prompts[0], **greedy)
    res["errors"] = {
        "duplicate": error(lambda: engine.add_request("dup", prompts[1], **greedy)),
        "update_weights": error(lambda: engine.update_weights(weights_a, version=4)),
        "generate": error(lambda: engine.generate(prompts[:1], max_tokens=2)),
        "sleep": error(lambda: engine.sleep()),
    }
    res["version_after_refused_update"] = engine.version
    res["dup_aborted"] = [rid for rid, _ in engine.abort(["dup"])]
    return res


def main(spec_path: str, result_path: str) -> None:
    from rollhpc.engines.vllm_engine import VllmGenerator

    spec = json.loads(Path(spec_path).read_text())
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    res: dict = {}

    t0 = time.perf_counter()
    engine = VllmGenerator(
        spec["model_a"], seed=0, max_model_len=256, cpu_kv_cache_bytes=64 << 20, dtype="float32"
    )
    res["start_s"] = time.perf_counter() - t0
    res["engine_config"] = engine_config(engine)
    from vllm.v1.sample import sampler

    res["sampler_rank_compiled"] = hasattr(
        sampler.batched_count_greater_than, "_torchdynamo_orig_callable"
    )
    t0 = time.perf_counter()
    res["greedy_a"] = greedy(engine, prompts, max_tokens)
    res["first_generate_s"] = time.perf_counter() - t0

    def sample(seed):
        out = engine.generate(
            prompts, n=4, temperature=1.0, top_p=0.9, max_tokens=max_tokens, seed=seed
        )
        return [
            [{"token_ids": c.token_ids, "logprobs": c.logprobs} for c in per_prompt]
            for per_prompt in out
        ]

    res["sample_seed7"], res["sample_seed7_again"], res["sample_seed8"] = (
        sample(7),
        sample(7),
        sample(8),
    )

    # Stops at the EOS id the test wrote into generation_config.json.
    out = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
    res["greedy_eos"] = [
        {"token_ids": c[0].token_ids, "finish_reason": c[0].finish_reason} for c in out
    ]

    # Throughput: 64 prompts x 32 new tokens in one batch, timed on the second run (the first one
    # meets new batch shapes).
    batch = [prompts[i % len(prompts)] + [i + 1] for i in range(64)]
    for _ in range(2):
        t0 = time.perf_counter()
        out = engine.generate(
            batch, n=1, temperature=1.0, top_p=1.0, max_tokens=32, seed=1, ignore_eos=True
        )
        dt = time.perf_counter() - t0
    res["tokens_per_s"] = sum(len(c[0].token_ids) for c in out) / dt

    # Seeded requests with long prompts arriving together (multi-turn rows): more prompt tokens than one
    # step's budget. A prefill split over steps rewinds the request's CPU generator, which torch refuses.
    for i in range(40):
        engine.add_request(
            f"long-{i}",
            (prompts[i % len(prompts)] * 64)[:240],
            temperature=1.0,
            max_tokens=4,
            seed=i,
            ignore_eos=True,
        )
    long_done = {}
    while engine.num_unfinished():
        long_done.update(engine.run_until(min_finished=1))
    res["seeded_long_prompts_finished"] = len(long_done)

    weights_b = list(checkpoint_tensors(spec["model_b"]))  # read off disk outside the timed call
    t0 = time.perf_counter()
    engine.update_weights(iter(weights_b), version=1)
    res["update_weights_s"] = time.perf_counter() - t0
    res["version_after_b"] = engine.version
    res["greedy_b"] = greedy(engine, prompts, max_tokens)
    res["completion_version_b"] = engine.generate(prompts[:1], n=1, temperature=0.0, max_tokens=2)[
        0
    ][0].version

    # Again, back to a's weights: the update path must work more than once.
    weights_a = list(checkpoint_tensors(spec["model_a"]))
    t0 = time.perf_counter()
    engine.update_weights(weights_a, version=2)
    res["update_weights_again_s"] = time.perf_counter() - t0
    res["version_after_a"] = engine.version
    res["greedy_a_again"] = greedy(engine, prompts, max_tokens)

    engine.sleep()
    engine.wake_up()
    res["greedy_after_wake"] = greedy(engine, prompts[:1], max_tokens)
    # a weight sync between stages: the weights woken alone take an update, generation waits for the KV cache
    engine.sleep()
    res["asleep"] = {
        "update_weights": error(lambda: engine.update_weights(weights_a, version=2)),
        "generate": error(lambda: engine.generate(prompts[:1], max_tokens=2)),
    }
    engine.wake_up(["weights"])
    res["weights_awake"] = {
        "update_weights": error(lambda: engine.update_weights(weights_a, version=2)),
        "generate": error(lambda: engine.generate(prompts[:1], max_tokens=2)),
    }
    engine.wake_up(["kv_cache"])
    res["greedy_after_partial_wake"] = greedy(engine, prompts[:1], max_tokens)

    res["step_api"] = step_api(engine, prompts, max_tokens, weights_a)
    res["greedy_after_step_api"] = greedy(engine, prompts, max_tokens)  # generate() still works
    write(res, result_path)


def write(res: dict, result_path: str) -> None:
    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(result_path)


if __name__ == "__main__":
    spec_given = json.loads(Path(sys.argv[1]).read_text())
    if spec_given.get("engine_process") == "separate":
        write(separate(spec_given), sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2])
