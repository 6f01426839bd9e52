import numpy as np
import pytest
import torch

from rollhpc.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_level_rewards,
    whiten,
)
from rollhpc.algo.kl import kl_estimate
from rollhpc.algo.losses import (
    aggregate,
    clipped_pg_loss,
    entropy_from_logits,
    policy_loss,
    value_loss,
)


def test_grpo_advantages_by_hand():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = grpo_advantages(r, eps=0.0 + 1e-12)
    # group 1: mean 0.5, std 0.5 -> +-1; group 2: all equal -> no signal
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-9)
    np.testing.assert_allclose(adv[1], [0, 0, 0, 0])
    np.testing.assert_allclose(grpo_advantages(r, scale=False)[0], [0.5, -0.5, -0.5, 0.5])


def test_grpo_needs_groups():
    with pytest.raises(ValueError, match="n_prompts, group_size"):
        grpo_advantages(np.zeros(4))


def test_clipped_pg_loss_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    new = torch.log(torch.tensor([0.5, 0.8, 0.2, 0.8]))  # ratios 1.0, 1.6, 0.4, 1.6
    adv = torch.tensor([2.0, 1.0, -1.0, -1.0])
    loss = clipped_pg_loss(new, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0 clips above at 1.28; A<0 takes the larger penalty: min(0.4*-1, 0.8*-1) = -0.8; min(1.6*-1, 1.28*-1) = -1.6
    torch.testing.assert_close(loss, torch.tensor([-2.0, -1.28, 0.8, 1.6]))


# ---- RLOO, REINFORCE++, GAE, token rewards (numpy) ----


def test_rloo_leave_one_out_by_hand():
    r = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 0.0, 0.0]])
    # row 0: a 1 sees others (0+0+1)/3 = 1/3 -> 2/3; a 0 sees (1+0+1)/3 = 2/3 -> -2/3
    # row 1: 3 - (1+0+0)/3 = 8/3; 1 - (3+0+0)/3 = 0; 0 - (3+1+0)/3 = -4/3
    np.testing.assert_allclose(
        rloo_advantages(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [8 / 3, 0.0, -4 / 3, -4 / 3]]
    )
    # k=2: r_i - r_other
    np.testing.assert_allclose(rloo_advantages(np.array([[3.0, 1.0]])), [[2.0, -2.0]])


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(np.array([[1.0], [0.0]]))
    with pytest.raises(ValueError, match="n_prompts, k"):
        rloo_advantages(np.zeros(4))


def test_whiten_by_hand():
    x = np.array([[2.0, 4.0, 4.0, 4.0, 1000.0], [5.0, 5.0, 7.0, 9.0, -1000.0]])
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    # valid 2,4,4,4,5,5,7,9: mean 40/8 = 5, squared deviations 9+1+1+1+0+0+4+16 = 32 -> var 4, std 2
    np.testing.assert_allclose(
        whiten(x, mask, eps=0.0), [[-1.5, -0.5, -0.5, -0.5, 0.0], [0.0, 0.0, 1.0, 2.0, 0.0]]
    )
    np.testing.assert_array_equal(whiten(x, np.zeros_like(mask)), np.zeros_like(x))


