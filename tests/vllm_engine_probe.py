"""Runs VllmGenerator once for tests/test_vllm_engine.py and writes what it saw as JSON.

    python tests/vllm_engine_probe.py SPEC.json RESULT.json

SPEC names two checkpoints (a, b) and the prompts; the test owns every comparison. vLLM needs a
``__main__`` guard and ~20 s to start, so one process runs all the checks on one engine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def checkpoint_tensors(model_dir: str):
    from safetensors import safe_open

    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def greedy(engine, prompts, max_tokens):
    out = engine.generate(prompts, n=1, temperature=0.0, top_p=1.0, max_tokens=max_tokens, seed=None,
                          ignore_eos=True)
    return [{"token_ids": c[0].token_ids, "logprobs": c[0].logprobs, "finish_reason": c[0].finish_reason}
            for c in out]


def main(spec_path: str, result_path: str) -> None:
    from rollhpc.engines.vllm_engine import VllmGenerator

    spec = json.loads(Path(spec_path).read_text())
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    res: dict = {}

    t0 = time.perf_counter()
    engine = VllmGenerator(spec["model_a"], seed=0, max_model_len=256, cpu_kv_cache_bytes=64 << 20,
                           dtype="float32")
    res["start_s"] = time.perf_counter() - t0

    res["greedy_a"] = greedy(engine, prompts, max_tokens)

    def sample(seed):
        out = engine.generate(prompts, n=4, temperature=1.0, top_p=0.9, max_tokens=max_tokens, seed=seed)
        return [[{"token_ids": c.token_ids, "logprobs": c.logprobs} for c in per_prompt] for per_prompt in out]

    res["sample_seed7"], res["sample_seed7_again"], res["sample_seed8"] = sample(7), sample(7), sample(8)

    # Stops at the EOS id the test wrote into generation_config.json.
    out = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens)
    res["greedy_eos"] = [{"token_ids": c[0].token_ids, "finish_reason": c[0].finish_reason} for c in out]

    # Throughput: 64 prompts x 32 new tokens in one batch, timed on the second run (the first one
    # meets new batch shapes).
    batch = [prompts[i % len(prompts)] + [i + 1] for i in range(64)]
    for _ in range(2):
        t0 = time.perf_counter()
        out = engine.generate(batch, n=1, temperature=1.0, top_p=1.0, max_tokens=32, seed=1, ignore_eos=True)
        dt = time.perf_counter() - t0
    res["tokens_per_s"] = sum(len(c[0].token_ids) for c in out) / dt

    weights_b = list(checkpoint_tensors(spec["model_b"]))  # read off disk outside the timed call
    t0 = time.perf_counter()
    engine.update_weights(iter(weights_b), version=1)
    res["update_weights_s"] = time.perf_counter() - t0
    res["version_after_b"] = engine.version
    res["greedy_b"] = greedy(engine, prompts, max_tokens)
    res["completion_version_b"] = engine.generate(prompts[:1], n=1, temperature=0.0, max_tokens=2)[0][0].version

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
    try:
        engine.abort(["x"])
        res["abort"] = "ok"
    except NotImplementedError:
        res["abort"] = "not implemented"

    tmp = Path(result_path + ".tmp")
    tmp.write_text(json.dumps(res))
    tmp.rename(result_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
