"""Policy and value losses (torch): per-element terms, one masked aggregation, and ``policy_loss``,
the single actor loss the trainer calls for GRPO, RLOO, REINFORCE++ and PPO alike (they differ only
in how the advantages were computed, see ``advantages.py``)."""

from __future__ import annotations

import torch

from rollhpc.algo.kl import kl_estimate

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def clipped_pg_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantage: torch.Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None) -> torch.Tensor:
    """PPO's clipped surrogate, per element (aggregate outside). Asymmetric when clip_high != clip_low
    (DAPO's clip-higher).

    loss = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), ratio = exp(logp - old_logp).
    ``dual_clip`` c > 1 (Ye et al. 2020, dual-clip PPO) also caps the loss at -c * A where A < 0, so a
    token whose ratio exploded (stale or off-policy samples) cannot dominate the batch.
    """
    ratio = torch.exp(logprob - old_logprob)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = -torch.minimum(ratio * advantage, clipped * advantage)
    if dual_clip is None:
        return loss
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    return torch.where(advantage < 0, torch.minimum(loss, -dual_clip * advantage), loss)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None = 0.2) -> torch.Tensor:
    """PPO critic loss per element: 0.5 * max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2).

    The clipped branch keeps the critic near the values used to compute the advantages; ``clip=None``
    gives plain 0.5 * (v - R)^2.
    """
    unclipped = (values - returns).square()
    if clip is None:
        return 0.5 * unclipped
    clipped_values = torch.clamp(values, old_values - clip, old_values + clip)
    return 0.5 * torch.maximum(unclipped, (clipped_values - returns).square())


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last (vocab) dim: logsumexp(z) - sum softmax(z) * z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, global_tokens: float | None = None,
              global_seqs: float | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the valid (mask=1) tokens.

    - "token-mean": sum / number of valid tokens (DAPO; long answers weigh by their length).
    - "seq-mean-token-sum": per-row sum, mean over rows.
    - "seq-mean-token-mean": per-row mean, mean over rows (original GRPO; biased toward short answers).
    - "seq-mean-token-sum-norm": sum / (rows * T), T = loss.shape[1] (Dr. GRPO: a constant normaliser,
      no length bias; give every rank the same T so the constant really is one).

    "Rows" counts rows with at least one valid token, so all-padding rows neither dilute the mean nor
    produce NaN. For data parallelism pass the whole batch's counts as ``global_tokens`` (token-mean)
    or ``global_seqs`` (the seq-* modes): the ranks' results then sum to the whole-batch loss.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}")
    valid = mask.bool()
    masked = torch.where(valid, loss, torch.zeros_like(loss))  # not loss * mask: padding may hold inf/NaN
    row_tokens = valid.sum(dim=-1)
    if mode == "token-mean":
        tokens = row_tokens.sum().clamp(min=1) if global_tokens is None else max(global_tokens, 1)
        return masked.sum() / tokens
    seqs = (row_tokens > 0).sum().clamp(min=1) if global_seqs is None else max(global_seqs, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / seqs
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / row_tokens.clamp(min=1)).sum() / seqs
    return masked.sum() / (seqs * loss.shape[-1])


def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    return (x[valid].float().mean().item()) if valid.any() else 0.0


def policy_loss(logprob: torch.Tensor, old_logprob: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                *, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: str = "token-mean", ref_logprob: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_kind: str = "k3", entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                global_tokens: float | None = None,
                global_seqs: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Actor loss = agg(clipped pg) + kl_coef * agg(KL to ref) - entropy_coef * agg(entropy).

    All inputs [B, T]; ``advantage`` may be [B] (one value per sequence, broadcast over its tokens).
    Leave ``ref_logprob`` out when the KL is already in the rewards (PPO, REINFORCE++); pass it for
    GRPO-style "KL in loss". Metrics: "pg_loss", "kl", "entropy" are the aggregated terms (local
    shares when global counts are given); "clip_frac" and "ratio_mean" are over local valid tokens.
    """
    if advantage.dim() == 1:
        advantage = advantage.unsqueeze(-1)
    advantage = advantage.expand_as(logprob)

    def agg_(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs)

    pg = agg_(clipped_pg_loss(logprob, old_logprob, advantage, clip_low, clip_high, dual_clip))
    total = pg
    metrics = {"pg_loss": pg.item()}
    if ref_logprob is not None:
        kl = agg_(kl_estimate(logprob, ref_logprob, kl_kind))
        total = total + kl_coef * kl
        metrics["kl"] = kl.item()
    if entropy is not None:
        ent = agg_(entropy)
        total = total - entropy_coef * ent
        metrics["entropy"] = ent.item()
    with torch.no_grad():
        valid = mask.bool()
        ratio = torch.exp(logprob - old_logprob)
        clipped = ((advantage > 0) & (ratio > 1.0 + clip_high)) | ((advantage < 0) & (ratio < 1.0 - clip_low))
        metrics["clip_frac"] = _masked_mean(clipped, valid)
        metrics["ratio_mean"] = _masked_mean(ratio, valid)
        if dual_clip is not None:
            metrics["dual_clip_frac"] = _masked_mean((advantage < 0) & (ratio > dual_clip), valid)
    return total, metrics
