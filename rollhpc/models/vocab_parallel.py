"""Per-token log-probabilities and entropies from logits split over tensor-parallel ranks.

Megatron's output layer leaves each TP rank a slice of the (padded) vocabulary. Gathering the full
logits would cost ``[b, s, V]`` per rank; instead the softmax statistics (max, sum of exp, the target's
logit) are reduced across the TP group, which is all that log p(target) and the entropy need, and the
backward is written out (``_TokenLogprobs``): each rank's gradient is its own slice, and one float32 copy of
the logits is kept for it. Padded vocabulary columns (megatron pads V to a multiple of 128 * tp) are not
part of the model's distribution: they are masked out here, otherwise their logits would take probability
mass and training would push them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

_MASKED = -1e9  # finite, so exp() gives 0 and 0 * _MASKED stays 0 (−inf would make the entropy NaN)


class _TokenLogprobs(torch.autograd.Function):
    """log p(target) and the entropy with one float32 copy of the logits kept for the backward (two with the
    entropy), where autograd through the plain expressions keeps two (four): with Qwen's 151,936-token
    vocabulary one copy is 1.2 GB per 2,048 tokens, so this is most of a large-vocabulary model's activations
    at long sequence lengths. The softmax statistics are reduced over the TP group in the forward; the
    backward needs no collective (each rank's gradient is its own slice: onehot(target) - p, and
    -p (z - E[z]) for the entropy, with p and E[z] from the reduced sums). The backward reuses the saved
    buffers in place, so it can run once (no ``retain_graph`` double backward)."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        vocab_size: int,
        tp_rank: int,
        tp_group: dist.ProcessGroup | None,
        distributed: bool,
        with_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z = logits.to(torch.float32, copy=True)  # modified in place from here on
        v_local = z.shape[-1]
        start = tp_rank * v_local
        real = vocab_size - start  # columns of this slice that are real tokens
        if real < v_local:
            z[..., max(real, 0) :] = _MASKED
        m = z.max(dim=-1, keepdim=True).values
        if distributed:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        z.sub_(m)
        local_t = targets - start
        in_slice = (local_t >= 0) & (local_t < v_local)
        index = local_t.clamp(0, v_local - 1).unsqueeze(-1)
        z_t = z.gather(-1, index).squeeze(-1) * in_slice
        if with_entropy:
            e = z.exp()
            ez = (e * z).sum(-1)
        else:
            e, ez = z.exp_(), None  # z is not needed again: its buffer becomes exp(z)
        sum_exp = e.sum(-1)
        if distributed:
            for t in (sum_exp, z_t) + ((ez,) if with_entropy else ()):
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=tp_group)
        log_z = sum_exp.log()
        logp = z_t - log_z
        mean_z = ez / sum_exp if with_entropy else None
        entropy = log_z - mean_z if with_entropy else logp.new_zeros(0)
        ctx.dtype = logits.dtype
        ctx.save_for_backward(e, sum_exp, index, in_slice, *((z, mean_z) if with_entropy else ()))
        return logp, entropy

    @staticmethod
    def backward(
        ctx: FunctionCtx, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None
    ) -> tuple[Any, ...]:
        e, sum_exp, index, in_slice, *entropy_parts = ctx.saved_tensors
        p = e.div_(sum_exp.unsqueeze(-1))  # the softmax, in the saved buffer
        entropy_grad = None
        if entropy_parts and grad_entropy is not None and grad_entropy.numel():
            z, mean_z = entropy_parts
            entropy_grad = z.sub_(mean_z.unsqueeze(-1)).mul_(p).mul_((-grad_entropy).unsqueeze(-1))
        if grad_logp is None:
            grad = p.zero_()
        else:  # the gradient, in the same buffer again
            grad = p.mul_((-grad_logp).unsqueeze(-1)).scatter_add_(
                -1, index, (grad_logp * in_slice).unsqueeze(-1)
            )
        if entropy_grad is not None:
            grad.add_(entropy_grad)
        return grad.to(ctx.dtype), None, None, None, None, None, None


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    tp_group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and optionally the entropy, per position (``_TokenLogprobs``).

    logits: ``[..., V_local]``, this rank's slice ``[tp_rank * V_local, (tp_rank + 1) * V_local)`` of the
    padded vocabulary; targets: ``[...]`` token ids (< ``vocab_size``, the real, unpadded size).
    """
    logp, entropy = _TokenLogprobs.apply(
        logits, targets, vocab_size, tp_rank, tp_group, tp_size > 1, with_entropy
    )
    return logp, (entropy if with_entropy else None)
