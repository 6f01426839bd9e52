"""Per-token log-probabilities and entropies from logits split over tensor-parallel ranks.

Megatron's output layer leaves each TP rank a slice of the (padded) vocabulary. Gathering the full
logits would cost ``[b, s, V]`` per rank; instead the softmax statistics (max, sum of exp, the target's
logit) are reduced across the TP group, which is all that log p(target) and the entropy need. The
reductions are differentiable (see ``_SumOverRanks``), so the same code trains. Padded vocabulary
columns (megatron pads V to a multiple of 128 * tp) are not part of the model's distribution: they are
masked out here, otherwise their logits would take probability mass and training would push them.
"""

from __future__ import annotations

from typing import Any

import torch

_MASKED = -1e9  # finite, so exp() gives 0 and 0 * _MASKED stays 0 (−inf would make the entropy NaN)


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over the TP group. Backward: identity.

    Every TP rank computes the same loss from the reduced value, so the gradient each rank needs for
    its own term is the incoming one unchanged; summing it over ranks (what
    ``torch.distributed.nn.all_reduce`` does) would multiply the gradients by the TP size."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        import torch.distributed as dist

        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _all_reduce(x: torch.Tensor, group: Any, op: str = "sum") -> torch.Tensor:
    import torch.distributed as dist

    if op == "max":  # not differentiated: the max only stabilises the exponentials
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x
    return _SumOverRanks.apply(x, group)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, *, tp_rank: int = 0,
                   tp_size: int = 1, tp_group: Any = None, with_entropy: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets) and optionally the entropy, per position.

    logits: ``[..., V_local]``, this rank's slice ``[tp_rank * V_local, (tp_rank + 1) * V_local)`` of the
    padded vocabulary; targets: ``[...]`` token ids (< ``vocab_size``, the real, unpadded size).
    """
    logits = logits.float()
    v_local = logits.shape[-1]
    start = tp_rank * v_local
    real = vocab_size - start  # columns of this slice that are real tokens
    if real < v_local:
        cols = torch.arange(v_local, device=logits.device)
        logits = logits.masked_fill(cols >= max(real, 0), _MASKED)
    distributed = tp_size > 1
    m = logits.detach().max(dim=-1, keepdim=True).values
    if distributed:
        m = _all_reduce(m, tp_group, "max")
    z = logits - m
    e = z.exp()
    sum_exp = e.sum(-1)
    local_t = targets - start
    in_slice = (local_t >= 0) & (local_t < v_local)
    z_t = torch.gather(z, -1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1) * in_slice
    if distributed:
        sum_exp = _all_reduce(sum_exp, tp_group)
        z_t = _all_reduce(z_t, tp_group)
    log_z = sum_exp.log()
    logp = z_t - log_z
    if not with_entropy:
        return logp, None
    ez = (e * z).sum(-1)
    if distributed:
        ez = _all_reduce(ez, tp_group)
    entropy = log_z - ez / sum_exp  # H = log Z - E_p[z]
    return logp, entropy