def test_reinforce_pp_discounted_returns_whitened_over_batch():
    # the 9 sits on padding: ignored
    rewards = np.array([[0.0, 0.0, 1.0, 9.0], [0.0, 2.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    # gamma 0.5 returns: row 0: G2 = 1, G1 = 0.5, G0 = 0.25; row 1: G1 = 2, G0 = 1
    # batch of 0.25, 0.5, 1, 2, 1: mean 4.75/5 = 0.95, deviations -0.7 -0.45 0.05 1.05 0.05,
    # squares .49 + .2025 + .0025 + 1.1025 + .0025 = 1.8 -> var .36, std .6
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5, eps=0.0)
    np.testing.assert_allclose(
        adv, [[-0.7 / 0.6, -0.45 / 0.6, 0.05 / 0.6, 0.0], [0.05 / 0.6, 1.05 / 0.6, 0.0, 0.0]]
    )


def test_reinforce_pp_gamma_one_is_whitened_outcome_reward():
    rewards = np.array([[0.0, 1.0], [0.0, 0.0]])
    mask = np.ones((2, 2))
    # returns 1, 1, 0, 0: mean 0.5, std 0.5 -> +-1
    np.testing.assert_allclose(
        reinforce_pp_advantages(rewards, mask, eps=0.0), [[1.0, 1.0], [-1.0, -1.0]]
    )


def test_gae_with_gamma_lam_one_is_return_minus_value():
    rewards = np.array([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 0.0, 0.0]])
    values = np.array([[0.5, 0.2, 0.7, 3.0], [1.0, 1.5, 5.0, 5.0]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # returns-to-go: row 0 = 1, 1, 1; row 1 = 2, 2. advantage = return - value
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    np.testing.assert_allclose(adv, [[0.5, 0.8, 0.3, 0.0], [1.0, 0.5, 0.0, 0.0]])


def test_gae_discounted_by_hand():
    rewards, values, mask = (
        np.array([[0.0, 0.0, 1.0]]),
        np.array([[0.5, 0.2, 0.7]]),
        np.ones((1, 3)),
    )
    # gamma 0.5: delta2 = 1 + 0 - 0.7 = 0.3, delta1 = 0 + 0.5*0.7 - 0.2 = 0.15, delta0 = 0 + 0.5*0.2 - 0.5 = -0.4
    # lam 0.5 (gamma*lam = 0.25): A2 = 0.3, A1 = 0.15 + 0.25*0.3 = 0.225, A0 = -0.4 + 0.25*0.225 = -0.34375
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    np.testing.assert_allclose(adv, [[-0.34375, 0.225, 0.3]])
    np.testing.assert_allclose(ret, [[0.15625, 0.425, 1.0]])  # A + V
    adv0, _ = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.0)  # lam 0: one-step TD error
    np.testing.assert_allclose(adv0, [[-0.4, 0.15, 0.3]])


def test_gae_along_a_multi_turn_row_skips_the_environments_tokens():
    """An agentic row: turn 1 (tokens 0-1), the environment's observation (2-3, masked), turn 2 (4-5). Each
    turn's reward sits on its last token; the observation's tokens are neither valued nor discounted over, so
    token 1 looks ahead to token 4."""
    rewards = np.array([[0.0, -0.1, 0.0, 0.0, 0.0, 10.9]])
    values = np.array([[1.0, 2.0, 99.0, 99.0, 4.0, 8.0]])  # the masked values must not enter
    mask = np.array([[1, 1, 0, 0, 1, 1]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, [[10.8, 10.8, 0.0, 0.0, 10.9, 10.9]])
    np.testing.assert_allclose(adv, [[9.8, 8.8, 0.0, 0.0, 6.9, 2.9]])
    # gamma 0.5, lam 0.5: delta5 = 10.9 - 8 = 2.9; delta4 = 0.5*8 - 4 = 0; delta1 = -0.1 + 0.5*4 - 2 = -0.1;
    # delta0 = 0.5*2 - 1 = 0. A5 = 2.9, A4 = 0 + 0.25*2.9 = 0.725, A1 = -0.1 + 0.25*0.725 = 0.08125,
    # A0 = 0 + 0.25*0.08125 = 0.0203125
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    np.testing.assert_allclose(adv, [[0.0203125, 0.08125, 0.0, 0.0, 0.725, 2.9]])
    np.testing.assert_allclose(ret, [[1.0203125, 2.08125, 0.0, 0.0, 4.725, 10.9]])


def test_token_level_rewards_last_token_and_kl():
    seq = np.array([1.0, -1.0, 5.0])
    mask = np.array([[1, 1, 0], [1, 1, 1], [0, 0, 0]])  # third row: no response at all
    np.testing.assert_allclose(token_level_rewards(seq, mask), [[0, 1, 0], [0, 0, -1], [0, 0, 0]])
    kl = np.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    # -0.5*kl on valid tokens: row 0 = -0.05, 1 - 0.1; row 1 = -0.2, -0.25, -1 - 0.3
    np.testing.assert_allclose(
        token_level_rewards(seq, mask, kl=kl, kl_coef=0.5),
        [[-0.05, 0.9, 0.0], [-0.2, -0.25, -1.3], [0.0, 0.0, 0.0]],
    )
    with pytest.raises(ValueError, match="seq_rewards"):
        token_level_rewards(np.zeros(2), mask)


# ---- KL estimators ----


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.25, 0.3]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.3]))
    # log ratio = ln2, -ln2, 0 (ln2 = 0.693147)
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k1"), torch.tensor([0.693147, -0.693147, 0.0])
    )
    # 0.5 * ln2^2 = 0.240227
    torch.testing.assert_close(
        kl_estimate(logp, ref, "k2"), torch.tensor([0.240227, 0.240227, 0.0])
    )
    # k3 with r = ref/p: r = 0.5 -> 0.5 + ln2 - 1 = 0.193147; r = 2 -> 2 - ln2 - 1 = 0.306853; r = 1 -> 0
    torch.testing.assert_close(kl_estimate(logp, ref), torch.tensor([0.193147, 0.306853, 0.0]))


