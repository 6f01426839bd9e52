"""Mismatch correction (rollhpc.algo.correction) and the sequence-level objectives (rollhpc.algo.losses:
GSPO, its token variant, CISPO), each against values worked out by hand on small arrays."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rollhpc.algo.correction import CorrectionConfig, correct, mismatch_metrics
from rollhpc.algo.losses import pg_terms, policy_loss
from rollhpc.algo.objective import LossConfig

# two rows: ratios pi_old / mu of 1, 2, 1/2, 4 and of 1.5, 1.5 (then padding)
RHO = np.array([[1.0, 2.0, 0.5, 4.0], [1.5, 1.5, 1.0, 1.0]])
MASK = np.array([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=np.float32)
GEN = np.full(RHO.shape, -2.0, dtype=np.float32)
OLD = (GEN + np.log(RHO)).astype(np.float32)
SQRT2 = math.sqrt(2.0)  # row 0's geometric mean: (1 * 2 * 0.5 * 4) ** (1 / 4)


def run(**config):
    return correct(CorrectionConfig(**config), OLD, GEN, MASK)


def test_mismatch_metrics_are_k3_and_quantiles_of_the_ratios():
    m = mismatch_metrics(OLD, GEN, MASK)
    k3 = [r - 1 - math.log(r) for r in (1.0, 2.0, 0.5, 4.0, 1.5, 1.5)]
    assert m["mismatch_kl"] == pytest.approx(sum(k3) / 6, rel=1e-5)
    assert m["mismatch_ratio_max"] == pytest.approx(4.0, rel=1e-5)
    assert m["mismatch_ratio_p50"] == pytest.approx(1.5, rel=1e-5)
    assert m["mismatch_seq_ratio_p95"] <= 1.5 + 1e-5 and m["mismatch_seq_ratio_p05"] >= SQRT2 - 1e-5
    # engines that agree: no distance at all
    same = mismatch_metrics(GEN, GEN, MASK)
    assert same["mismatch_kl"] == 0.0 and same["mismatch_ratio_max"] == 1.0


def test_token_tis_truncates_at_the_cap():
    c = run(weight="token", cap=3.0)
    np.testing.assert_allclose(c.is_weight, [[1, 2, 0.5, 3], [1.5, 1.5, 0, 0]], rtol=1e-6)
    np.testing.assert_array_equal(c.loss_mask, MASK)  # weights only: nothing rejected
    assert c.metrics["correction_truncated_frac"] == pytest.approx(1 / 6)  # the 4 alone
    assert c.metrics["correction_masked_frac"] == 0.0
    w = np.array([1, 2, 0.5, 3, 1.5, 1.5])
    assert c.metrics["correction_ess"] == pytest.approx(w.sum() ** 2 / (6 * (w**2).sum()), rel=1e-6)


def test_sequence_weight_is_the_truncated_geometric_mean():
    c = run(weight="sequence", cap=2.0)
    np.testing.assert_allclose(c.is_weight, [[SQRT2] * 4, [1.5, 1.5, 0, 0]], rtol=1e-6)
    capped = run(weight="sequence", cap=1.2)
    np.testing.assert_allclose(capped.is_weight, [[1.2] * 4, [1.2, 1.2, 0, 0]], rtol=1e-6)
    assert capped.metrics["correction_truncated_frac"] == 1.0


def test_icepop_rejects_tokens_outside_the_band_and_weighs_the_rest():
    c = run(weight="token", cap=5.0, mask="token", mask_high=3.0)  # band [1/3, 3]
    np.testing.assert_array_equal(c.loss_mask, [[1, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_allclose(c.is_weight, [[1, 2, 0.5, 0], [1.5, 1.5, 0, 0]], rtol=1e-6)
    assert c.metrics["correction_masked_frac"] == pytest.approx(1 / 6)
    assert c.metrics["correction_masked_seq_frac"] == pytest.approx(1 / 2)
    # a lower bound of its own: 0.6 rejects the 0.5
    tight = run(mask="token", mask_low=0.6, mask_high=5.0)
    np.testing.assert_array_equal(tight.loss_mask, [[1, 1, 0, 1], [1, 1, 0, 0]])
    assert tight.is_weight is None


def test_sequence_mask_rejects_whole_rows():
    c = run(weight="sequence", mask="sequence", mask_high=1.45)  # MIS: sqrt(2) kept, 1.5 rejected
    np.testing.assert_array_equal(c.loss_mask, [[1, 1, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(c.is_weight, [[SQRT2] * 4, [0] * 4], rtol=1e-6)
    assert c.metrics["correction_masked_frac"] == pytest.approx(2 / 6)
    assert c.metrics["correction_masked_seq_frac"] == pytest.approx(1 / 2)


@pytest.mark.parametrize(
    "bad",
    [{"cap": 0.5}, {"mask_high": 1.0}, {"mask_low": 1.5}, {"weight": "row"}],
)
def test_bad_correction_settings_are_refused(bad):
    with pytest.raises(ValueError):
        CorrectionConfig(**bad)


def test_objective_settings_are_checked():
    with pytest.raises(ValueError, match="objective must be one of"):
        LossConfig(objective="grpo")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(objective="cispo", dual_clip=3.0)
    assert (
        not LossConfig().correction.enabled
        and LossConfig(correction=CorrectionConfig(mask="token")).correction.enabled
    )


def _grad(objective, new, old, adv, mask, agg="token-mean", **kw):
    """(loss, d loss / d new) of ``policy_loss``."""
    new = new.clone().requires_grad_(True)
    loss, metrics = policy_loss(new, old, adv, mask, objective=objective, agg=agg, **kw)
    loss.backward()
    return loss.item(), new.grad, metrics


def test_gspo_clips_the_sequence_ratio_and_spreads_its_gradient():
    # one row of two tokens: log ratios log 2 and 0, so s = sqrt(2)
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), 0.0]])
    mask = torch.ones(1, 2)
    terms, ratio, acted = pg_terms("gspo", new, old, torch.ones(1, 2), mask, 0.2, 0.28)
    torch.testing.assert_close(ratio, torch.full((1, 2), SQRT2))
    torch.testing.assert_close(
        terms, torch.full((1, 2), -1.28)
    )  # positive advantage: clipped at 1.28
    assert acted.all()
    # negative advantage: -min(-s, -1.28) = s, unclipped; d/dnew_t of s = s / 2 per token, averaged over 2
    for objective in ("gspo", "gspo-token"):
        loss, grad, m = _grad(
            objective, new, old, -torch.ones(1), mask, agg="seq-mean-token-mean", clip_low=0.2
        )
        assert loss == pytest.approx(SQRT2, rel=1e-6)
        torch.testing.assert_close(grad, torch.full((1, 2), SQRT2 / 2))
        assert m["clip_frac"] == 0.0 and m["ratio_mean"] == pytest.approx(SQRT2, rel=1e-6)


def test_gspo_token_takes_per_token_advantages():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), 0.0]])
    # s = sqrt(2) for both tokens; advantages -1 and -2: loss (s + 2s) / 2, each token's gradient s * A_t / 2
    loss, grad, _ = _grad("gspo-token", new, old, torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2))
    assert loss == pytest.approx(1.5 * SQRT2, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[SQRT2 / 2, SQRT2]]))


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    old = torch.zeros(1, 2)
    new = torch.tensor([[math.log(2.0), math.log(0.5)]])  # ratios 2 and 0.5
    mask, adv = torch.ones(1, 2), torch.ones(1)
    loss, grad, m = _grad("cispo", new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # weights clip(2) = 1.28 and clip(0.5) = 0.8, stop-gradient: d/dnew_t = -w_t * A / 2
    torch.testing.assert_close(grad, torch.tensor([[-0.64, -0.4]]))
    assert loss == pytest.approx(-(1.28 * math.log(2.0) + 0.8 * math.log(0.5)) / 2, rel=1e-6)
    assert m["clip_frac"] == 1.0
    # PPO-clip on the same tokens: the first (ratio 2 > 1.28, A > 0) has no gradient; the second -ratio * A / 2
    _, ppo_grad, _ = _grad("ppo", new, old, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, -0.25]]))


def test_importance_weights_scale_each_tokens_policy_gradient():
    old = torch.zeros(1, 3)
    new = torch.zeros(1, 3)
    weight = torch.tensor([[0.5, 2.0, 0.0]])  # the third rejected: 0, and off the mask
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, grad, _ = _grad("ppo", new, old, torch.ones(1), mask, is_weight=weight)
    assert loss == pytest.approx(-(0.5 + 2.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.25, -1.0, 0.0]]))
    # the default path: no weights, the same loss as before the correction existed
    plain, _, _ = _grad("ppo", new, old, torch.ones(1), mask)
    assert plain == pytest.approx(-1.0)
