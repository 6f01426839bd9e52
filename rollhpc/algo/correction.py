"""Training-inference mismatch correction: importance weights and rejection masks between the policy the
trainer optimises and the one that sampled (numpy, on the controller).

Three policies meet in a step: the generator's behaviour policy mu (its own log-probs of the tokens it sampled,
``gen_logprob``), the trainer's proximal policy pi_old (``old_logprob``: the trainer's forward at the weights it
is about to update) and pi_theta (the training forward). PPO's ratio pi_theta / pi_old is clipped as ever; the
correction multiplies each token's policy-gradient term by a weight w of the ratio rho = pi_old / mu, which is 1
only when both engines agree and the samples are of the current weights. vLLM's kernels, bf16 or FP8 rollouts,
MoE routing and async generation (``rollout.max_staleness >= 1``: the decoupled PPO of Hilton et al., where mu
is older than pi_old) all move it away from 1. Two orthogonal choices (``CorrectionConfig``):

- ``weight``: truncated importance sampling. ``token``: w_t = min(rho_t, cap) (TIS). ``sequence``: every token
  of a row gets min(rho_seq, cap), rho_seq = exp(mean_t log rho_t), the geometric mean over the row's tokens.
- ``mask``: rejection. ``token``: tokens with rho_t outside [mask_low, mask_high] leave the loss (with
  ``weight: token``: IcePop). ``sequence``: rows whose rho_seq is outside the band leave it (with ``weight:
  token``: NeMo-RL's sequence-mask TIS; with ``weight: sequence``: masked importance sampling, MIS).

Rejected tokens leave the loss mask (so they leave the normaliser too, as rejected samples); the weights go to
the trainer as ``TrainingBatch.is_weight``. The metrics (``mismatch_metrics``) are logged whenever a step has
both log-probs, with or without a correction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

# |log rho| beyond this is clamped before exponentiating: exp(20) ~ 5e8 is already "rejected" in any band
LOG_RATIO_BOUND = 20.0


@dataclass(kw_only=True)
class CorrectionConfig:
    """``pipeline.options.loss.correction``: what corrects for pi_old / mu (see the module docstring).
    Presets in other systems' words: TIS = {weight: token}; IcePop = {weight: token, mask: token,
    mask_low: 0.5, mask_high: 5, cap: 5}; MIS = {weight: sequence, mask: sequence};
    sequence-mask TIS = {weight: token, mask: sequence}."""

    weight: Literal["none", "token", "sequence"] = "none"
    cap: float = 2.0  # truncation: weights above it become it
    mask: Literal["none", "token", "sequence"] = "none"
    mask_high: float = 2.0  # ratios above it are rejected
    mask_low: float | None = None  # ratios below it are rejected; None: 1 / mask_high

    def __post_init__(self) -> None:
        for key in ("weight", "mask"):
            if getattr(self, key) not in ("none", "token", "sequence"):
                raise ValueError(
                    f"{key} must be none, token or sequence, got {getattr(self, key)!r}"
                )
        if self.cap < 1:
            raise ValueError(f"cap must be >= 1 (a truncation from above), got {self.cap}")
        if self.mask_high <= 1:
            raise ValueError(f"mask_high must be > 1, got {self.mask_high}")
        if self.mask_low is not None and not 0 < self.mask_low < 1:
            raise ValueError(f"mask_low must be in (0, 1), got {self.mask_low}")

    @property
    def enabled(self) -> bool:
        """Whether the step weights or rejects anything (then it needs the trainer's old log-probs)."""
        return self.weight != "none" or self.mask != "none"

    @property
    def band(self) -> tuple[float, float]:
        """The ratios a mask keeps, [low, high]."""
        return (1.0 / self.mask_high if self.mask_low is None else self.mask_low), self.mask_high


@dataclass(eq=False)  # numpy fields
class Corrected:
    """A batch's correction: its loss mask with the rejected tokens 0, the weight of every token (0 where the
    mask is 0; None without ``weight``), and what was done, as metrics."""

    loss_mask: np.ndarray
    is_weight: np.ndarray | None
    metrics: dict[str, float]


def log_ratios(
    old_logprob: np.ndarray, gen_logprob: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(log rho per token [B, T], 0 off the mask; log rho_seq per row [B], the mean over its tokens, 0 for a
    row without any), clamped to +-``LOG_RATIO_BOUND``."""
    valid = mask > 0
    diff = np.asarray(old_logprob, np.float64) - np.asarray(gen_logprob, np.float64)
    token = np.clip(np.where(valid, diff, 0.0), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    seq = token.sum(-1) / np.maximum(valid.sum(-1), 1)
    return token, seq


def mismatch_metrics(
    old_logprob: np.ndarray, gen_logprob: np.ndarray, mask: np.ndarray
) -> dict[str, float]:
    """How far the trainer's policy is from the generator's on the sampled tokens: ``mismatch_kl``, the k3
    estimate of KL(mu || pi_old) per token ((rho - 1) - log rho, unbiased for samples of mu), and quantiles of
    the token ratios rho and of the rows' geometric-mean ratios rho_seq."""
    valid = mask > 0
    if not valid.any():
        return {}
    token, seq = log_ratios(old_logprob, gen_logprob, mask)
    lr = token[valid]
    rows = seq[valid.any(-1)]
    ratio, seq_ratio = np.exp(lr), np.exp(rows)
    q = np.quantile(ratio, [0.05, 0.5, 0.95])
    sq = np.quantile(seq_ratio, [0.05, 0.95])
    return {
        "mismatch_kl": float(np.mean(ratio - 1.0 - lr)),
        "mismatch_ratio_p05": float(q[0]),
        "mismatch_ratio_p50": float(q[1]),
        "mismatch_ratio_p95": float(q[2]),
        "mismatch_ratio_max": float(ratio.max()),
        "mismatch_seq_ratio_p05": float(sq[0]),
        "mismatch_seq_ratio_p95": float(sq[1]),
    }


def correct(
    config: CorrectionConfig, old_logprob: np.ndarray, gen_logprob: np.ndarray, mask: np.ndarray
) -> Corrected:
    """The weights and rejections ``config`` asks for, over the [B, T] log-probs of the mask's tokens."""
    token, seq = log_ratios(old_logprob, gen_logprob, mask)
    valid = mask > 0
    rho, rho_seq = np.exp(token), np.exp(seq)
    low, high = config.band
    keep = valid
    if config.mask == "token":
        keep = valid & (rho >= low) & (rho <= high)
    elif config.mask == "sequence":
        keep = valid & ((rho_seq >= low) & (rho_seq <= high))[:, None]
    weight, truncated = None, np.zeros_like(valid)
    if config.weight != "none":
        raw = rho if config.weight == "token" else np.broadcast_to(rho_seq[:, None], rho.shape)
        truncated = keep & (raw > config.cap)
        weight = np.where(keep, np.minimum(raw, config.cap), 0.0).astype(np.float32)
    new_mask = np.where(keep, mask, 0).astype(np.asarray(mask).dtype)
    return Corrected(new_mask, weight, _correction_metrics(valid, keep, truncated, weight))


def _correction_metrics(
    valid: np.ndarray, keep: np.ndarray, truncated: np.ndarray, weight: np.ndarray | None
) -> dict[str, float]:
    """Shares of the valid tokens (and rows) rejected and truncated; the kept weights' mean and their effective
    sample size as a share of the kept tokens ((sum w)^2 / (n sum w^2): 1 when all weights are equal)."""
    n = max(int(valid.sum()), 1)
    rows = valid.any(-1)
    out = {
        "correction_masked_frac": float((valid & ~keep).sum() / n),
        "correction_masked_seq_frac": float(
            (rows & (valid & ~keep).any(-1)).sum() / max(int(rows.sum()), 1)
        ),
        "correction_truncated_frac": float(truncated.sum() / n),
    }
    if weight is not None and keep.any():
        w = weight[keep].astype(np.float64)
        out["correction_weight_mean"] = float(w.mean())
        out["correction_ess"] = float(w.sum() ** 2 / (len(w) * np.square(w).sum()))
    return out