def test_k3_is_non_negative_and_zero_when_equal():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=g) * 3, torch.randn(1000, generator=g) * 3
    assert (kl_estimate(a, b, "k3") >= 0).all()
    assert (kl_estimate(a, a, "k3") == 0).all()


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")


# ---- losses ----


def test_dual_clip_caps_large_ratio_negative_advantage():
    old = torch.log(torch.tensor([0.1, 0.1, 0.1]))
    new = torch.log(torch.tensor([0.4, 0.2, 0.4]))  # ratios 4, 2, 4
    adv = torch.tensor([-1.0, -1.0, 1.0])
    # plain PPO: A<0 -> -min(-4, -1.2) = 4 and -min(-2, -1.2) = 2; A>0 clips at 1.2 -> -1.2
    torch.testing.assert_close(clipped_pg_loss(new, old, adv), torch.tensor([4.0, 2.0, -1.2]))
    # dual clip c = 3 caps A<0 at -c*A = 3: 4 -> 3, 2 stays; A>0 untouched
    torch.testing.assert_close(
        clipped_pg_loss(new, old, adv, dual_clip=3.0), torch.tensor([3.0, 2.0, -1.2])
    )
    loss, m = policy_loss(new[None], old[None], adv[None], torch.ones(1, 3), dual_clip=3.0)
    # token-mean (3 + 2 - 1.2) / 3; the standard clip acts on the A>0 token only, the dual clip on the first
    torch.testing.assert_close(loss, torch.tensor(3.8 / 3))
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["dual_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        clipped_pg_loss(new, old, adv, dual_clip=1.0)


def test_value_loss_by_hand():
    v = torch.tensor([1.0, 1.0, 0.0])
    old = torch.tensor([0.8, 0.5, 0.5])
    ret = torch.tensor([2.0, 2.0, 0.0])
    # 1: v inside [0.6, 1.0]: 0.5 * 1^2 = 0.5
    # 2: v clipped to 0.7: max((1-2)^2, (0.7-2)^2 = 1.69) -> 0.845
    # 3: v clipped to 0.3: max(0, 0.09) -> 0.045
    torch.testing.assert_close(value_loss(v, old, ret, clip=0.2), torch.tensor([0.5, 0.845, 0.045]))
    torch.testing.assert_close(value_loss(v, old, ret, clip=None), torch.tensor([0.5, 0.5, 0.0]))


def test_entropy_from_logits_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, float(np.log(3.0)), -1e4, -1e4]])
    # uniform over 4: ln 4 = 1.386294; p = (1/4, 3/4): 0.25*ln4 + 0.75*ln(4/3) = 0.346574 + 0.215762 = 0.562335
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([1.386294, 0.562335]))


LOSS_2x3 = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, float("nan")]])  # NaN on the padded position
MASK_2x3 = torch.tensor([[1, 1, 1], [1, 1, 0]])
AGG_BY_HAND = {
    "token-mean": 3.0,  # (1+2+3+4+5) / 5 tokens
    "seq-mean-token-sum": 7.5,  # (6 + 9) / 2 rows
    "seq-mean-token-mean": 3.25,  # (6/3 + 9/2) / 2 = (2 + 4.5) / 2
    "seq-mean-token-sum-norm": 2.5,  # 15 / (2 rows * T=3)
}


@pytest.mark.parametrize("mode", list(AGG_BY_HAND))
def test_aggregate_modes_by_hand(mode):
    torch.testing.assert_close(aggregate(LOSS_2x3, MASK_2x3, mode), torch.tensor(AGG_BY_HAND[mode]))


@pytest.mark.parametrize("mode", list(AGG_BY_HAND))
def test_aggregate_global_counts_split_over_ranks(mode):
    # rank 0 holds row 0, rank 1 row 1; whole batch: 5 tokens, 2 sequences
    parts = [
        aggregate(LOSS_2x3[i : i + 1], MASK_2x3[i : i + 1], mode, global_tokens=5, global_seqs=2)
        for i in (0, 1)
    ]
    torch.testing.assert_close(parts[0] + parts[1], torch.tensor(AGG_BY_HAND[mode]))


