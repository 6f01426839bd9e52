"""Peak memory and wall time of offline checkpoint conversion (``rollhpc convert``), dense and MoE.

The converter streams one tensor group at a time, so its memory should follow the largest file it reads or
writes, not the model. This builds random Qwen2 / Qwen2-MoE models of two sizes, saved by transformers in
safetensors files smaller than the model, and converts each HF -> mcore (at TP=1, and at TP=2 / EP=2) and
back mcore -> HF. Per conversion it records the peak resident memory of the busiest worker above its
baseline (imports, process group), the largest shard read or written, their ratio, the model's size and the
wall time. The round trip is also checked bit for bit, so a fast but wrong conversion cannot score.

    python bench/convert_memory.py [--sizes small,large] [--shard-mb 100]

Results: bench/results/convert_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import transformers  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from rollhpc.conversion.convert import Report, hf_to_mcore, mcore_to_hf  # noqa: E402
from rollhpc.checkpoint.safetensors_io import SafetensorsDir  # noqa: E402

# hidden size and layers per size; the other shapes follow from them
SIZES = {"small": (512, 4), "large": (1024, 6)}


def build(root: Path, kind: str, size: str, shard_mb: int) -> tuple[Path, int]:
    """Save a random model of this kind and size; returns its directory and parameter bytes."""
    hidden, layers = SIZES[size]
    common = dict(
        hidden_size=hidden,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=4000,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if kind == "moe":
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=2 * hidden,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden * 3 // 4,
            shared_expert_intermediate_size=hidden,
            **common,
        )
    else:
        cfg = transformers.Qwen2Config(intermediate_size=6 * hidden, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = root / f"{kind}_{size}"
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB")
    return path, nbytes


def row(rep: Report, layout: str, model_bytes: int) -> dict:
    mib = 2**20
    return {
        "direction": rep.direction,
        "layout": layout,
        "workers": rep.workers,
        "seconds": round(rep.seconds, 2),
        "peak_rss_mib": round(rep.peak_rss_bytes / mib, 1),
        "baseline_rss_mib": round(rep.baseline_rss_bytes / mib, 1),
        "largest_shard_mib": round(rep.largest_shard_bytes / mib, 1),
        "largest_shard": Path(rep.largest_shard).name,
        "peak_over_largest_shard": round(rep.peak_rss_bytes / rep.largest_shard_bytes, 3),
        "peak_over_model": round(rep.peak_rss_bytes / model_bytes, 3),
    }


def same_tensors(a: Path, b: Path) -> bool:
    """Every tensor of the two HF directories equal bit for bit (one tensor at a time)."""
    ta, tb = SafetensorsDir(a), SafetensorsDir(b)
    if set(ta) != set(tb):
        return False
    for name in ta:
        x, y = ta[name], tb[name]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        ):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="small,large", help="comma list of " + ",".join(SIZES))
    ap.add_argument(
        "--shard-mb", type=int, default=100, help="HF safetensors file size, in and out (MB)"
    )
    ap.add_argument("--out", default=str(HERE / "results" / "convert_memory.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="convert-bench-") as tmp:
        for size in args.sizes.split(","):
            for kind in ("dense", "moe"):
                case = Path(tmp) / f"{kind}_{size}_work"
                src, model_bytes = build(Path(tmp), kind, size, args.shard_mb)
                parallel = "tp2_ep2" if kind == "moe" else "tp2"
                entry = {
                    "model": kind,
                    "size": size,
                    "model_mib": round(model_bytes / 2**20, 1),
                    "conversions": [],
                }
                for layout, kw in (
                    ("tp1", {}),
                    (parallel, {"tp": 2, **({"ep": 2} if kind == "moe" else {})}),
                ):
                    mc, hf = case / f"mcore_{layout}", case / f"hf_{layout}"
                    there = hf_to_mcore(src, mc, progress=False, **kw)
                    back = mcore_to_hf(mc, hf, max_shard_size=f"{args.shard_mb}MB", progress=False)
                    entry["conversions"] += [
                        row(there, layout, model_bytes),
                        row(back, layout, model_bytes),
                    ]
                    entry[f"round_trip_{layout}_bitwise"] = same_tensors(src, hf)
                    print(
                        f"{kind} {size} {layout}\n  {there.summary()}\n  {back.summary()}\n"
                        f"  round trip bitwise: {entry[f'round_trip_{layout}_bitwise']}",
                        flush=True,
                    )
                results.append(entry)
    worst = max(c["peak_over_largest_shard"] for e in results for c in e["conversions"])
    out = {
        "benchmark": "convert_memory",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "hf_shard_mb": args.shard_mb,
        "worst_peak_over_largest_shard": worst,
        "models": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"worst peak / largest shard: {worst:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
