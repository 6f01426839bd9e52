"""What megatron-core's local layer spec keeps for the backward, per transformer layer and for the log-prob head,
against the memory plan's activation model (rollhpc.placement.activation_model): bytes counted with autograd's
saved-tensor hooks during one forward on CPU, in bfloat16. The saved tensors are the same on a GPU for this spec
(plain PyTorch ops, no fused kernels), so what holds here holds for a GPU's activations.

    python bench/activation_bytes.py [--shapes 0.5b,7b,30b-a3b] [--tokens 256,1024,4096]

Each case builds a one-layer model of the shape (the layer's bytes do not depend on the layer count), runs one
forward of one row and the worker's log-prob head, and attributes each saved storage to the module that saved it
first; the model's own parameters (which linears save for their weight gradients) are left out: the plan counts
them as parameters. Cases: the dense shapes at each token count with recompute none / selective / full, and for
the 0.5B shape also a GELU MLP and full multi-head attention (kv heads = heads), so the terms are seen to hold
across MLP kinds, GQA and recompute modes; Qwen3-30B-A3B's MoE layer (one process: no expert parallelism, so the
dispatcher gathers nothing) without recompute and with full. Results: bench/results/activation_bytes.json (model,
measured, ratio per case); the exit status is 1 when some case is more than 15% off.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import commit, write_result  # noqa: E402

# config.json fields of the measured shapes: the models the shipped configs name (Qwen2: q/k/v biases; Qwen3-MoE:
# q/k norms, 128 experts, 8 per token)
SHAPES = {"0.5b": "qwen2.5-0.5b", "7b": "qwen2.5-7b", "30b-a3b": "qwen3-30b-a3b"}
VARIANTS = {  # name -> (config.json changes, TransformerConfig overrides, the plan shape's hidden_act)
    "swiglu": ({}, {}, "silu"),
    "gelu": ({}, {"gated_linear_unit": False}, "gelu"),
    "mha": ({"num_key_value_heads": None}, {}, "silu"),  # kv heads = heads: no GQA
}


def hf_config(shape: str, variant: str, seq: int) -> dict:
    """config.json of a one-layer model of ``shape`` for ``seq`` tokens."""
    from rollhpc.placement.memory_plan import KNOWN_MODELS

    hf = {
        **KNOWN_MODELS[SHAPES[shape]],
        "num_hidden_layers": 1,
        "max_position_embeddings": 4 * seq,
        "rms_norm_eps": 1e-6,
    }
    if hf.get("num_experts"):
        hf["norm_topk_prob"] = True
    for key, value in VARIANTS[variant][0].items():
        hf[key] = hf["num_attention_heads"] if value is None else value
    return hf


def measure(shape: str, variant: str, seq: int, recompute: str) -> dict[str, Any]:
    """Bytes kept by one forward, by op: the layer's modules, and the head (final norm, output layer, loss)."""
    import torch.nn.functional as F

    from rollhpc.models.megatron_gpt import build_gpt_model, recompute_overrides
    from rollhpc.models.vocab_parallel import token_logprobs

    hf = hf_config(shape, variant, seq)
    overrides = {**VARIANTS[variant][1], **recompute_overrides(recompute)}
    if variant == "gelu":
        overrides["activation_func"] = F.gelu
    model = build_gpt_model(
        hf, params_dtype=torch.bfloat16, parallel_output=False, bf16=True, **overrides
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = ["input"], set(params)
    by_module: collections.Counter = collections.Counter()
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda m, a, n=name: where.append(n or "model"))
        module.register_forward_hook(lambda m, a, o: where.pop() and None)  # None: the output stays

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:  # a tensor saved by two ops is held once
            seen.add(storage.data_ptr())
            by_module[where[-1]] += storage.nbytes()
        return t

    ids = torch.randint(0, hf["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(ids, torch.arange(seq).expand_as(ids), None)
        where.append("loss")
        logp, _ = token_logprobs(logits[:, :-1], ids[:, 1:], hf["vocab_size"])
    del logp, logits
    layer = sum(
        v for k, v in by_module.items() if k.startswith("decoder.layers.") or k == "decoder"
    )
    head = sum(
        v for k, v in by_module.items() if k in ("decoder.final_layernorm", "output_layer", "loss")
    )
    experts = collections.Counter()  # one line for all experts: 128 of them would bury the rest
    for name, nbytes in by_module.items():
        experts[re.sub(r"local_experts\.\d+", "local_experts.*", name)] += nbytes
    return {"layer": layer, "head": head, "by_module": dict(experts)}


def planned(shape: str, variant: str, seq: int, recompute: str) -> dict[str, float]:
    """The memory plan's bytes for the same layer and head (the logits' 16-bit copy is a transient the saved
    tensors do not show: the model's head less it is compared)."""
    from rollhpc.placement import activation_model as am
    from rollhpc.placement.memory_plan import ModelShape

    hf = {**hf_config(shape, variant, seq), "hidden_act": VARIANTS[variant][2]}
    s = ModelShape.from_hf(hf)
    layer = sum(am.layer_bytes(s, 1, 1, seq, 2, recompute).values())
    head = am.head_bytes(s, 1, 1, seq, 2) - 2 * seq * s.vocab
    return {"layer": layer, "head": head}


def cases(args: argparse.Namespace) -> list[tuple[str, str, int, str]]:
    """(shape, variant, tokens, recompute) of each measurement: every recompute mode of the dense shapes; the
    MLP and attention variants on the 0.5B; the MoE layer without recompute and with full (selective differs from
    none only in the attention, which the dense shapes cover)."""
    out = []
    for shape in args.shapes.split(","):
        for seq in (int(x) for x in args.tokens.split(",")):
            modes = ("none", "full") if "a3b" in shape else ("none", "selective", "full")
            out += [(shape, "swiglu", seq, r) for r in modes]
            if shape == "0.5b":
                out += [(shape, "gelu", seq, "none"), (shape, "mha", seq, "none")]
    return out


def measure_apart(shape: str, variant: str, seq: int, recompute: str) -> dict[str, Any]:
    """``measure`` in a process of its own: a 7B layer with its 152k-vocabulary embedding and head is several GB
    to build, and megatron's global state keeps a built model reachable, so cases in one process run out of
    this machine's memory."""
    out = subprocess.run(
        [sys.executable, __file__, "--case", f"{shape},{variant},{seq},{recompute}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="256,1024,4096", help="tokens of the one-row micro-batch")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "activation_bytes.json"
    )
    # shape,variant,tokens,recompute: one measure, as JSON
    ap.add_argument("--case", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        from rollhpc.checkpoint.mcore import single_process_world

        shape, variant, seq, recompute = args.case.split(",")
        with single_process_world():
            print(json.dumps(measure(shape, variant, int(seq), recompute)))
        return 0
    rows = []
    print(
        f"{'shape':<6} {'mlp/attn':<8} {'recompute':<9} {'tokens':>6} {'part':<5} {'measured MiB':>12} "
        f"{'model MiB':>10} {'model/meas':>10}"
    )
    for shape, variant, seq, recompute in cases(args):
        got = measure_apart(shape, variant, seq, recompute)
        plan = planned(shape, variant, seq, recompute)
        for part in ("layer", "head"):
            ratio = plan[part] / got[part]
            rows.append(
                {
                    "shape": shape,
                    "variant": variant,
                    "recompute": recompute,
                    "tokens": seq,
                    "part": part,
                    "measured_bytes": got[part],
                    "model_bytes": plan[part],
                    "model_over_measured": ratio,
                }
            )
            print(
                f"{shape:<6} {variant:<8} {recompute:<9} {seq:>6} {part:<5} {got[part] / 2**20:>12.1f} "
                f"{plan[part] / 2**20:>10.1f} {ratio:>10.3f}",
                flush=True,
            )
        rows[-2]["by_module"] = got["by_module"]
    worst = max(abs(r["model_over_measured"] - 1) for r in rows)
    print(f"largest relative error: {worst:.1%}")
    write_result(
        args.out,
        {
            "bench": "activation_bytes",
            "commit": commit(),
            "args": {"shapes": args.shapes, "tokens": args.tokens},
            "dtype": "bfloat16",
            "rows": rows,
            "largest_relative_error": worst,
        },
    )
    return 0 if worst <= 0.15 else 1


if __name__ == "__main__":
    raise SystemExit(main())