def test_aggregate_empty_rows_do_not_nan():
    loss = torch.tensor([[1.0, 2.0], [5.0, 5.0]], requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    # the empty row is ignored: token-mean 3/2, seq sums 3/1, seq means 1.5/1, sum-norm 3/(1*2)
    expected = {
        "token-mean": 1.5,
        "seq-mean-token-sum": 3.0,
        "seq-mean-token-mean": 1.5,
        "seq-mean-token-sum-norm": 1.5,
    }
    for mode, value in expected.items():
        out = aggregate(loss, mask, mode)
        torch.testing.assert_close(out, torch.tensor(value))
        out.backward()
        assert torch.isfinite(loss.grad).all()
        assert aggregate(loss, torch.zeros_like(mask), mode).item() == 0.0  # nothing valid at all


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum"):
        aggregate(LOSS_2x3, MASK_2x3, "mean")


def _policy_case():
    old = torch.log(torch.full((2, 3), 0.5))
    new = torch.log(torch.tensor([[0.5, 0.8, 0.5], [0.2, 0.5, 0.9]])).requires_grad_()
    return new, old, torch.tensor([1.0, -1.0]), torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_policy_loss_by_hand():
    new, old, adv, mask = _policy_case()
    ref = (new - 0.1).detach()  # k1 = 0.1 on every token
    loss, m = policy_loss(
        new,
        old,
        adv,
        mask,
        ref_logprob=ref,
        kl_coef=0.5,
        kl_kind="k1",
        entropy=torch.full((2, 3), 2.0),
        entropy_coef=0.01,
    )
    # ratios row 0: 1, 1.6, 1 with A=+1 -> -1, -1.2 (clipped at 1.2), -1
    # ratios row 1: 0.4, 1 with A=-1 -> -min(-0.4, -0.8) = 0.8 (clipped at 0.8), 1; padding ignored
    # pg token-mean: (-1 - 1.2 - 1 + 0.8 + 1) / 5 = -1.4 / 5 = -0.28
    # total: -0.28 + 0.5 * 0.1 - 0.01 * 2.0 = -0.25
    torch.testing.assert_close(loss, torch.tensor(-0.25))
    assert m["pg_loss"] == pytest.approx(-0.28) and m["kl"] == pytest.approx(0.1)
    assert m["entropy"] == pytest.approx(2.0)
    assert m["clip_frac"] == pytest.approx(2 / 5)  # the 1.6 and the 0.4
    assert m["ratio_mean"] == pytest.approx(1.0)  # (1 + 1.6 + 1 + 0.4 + 1) / 5
    loss.backward()
    assert torch.isfinite(new.grad).all() and (new.grad[1, 2] == 0)


def test_policy_loss_sequence_advantage_broadcasts():
    new, old, adv, mask = _policy_case()
    a, m = policy_loss(new, old, adv, mask, agg="seq-mean-token-mean")
    b, _ = policy_loss(new, old, adv[:, None].expand(2, 3), mask, agg="seq-mean-token-mean")
    # rows: (-1 - 1.2 - 1) / 3 = -16/15 and (0.8 + 1) / 2 = 0.9; mean = (-1.0666667 + 0.9) / 2
    torch.testing.assert_close(a, torch.tensor(-0.0833333))
    torch.testing.assert_close(a, b)
    assert set(m) == {"pg_loss", "clip_frac", "ratio_mean"}


def test_adaptive_kl_controller_by_hand():
    from rollhpc.algo.kl_control import KlControlConfig, KlController

    c = KlController(KlControlConfig(kind="adaptive", target=0.1, horizon=100, max_error=0.2))
    # kl 0.5 is 5x the target: error clipped to +0.2; 10 samples -> scale * (1 + 0.2 * 10 / 100) = 1.02
    assert c.update(0.5, 10) == pytest.approx(1.02)
    # kl 0.09: error -0.1 -> 1.02 * (1 - 0.1 * 50 / 100) = 0.969
    assert c.update(0.09, 50) == pytest.approx(0.969)
    again = KlController(c.config)
    again.load_state_dict(c.state_dict())
    assert again.update(0.2, 10) == c.update(0.2, 10)
    fixed = KlController(KlControlConfig())
    assert fixed.update(10.0, 1000) == 1.0
    with pytest.raises(ValueError, match="target > 0"):
        KlControlConfig(kind="adaptive", target=0.0)


def test_running_reward_moments_match_the_whole_history_and_resume():
    from rollhpc.algo.reward_norm import RewardNormalizer, RewardNormConfig, RunningMoments

    batches = [
        np.array([1.0, 0.0, 0.0, 1.0]),
        np.array([3.0, 1.0]),
        np.array([[2.0, 2.0], [0.0, 5.0]]),
    ]
    m = RunningMoments()
    for b in batches:
        m.update(b)
    seen = np.concatenate([b.reshape(-1) for b in batches])
    assert (
        m.count == 10
        and m.mean == pytest.approx(seen.mean())
        and m.std == pytest.approx(seen.std())
    )

    norm = RewardNormalizer(RewardNormConfig(kind="running", clip=1.5))
    out = norm(np.array([1.0, 0.0, 0.0, 1.0]))  # mean 0.5, std 0.5 -> +-1
    np.testing.assert_allclose(out, [1, -1, -1, 1], atol=1e-5)
    resumed = RewardNormalizer(norm.config)
    resumed.load_state_dict(norm.state_dict())
    # 4 more: [3, 3, 3, 3] -> 8 seen, mean 1.75, var (2 * 0.75^2 + 2 * 1.75^2 + 4 * 1.25^2) / 8 = 1.6875
    a, b = norm(np.full(4, 3.0)), resumed(np.full(4, 3.0))
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, np.full(4, 1.25 / np.sqrt(1.6875)), rtol=1e-5)
    np.testing.assert_allclose(resumed(np.array([100.0])), [1.5])  # clipped
    assert RewardNormalizer(RewardNormConfig())(np.array([7.0])) == 7.0  # kind none: untouched


