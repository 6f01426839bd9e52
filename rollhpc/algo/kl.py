"""Per-token estimators of KL(pi || pi_ref) from sampled log-probs (Schulman, "Approximating KL
Divergence", 2020). Samples come from pi, so with r = pi_ref / pi:

- k1 = log pi - log pi_ref: unbiased, high variance, can be negative per token.
- k2 = 0.5 * (log pi - log pi_ref)^2: biased but low variance, always >= 0.
- k3 = r - log r - 1: unbiased and low variance, always >= 0 (the usual GRPO choice as a loss term).
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")


def kl_estimate(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-element KL estimate of the sampling policy against the reference; see the module docstring."""
    log_ratio = logprob - ref_logprob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1.0
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {', '.join(KL_KINDS)}")
