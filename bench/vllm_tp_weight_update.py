"""Seconds per GB of a weight update into a vLLM engine with tensor_parallel_size=2 (CPU): rollhpc's shared-memory
weight transfer beside the pickled path it replaces, on one engine, same weights.

- ``shm``: vLLM's weight-transfer protocol (start / update per chunk / finish) with rollhpc's ``rollhpc_shm``
  backend: each chunk is written once into /dev/shm, and each TP worker maps it and loads views of it
  (rollhpc.engines.vllm_weight_transfer).
- ``pickled``: ``collective_rpc("reload_weights", weights_iterator=[...])`` with the whole list of tensors, which
  vLLM pickles (tensors as out-of-band buffers) through its message queue to every worker: the fallback when the
  plugin is not loaded, and what TP > 1 used before.

The model is the Qwen2.5-0.5B shape with random weights in bfloat16 (``--size 0.5b``, 0.99 GB as the trainer
exports it: tied, no lm_head; the engine adds the head, so 1.26 GB travel) or the quickstart's tiny model. Each
path in turn makes a block of one untimed update and ``--repeats`` timed ones, alternating between two weight
sets; ``--rounds`` blocks of each path, alternating (noise on two cores is as large as the difference). At the
end every worker's parameter shards are hashed after an shm update and after a pickled update of the same
weights, and must be equal. Median of all timed updates per path (seconds per GB of the model's bytes), with
the extra memory the machine needed at the update's peak (MemAvailable sampled every 5 ms).

    python bench/vllm_tp_weight_update.py [--size 0.5b] [--rounds 3] [--repeats 3]

Results: bench/results/vllm_tp_weight_update.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from bench.provenance import commit  # noqa: E402


def write_checkpoint(size: str, where: Path) -> list:
    """A Hugging Face checkpoint of the size's shape (config.json + safetensors); returns its tensors."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from weight_sync_verify import QWEN05, model_weights

    named, dtype = model_weights(size)
    if size == "0.5b":
        config = transformers.Qwen2Config(**QWEN05, torch_dtype=dtype)
    else:
        config = transformers.Qwen2Config.from_dict(json.loads(_quickstart_config()))
    config.save_pretrained(where)
    save_file({n: t.contiguous() for n, t in named}, str(where / "model.safetensors"))
    return [(n, t.to(getattr(torch, dtype))) for n, t in named]


def _quickstart_config() -> str:
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(list(arithmetic.corpus(train)), 300)
        path = create_tiny_model(Path(tmp) / "tiny", TinyModelConfig(), tokenizer)
        return (path / "config.json").read_text()


def digests(worker) -> dict[str, str]:
    """In each TP worker: every parameter's bytes, hashed."""
    import hashlib

    import torch

    return {
        n: hashlib.sha256(
            p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for n, p in worker.model_runner.get_model().named_parameters()
    }


class MemoryDip:
    """The largest drop of the machine's available memory while the block runs (every process: the generator,
    its TP workers, vLLM's queues), sampled every 5 ms: the extra memory one update needs."""

    def __enter__(self) -> MemoryDip:
        import threading

        self.base = self.low = available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.low = min(self.low, available())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = self.base - self.low


def available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="0.5b", choices=["0.5b", "quickstart"])
    ap.add_argument("--tp", type=int, default=2, help="tensor_parallel_size (worker processes)")
    ap.add_argument("--rounds", type=int, default=3, help="blocks of each path, alternating")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per block")
    ap.add_argument(
        "--chunk-mb", type=float, default=256.0, help="the engine's weight_chunk_bytes, in MiB"
    )
    ap.add_argument("--out", default=str(HERE / "results" / "vllm_tp_weight_update.json"))
    args = ap.parse_args()

    import torch

    from rollhpc.engines import vllm_weight_transfer
    from rollhpc.engines.vllm_engine import VllmGenerator

    with tempfile.TemporaryDirectory() as tmp:
        weights = write_checkpoint(args.size, Path(tmp))
        # a second weight set
        other = [(n, t + 1e-2 if t.is_floating_point() else t) for n, t in weights]
        nbytes = sum(t.numel() * t.element_size() for _, t in weights)
        t0 = time.perf_counter()
        engine = VllmGenerator(
            tmp,
            tensor_parallel_size=args.tp,
            dtype=str(weights[0][1].dtype).removeprefix("torch."),
            max_model_len=256,
            cpu_kv_cache_bytes=64 << 20,
            weight_chunk_bytes=int(args.chunk_mb * (1 << 20)),
        )
        start_s = time.perf_counter() - t0
    assert engine.weight_transfer == vllm_weight_transfer.SHM_BACKEND, (
        "the rollhpc_shm plugin is not loaded"
    )
    backend = engine.weight_transfer
    times: dict[str, list[float]] = {"shm": [], "pickled": []}
    peaks: dict[str, list[int]] = {"shm": [], "pickled": []}
    version = 0
    # in blocks of one path (what one path leaves freed but held must not count for the other), the blocks
    # alternating so that the machine's drift over the run falls on both
    for path in ("shm", "pickled") * args.rounds:
        engine.weight_transfer = backend if path == "shm" else None  # None: the pickled fallback
        for i in range(args.repeats + 1):  # the first one untimed: the block's first update
            version += 1
            with MemoryDip() as dip:
                t = time.perf_counter()
                engine.update_weights(iter(other if i % 2 == 0 else weights), version)
                dt = time.perf_counter() - t
            if i == 0:
                continue
            times[path].append(dt)
            peaks[path].append(dip.peak)
            print(
                f"{path} update {i}: {times[path][-1]:.2f} s, {dip.peak / 1e9:.2f} GB extra memory at peak",
                file=sys.stderr,
                flush=True,
            )
    engine.weight_transfer = backend
    engine.update_weights(iter(weights), version + 1)
    after_shm = engine.llm.collective_rpc(digests)
    engine.weight_transfer = None
    engine.update_weights(iter(other), version + 2)
    engine.update_weights(iter(weights), version + 3)
    after_pickled = engine.llm.collective_rpc(digests)
    rows = {}
    for path, ts in times.items():
        med = statistics.median(ts)
        rows[path] = {
            "median_s": round(med, 3),
            "min_s": round(min(ts), 3),
            "max_s": round(max(ts), 3),
            "s_per_gb": round(med / (nbytes / 1e9), 3),
            "peak_extra_memory_gb": round(statistics.median(peaks[path]) / 1e9, 2),
            "all_s": [round(x, 3) for x in ts],
        }
    out = {
        "bench": "vllm_tp_weight_update",
        "commit": commit(),
        "size": args.size,
        "dtype": str(weights[0][1].dtype).removeprefix("torch."),
        "tensors": len(weights),
        "bytes": nbytes,
        "tensor_parallel_size": args.tp,
        "chunk_mb": args.chunk_mb,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "engine_start_s": round(start_s, 1),
        "paths": rows,
        "shm_speedup": round(rows["pickled"]["median_s"] / rows["shm"]["median_s"], 2),
        "shards_equal_after_both_paths": after_shm == after_pickled,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "torch": torch.__version__,
    }
    print(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if out["shards_equal_after_both_paths"] else 1


if __name__ == "__main__":
    sys.exit(main())
