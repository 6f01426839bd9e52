"""What megatron-core's local layer spec keeps for the backward, per transformer layer and for the log-prob head,
against the memory plan's terms (rollhpc.placement.memory_plan.activation_bytes): bytes counted with autograd's
saved-tensor hooks during one forward on CPU, in bfloat16, at a model shape and micro-batch given. The saved
tensors are the same on a GPU for this spec (no fused kernels), so the split here explains a GPU peak's.

    python bench/activation_bytes.py [--hidden 896 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936]
                                     [--layers 2] [--rows 4] [--seqs 256,512]

Per layer: the measured bytes (two layers' difference, so the embedding and the head drop out) beside the plan's
34·s·b·h + 5·a·s²·b (Korthikanti et al., 16-bit), and x·s·b·h + y·a·s²·b fitted over the sequence lengths; the
head: the bytes beyond the layers (logits and log-probs) beside the plan's 2·b·s·V·4 (which also counts the
backward's transient). Results: bench/results/activation_bytes.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import commit, write_result  # noqa: E402


def hf_config(layers: int, seq: int, args: argparse.Namespace) -> dict:
    """config.json of the measured shape with ``layers`` layers, for ``seq`` tokens (Qwen2: q/k/v biases, tied
    embedding)."""
    return {"model_type": "qwen2", "hidden_size": args.hidden, "num_hidden_layers": layers,
            "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
            "intermediate_size": args.intermediate, "vocab_size": args.vocab, "tie_word_embeddings": True,
            "max_position_embeddings": 4 * seq, "rms_norm_eps": 1e-6}


def saved_bytes(layers: int, args: argparse.Namespace) -> int:
    """Bytes autograd keeps after one forward of a ``layers``-layer model and the worker's log-prob head."""
    from rollhpc.models.megatron_gpt import build_gpt_model
    from rollhpc.models.vocab_parallel import token_logprobs

    model = build_gpt_model(hf_config(layers, args.seq, args), params_dtype=torch.bfloat16, parallel_output=False, bf16=True).to(torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.rows, args.seq), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(args.seq).expand_as(ids)
    seen: dict[int, int] = {}  # storage -> bytes: a tensor saved by two ops is held once

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, positions, None)
        logp, _ = token_logprobs(logits[:, :-1], ids[:, 1:], args.vocab)
        loss = -logp.mean()
    total = sum(seen.values())
    del loss, logp, logits
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 896), ("heads", 14), ("kv-heads", 2), ("intermediate", 4864), ("vocab", 151936),
                          ("layers", 2), ("rows", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--seqs", default="256,512", help="sequence lengths (two or more: the per-layer bytes are fitted "
                    "as x·s·b·h + y·a·s²·b)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "activation_bytes.json")
    args = ap.parse_args()

    from rollhpc.checkpoint.mcore import single_process_world
    from rollhpc.placement.memory_plan import ModelShape, activation_bytes

    seqs = [int(x) for x in args.seqs.split(",")]
    shape = ModelShape.from_hf(hf_config(1, seqs[0], args))
    rows = []
    for seq in seqs:
        args.seq = seq
        with single_process_world():
            one, more = saved_bytes(1, args), saved_bytes(args.layers, args)
        per_layer = (more - one) / (args.layers - 1)
        logits_plan = 2 * args.rows * seq * args.vocab * 4
        layer_plan = activation_bytes(shape, 1, 1, args.rows, seq, 2) - logits_plan
        rows.append({"seq": seq, "sbh": seq * args.rows * args.hidden, "as2b": args.heads * seq ** 2 * args.rows,
                     "per_layer_bytes": per_layer, "per_layer_plan_bytes": layer_plan,
                     "per_layer_over_plan": per_layer / layer_plan, "head_and_embedding_bytes": one - per_layer,
                     "head_plan_bytes": logits_plan, "head_over_plan": (one - per_layer) / logits_plan})
        print(rows[-1], flush=True)
    # per layer = x·sbh + y·as2b (bytes): least squares over the sequence lengths
    import numpy as np

    a = np.array([[r["sbh"], r["as2b"]] for r in rows], dtype=float)
    (x, y), *_ = np.linalg.lstsq(a, np.array([r["per_layer_bytes"] for r in rows]), rcond=None)
    fit = {"bytes_per_sbh": float(x), "bytes_per_as2b": float(y), "plan": {"bytes_per_sbh": 34, "bytes_per_as2b": 5}}
    print("fit:", fit)
    write_result(args.out, {"bench": "activation_bytes", "commit": commit(),
                            "args": {k: v for k, v in vars(args).items() if k not in ("out", "seq")},
                            "rows": rows, "fit": fit})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
