"""Runs a tensor-parallel VllmGenerator (TP=2, CPU) once for tests/world/test_vllm_tp.py and writes what it saw as JSON.

    python tests/support/vllm_tp_probe.py SPEC.json RESULT.json

SPEC names checkpoints a and b, the prompts and the chunk size. One engine starts on a (loaded from disk by vLLM:
the reference), receives b's weights through ``update_weights``, then a's again. After each stage the result holds
greedy completions and, per TP worker, a SHA-256 of every parameter's bytes (the shard that worker holds).
vLLM needs a ``__main__`` guard and ~20 s to start, so one engine does it all; the test owns every comparison.
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


def parameter_digests(worker) -> dict[str, str]:
    """Runs in each TP worker (``collective_rpc``): the bytes of every parameter it holds, hashed."""
    import hashlib

    import torch

    model = worker.model_runner.get_model()
    return {
        name: hashlib.sha256(
            p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, p in model.named_parameters()
    }


def main(spec_path: str, result_path: str) -> None:
    from rollhpc.engines.vllm_engine import VllmGenerator

    spec = json.loads(Path(spec_path).read_text())
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    res: dict = {}
    t0 = time.perf_counter()
    engine = VllmGenerator(
        spec["model_a"],
        seed=0,
        max_model_len=128,
        cpu_kv_cache_bytes=32 << 20,
        dtype="float32",
        tensor_parallel_size=2,
        weight_chunk_bytes=spec["chunk_bytes"],
    )
    res["start_s"] = time.perf_counter() - t0
    res["weight_transfer"] = engine.weight_transfer

    def greedy():
        out = engine.generate(prompts, n=1, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return [
            {
                "token_ids": c[0].token_ids,
                "logprobs": c[0].logprobs,
                "finish_reason": c[0].finish_reason,
            }
            for c in out
        ]

    stages = {"a": greedy(), "digests_a": engine.llm.collective_rpc(parameter_digests)}
    for version, name in ((1, "b"), (2, "a_again")):
        tensors = list(checkpoint_tensors(spec["model_b" if name == "b" else "model_a"]))
        t0 = time.perf_counter()
        engine.update_weights(iter(tensors), version)
        res[f"update_{version}_s"] = time.perf_counter() - t0
        stages[name] = greedy()
        stages[f"digests_{name}"] = engine.llm.collective_rpc(parameter_digests)
    res.update(
        stages,
        version=engine.version,
        update_bytes=sum(t.numel() * t.element_size() for _, t in tensors),
        shm_left=sorted(p.name for p in Path("/dev/shm").glob("rollhpc-weights-*")),
    )
    Path(result_path).write_text(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
