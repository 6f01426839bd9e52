"""What verify-after-sync costs: the per-tensor checksums of one weight sync, sender and receiver side.

A verified sync (the first, then every ``pipeline.options.weight_sync_verify_every``) stamps every bucket on
the trainer (``weight_sync.buckets.stamp``) and checks it on each generator (``verified``). Both sides compute
the same checksums over the same bytes, so the overhead per verified sync is about twice one side's time,
spread over two processes. This measures one side's time on the weights of real model shapes, packed into the
sync's buckets as the trainer packs them: the quickstart's tiny Qwen2 (float32, as the quickstart trains it)
and the Qwen2.5-0.5B shape (random weights, bfloat16), beside the time to copy the same bytes once (a floor:
the sync itself copies each byte at least once on each side). Median of repeats.

    python bench/weight_sync_verify.py [--repeats 5] [--sizes quickstart,0.5b]

Results: bench/results/weight_sync_verify.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.timing import time_calls  # noqa: E402
from rollhpc.weight_sync.buckets import pack_buckets, stamp, verified  # noqa: E402

# Qwen2.5-0.5B's published config.json shape (hidden 896, 24 layers, 14 heads / 2 KV heads, FFN 4864, vocab 151936)
QWEN05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
)


def model_weights(size: str) -> tuple[list[tuple[str, torch.Tensor]], str]:
    """Named tensors in Hugging Face names, as the trainer exports them."""
    from rollhpc.warm_start.tiny import TinyModelConfig, build_tokenizer, create_tiny_model
    from rollhpc.tasks import arithmetic

    if size == "quickstart":
        train, _ = arithmetic.make_splits(0, 500, 10, digits=2, ops=("+",))
        with tempfile.TemporaryDirectory() as tmp:
            path = create_tiny_model(
                Path(tmp) / "tiny",
                TinyModelConfig(),
                build_tokenizer(list(arithmetic.corpus(train)), 300),
            )
            from safetensors.torch import load_file

            named = {
                n: t for f in sorted(path.glob("*.safetensors")) for n, t in load_file(f).items()
            }
        return sorted(named.items()), "float32"
    import transformers

    config = transformers.Qwen2Config(**QWEN05)
    with torch.device("meta"):
        # tied: the export sends the embedding once
        shapes = {
            n: (tuple(p.shape))
            for n, p in transformers.Qwen2ForCausalLM(config).state_dict().items()
            if n != "lm_head.weight"
        }
    g = torch.Generator().manual_seed(0)
    return [
        (n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in sorted(shapes.items())
    ], "bfloat16"


def median_s(fn, repeats: int) -> float:
    return statistics.median(time_calls(fn, repeats))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default="quickstart,0.5b")
    ap.add_argument(
        "--bucket-mb",
        type=float,
        default=64.0,
        help="the sync's bucket size (weight_sync_bucket_mb)",
    )
    ap.add_argument("--out", default=str(HERE / "results" / "weight_sync_verify.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)  # a rank's share of a 2-core machine
    results = []
    for size in args.sizes.split(","):
        named, dtype = model_weights(size)
        buckets = list(pack_buckets(named, int(args.bucket_mb * (1 << 20))))
        nbytes = sum(b.nbytes for b in buckets)
        send = median_s(lambda: [stamp(b) for b in buckets], args.repeats)
        receive = median_s(lambda: [None for b in buckets for _ in verified(b)], args.repeats)
        copy = median_s(lambda: [b.data.clone() for b in buckets], args.repeats)
        row = {
            "model": size,
            "dtype": dtype,
            "tensors": len(named),
            "buckets": len(buckets),
            "bytes": nbytes,
            "stamp_s": round(send, 5),
            "verify_s": round(receive, 5),
            "copy_once_s": round(copy, 5),
            "stamp_gb_per_s": round(nbytes / send / 1e9, 3),
            "verify_over_copy": round(receive / copy, 2),
        }
        results.append(row)
        print(json.dumps(row))
    out = {
        "bench": "weight_sync_verify",
        "threads": 1,
        "repeats": args.repeats,
        "bucket_mb": args.bucket_mb,
        "machine": {"cpu_count": __import__("os").cpu_count(), "platform": platform.platform()},
        "torch": torch.__version__,
        "results": results,
    }
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
