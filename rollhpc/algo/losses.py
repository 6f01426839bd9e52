"""Policy and value losses (torch): per-element terms, one masked aggregation, and ``policy_loss``,
the single actor loss the trainer calls for GRPO, RLOO, REINFORCE++ and PPO alike (they differ only
in how the advantages were computed, see ``advantages.py``). ``PolicyLoss`` and ``ValueLoss`` are the
objects a trainer's mini-batch loop calls on each micro-batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from rollhpc.algo.kl import kl_estimate
from rollhpc.algo.objective import LossConfig

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def clipped_pg_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantage: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> torch.Tensor:
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


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
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


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> torch.Tensor:
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
        raise ValueError(
            f"unknown aggregation mode {mode!r}; expected one of {', '.join(AGG_MODES)}"
        )
    valid = mask.bool()
    # not loss * mask: padding may hold inf/NaN
    masked = torch.where(valid, loss, torch.zeros_like(loss))
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


def sequence_log_ratio(
    logprob: torch.Tensor, old_logprob: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Each row's mean of log(pi / pi_old) over its valid tokens, [B, 1] (0 for a row without any)."""
    valid = mask.bool()
    diff = torch.where(valid, logprob - old_logprob, torch.zeros_like(logprob))
    return diff.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)


def pg_terms(
    objective: str,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token policy-gradient loss, the ratio it used, where the clip acted), all [B, T]; ``advantage`` [B, T].
    With r_t = exp(logp_t - old_t), s = exp(mean_t(logp_t - old_t)) over a row's tokens and sg the stop-gradient:

    - ppo: -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) (``clipped_pg_loss``, dual clip included).
    - gspo (Zheng et al. 2025): -min(s A_t, clip(s, ...) A_t): one ratio and one clip per sequence, whose gradient
      reaches every token of the row through the mean.
    - gspo-token: the same with s_t = sg(s) exp(logp_t - sg(logp_t)): s's value, each token's own gradient, so
      advantages may differ per token; with one advantage per row and ``seq-mean-token-mean`` it equals gspo.
    - cispo (MiniMax-M1): -sg(clip(r_t, ...)) A_t logp_t: the clipped ratio only weighs the token's log-prob
      gradient, so a clipped token still learns (PPO's clip zeroes it).
    """
    if objective == "ppo":
        ratio = torch.exp(logprob - old_logprob)
        loss = clipped_pg_loss(logprob, old_logprob, advantage, clip_low, clip_high, dual_clip)
        return loss, ratio, _clip_acted(ratio, advantage, clip_low, clip_high)
    if objective in ("gspo", "gspo-token"):
        log_s = sequence_log_ratio(logprob, old_logprob, mask)
        if objective == "gspo-token":
            ratio = torch.exp(log_s.detach() + logprob - logprob.detach())
        else:
            ratio = torch.exp(log_s).expand_as(logprob)
        clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
        loss = -torch.minimum(ratio * advantage, clipped * advantage)
        return loss, ratio, _clip_acted(ratio, advantage, clip_low, clip_high)
    if objective == "cispo":
        ratio = torch.exp(logprob - old_logprob)
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).detach()
        acted = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        return -weight * advantage * logprob, ratio, acted
    raise ValueError(f"unknown objective {objective!r}")


def _clip_acted(
    ratio: torch.Tensor, advantage: torch.Tensor, clip_low: float, clip_high: float
) -> torch.Tensor:
    """Where a min-of-clipped surrogate takes the clipped branch (its gradient is then 0)."""
    return ((advantage > 0) & (ratio > 1.0 + clip_high)) | (
        (advantage < 0) & (ratio < 1.0 - clip_low)
    )


def policy_loss(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    *,
    objective: str = "ppo",
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    is_weight: torch.Tensor | None = None,
    ref_logprob: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Actor loss = agg(is_weight * pg) + kl_coef * agg(KL to ref) - entropy_coef * agg(entropy), with pg the
    ``objective``'s per-token term (``pg_terms``).

    All inputs [B, T]; ``advantage`` may be [B] (one value per sequence, broadcast over its tokens).
    ``is_weight``: the mismatch correction's weights (rollhpc.algo.correction), detached; None: 1.
    Leave ``ref_logprob`` out when the KL is already in the rewards (PPO, REINFORCE++); pass it for
    GRPO-style "KL in loss". Metrics: "pg_loss", "kl", "entropy" are the aggregated terms (local
    shares when global counts are given); "clip_frac" and "ratio_mean" are over local valid tokens.
    """
    if advantage.dim() == 1:
        advantage = advantage.unsqueeze(-1)
    advantage = advantage.expand_as(logprob)

    def agg_(x: torch.Tensor) -> torch.Tensor:
        return aggregate(x, mask, agg, global_tokens=global_tokens, global_seqs=global_seqs)

    per_token, ratio, clip_acted = pg_terms(
        objective, logprob, old_logprob, advantage, mask, clip_low, clip_high, dual_clip
    )
    if is_weight is not None:
        per_token = per_token * is_weight
    pg = agg_(per_token)
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
        metrics["clip_frac"] = _masked_mean(clip_acted, valid)
        metrics["ratio_mean"] = _masked_mean(ratio.detach(), valid)
        if dual_clip is not None:
            metrics["dual_clip_frac"] = _masked_mean((advantage < 0) & (ratio > dual_clip), valid)
    return total, metrics


@dataclass(frozen=True)
class TokenCounts:
    """One mini-batch's counts, summed over the data-parallel ranks: they turn each micro-batch's loss into its
    share of the mini-batch's (DDP then sums gradients), and its rates into shares of the trained tokens'."""

    loss_tokens: float  # loss tokens in the mini-batch's rows
    loss_rows: float  # rows with at least one loss token
    trained_tokens: (
        float  # loss tokens of the rows that run forward and backward (skipped rows left out)
    )


# one micro-batch's named [b, ...] tensors on the device ("loss_mask", ...)
MicroBatch = Mapping[str, torch.Tensor]


class PolicyLoss:
    """The actor's loss on one micro-batch, as ``LossConfig`` says: ``policy_loss`` with its metrics.

    Reads the micro-batch's ``loss_mask``, ``advantage`` and, when given, ``old_logprob`` (absent: on-policy, the
    ratio is exactly 1), ``is_weight`` (the mismatch correction), ``ref_logprob`` (a KL term) and ``gen_logprob`` (``logprob_abs_diff``, how far the
    trainer's log-probs are from the generator's, per trained token). A new objective is a new class like this.
    """

    def __init__(self, config: LossConfig):
        self.config = config

    @property
    def needs_entropy(self) -> bool:
        """Whether the trainer must compute the entropy of its distribution (an entropy bonus)."""
        return self.config.entropy_coef > 0

    def __call__(
        self,
        logprob: torch.Tensor,
        entropy: torch.Tensor | None,
        micro: MicroBatch,
        counts: TokenCounts,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(the loss to back-propagate, its metrics): loss terms are shares of the mini-batch's loss; rates
        (``*_frac``, ``*_mean``) and ``logprob_abs_diff`` are weighted by the micro-batch's share of the trained
        tokens, so that summing the micro-batches' metrics over the mini-batch gives its values."""
        c = self.config
        # without old_logprob the update is on-policy (one optimizer step on a batch of the current weights): the
        # old log-probs are this forward's own, and the ratio is exactly 1
        old = micro["old_logprob"].float() if "old_logprob" in micro else logprob.detach().float()
        value, stats = policy_loss(
            logprob,
            old,
            micro["advantage"].float(),
            micro["loss_mask"].float(),
            objective=c.objective,
            clip_low=c.clip_low,
            clip_high=c.clip_high,
            dual_clip=c.dual_clip,
            agg=c.agg,
            is_weight=micro["is_weight"].float() if "is_weight" in micro else None,
            ref_logprob=micro["ref_logprob"].float() if "ref_logprob" in micro else None,
            kl_coef=c.kl_coef,
            kl_kind=c.kl_kind,
            entropy=entropy,
            entropy_coef=c.entropy_coef,
            global_tokens=max(counts.loss_tokens, 1.0),
            global_seqs=max(counts.loss_rows, 1.0),
        )
        # token share of the trained rows, for averaging rates (skipped rows have no ratio to report)
        token_share = float(micro["loss_mask"].sum()) / max(counts.trained_tokens, 1.0)
        metrics = {
            k: float(v) * (token_share if k.endswith(("_frac", "_mean")) else 1.0)
            for k, v in stats.items()
        }
        metrics["loss"] = float(value.detach())
        # the generator's log-probs of these tokens: how far apart the engines are
        if "gen_logprob" in micro:
            diff = (
                (logprob.detach().float() - micro["gen_logprob"].float()).abs() * micro["loss_mask"]
            ).sum()
            metrics["logprob_abs_diff"] = float(diff) / max(counts.trained_tokens, 1.0)
        return value, metrics


class ValueLoss:
    """The critic's loss on one micro-batch: ``value_loss`` (clipped by ``clip``), token-mean over ``loss_mask``,
    against the micro-batch's ``returns`` and ``old_values``."""

    def __init__(self, clip: float | None = 0.2):
        self.clip = clip

    def __call__(
        self, values: torch.Tensor, micro: MicroBatch, counts: TokenCounts
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """(the loss to back-propagate, ``{"value_loss": its value}``), a share of the mini-batch's loss."""
        per_token = value_loss(
            values, micro["old_values"].float(), micro["returns"].float(), clip=self.clip
        )
        value = aggregate(
            per_token,
            micro["loss_mask"].float(),
            "token-mean",
            global_tokens=max(counts.loss_tokens, 1.0),
        )
        return value, {"value_loss": float(value.detach())}