def test_learning_rate_warms_up_then_decays_to_its_floor():
    from rollhpc.algo.lr_schedule import learning_rate

    kw = dict(lr=1.0, warmup_steps=4, decay_steps=10, min_lr=0.1)
    # warm-up, whatever the schedule
    assert [learning_rate(s, **kw) for s in range(4)] == [
        0.25,
        0.5,
        0.75,
        1.0,
    ]
    assert all(learning_rate(s, **kw) == 1.0 for s in range(4, 40))  # constant by default
    for schedule in ("linear", "cosine"):
        rates = [learning_rate(s, schedule=schedule, **kw) for s in range(3, 20)]
        assert rates[0] == rates[1] == 1.0  # the last warm-up step and the first decay step
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # never rises
        # the floor
        assert rates[-1] == learning_rate(100, schedule=schedule, **kw) == pytest.approx(0.1)
    assert learning_rate(9, schedule="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way
    assert learning_rate(9, schedule="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    # cosine: slow start
    assert learning_rate(6, schedule="cosine", **kw) > learning_rate(6, schedule="linear", **kw)
    with pytest.raises(ValueError, match="unknown learning-rate schedule"):
        learning_rate(5, schedule="step", **kw)


def test_outcome_advantages_pick_the_estimator_and_fold_kl_into_rewards():
    """algo.advantages.outcome_advantages, what the RLVR pipeline calls for every algorithm but PPO."""
    from rollhpc.algo import advantages as adv

    rng = np.random.default_rng(0)
    rewards = rng.normal(size=(3, 4))
    mask = np.zeros((12, 6))
    for i in range(12):
        mask[i, 1 : 2 + i % 5] = 1.0
    kl = rng.normal(size=(12, 6)) * mask
    assert np.allclose(
        adv.outcome_advantages("grpo", rewards, mask), adv.grpo_advantages(rewards).reshape(-1)
    )
    assert np.allclose(
        adv.outcome_advantages("grpo", rewards, mask, scale=False),
        (rewards - rewards.mean(1, keepdims=True)).reshape(-1),
    )
    assert np.allclose(
        adv.outcome_advantages("rloo", rewards, mask), adv.rloo_advantages(rewards).reshape(-1)
    )
    token = adv.token_level_rewards(rewards.reshape(-1), mask, kl, 0.1)
    assert np.allclose(
        adv.outcome_advantages("reinforce_pp", rewards, mask, kl, 0.1),
        adv.reinforce_pp_advantages(token, mask),
    )
    with_kl = adv.outcome_advantages("grpo", rewards, mask, kl, 0.1)
    assert with_kl.shape == mask.shape and not with_kl[mask == 0].any()
    assert np.allclose(
        with_kl, adv.grpo_advantages(token.sum(1).reshape(3, 4)).reshape(-1, 1) * mask
    )
