"""The trainer's log-prob head (rollhpc.models.vocab_parallel.token_logprobs) against the same maths as plain
autograd expressions, which is what it was before it became a written-out autograd Function: seconds of a
forward + backward, and the bytes autograd keeps for the backward (counted with saved-tensor hooks), on
bf16 logits of Qwen's 151,936-token vocabulary.

    python bench/logprob_head.py [--rows 16] [--seq 80] [--vocab 151936] [--repeats 5] [--threads 2]

Both forms run on the same logits in one process, alternating, the median of --repeats each; the gradients of
the two are compared. Results: bench/results/logprob_head.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import commit, write_result  # noqa: E402
from rollhpc.models.vocab_parallel import token_logprobs  # noqa: E402

_MASKED = -1e9


def plain_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, with_entropy: bool
):
    """The single-rank maths of token_logprobs as plain expressions (autograd keeps what each op needs)."""
    logits = logits.float()
    v = logits.shape[-1]
    if vocab_size < v:
        logits = logits.masked_fill(torch.arange(v) >= vocab_size, _MASKED)
    z = logits - logits.detach().max(dim=-1, keepdim=True).values
    e = z.exp()
    sum_exp = e.sum(-1)
    logp = torch.gather(z, -1, targets.unsqueeze(-1)).squeeze(-1) - sum_exp.log()
    entropy = sum_exp.log() - (e * z).sum(-1) / sum_exp if with_entropy else None
    return logp, entropy


def measure(
    fn, logits: torch.Tensor, targets: torch.Tensor, vocab: int, with_entropy: bool
) -> dict:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    x = logits.clone().requires_grad_()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, entropy = fn(x, targets, vocab, with_entropy=with_entropy)
    loss = -logp.mean() + (0.01 * entropy.mean() if with_entropy else 0)
    loss.backward()
    return {"seconds": time.perf_counter() - t0, "saved_bytes": sum(saved), "grad": x.grad}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="sequences per micro-batch")
    ap.add_argument("--seq", type=int, default=80, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "logprob_head.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.seq, args.vocab, generator=g).to(torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.rows, args.seq), generator=g)
    forms = {"plain_autograd": plain_logprobs, "token_logprobs": token_logprobs}
    results = {}
    for with_entropy in (False, True):
        runs: dict[str, list[dict]] = {name: [] for name in forms}
        for _ in range(args.repeats):
            for name, fn in forms.items():  # alternating, so drift of the machine hits both
                runs[name].append(measure(fn, logits, targets, args.vocab, with_entropy))
        grads = {name: r[-1].pop("grad").float() for name, r in runs.items()}
        for r in runs.values():
            for x in r:
                x.pop("grad", None)
        key = "with_entropy" if with_entropy else "logprobs"
        results[key] = {
            name: {
                "median_s": statistics.median(x["seconds"] for x in r),
                "saved_gib": r[0]["saved_bytes"] / 2**30,
            }
            for name, r in runs.items()
        }
        results[key]["grad_max_abs_diff"] = float(
            (grads["plain_autograd"] - grads["token_logprobs"]).abs().max()
        )
        results[key]["speedup"] = (
            results[key]["plain_autograd"]["median_s"] / results[key]["token_logprobs"]["median_s"]
        )
        print(key, results[key], flush=True)
    float_copy = args.rows * args.seq * args.vocab * 4
    write_result(
        Path(args.out),
        {
            "bench": "logprob_head",
            "commit": commit(),
            "args": vars(args),
            "float_copy_gib": float_copy / 2**30,
            "results": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
