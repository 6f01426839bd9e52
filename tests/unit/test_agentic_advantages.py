"""Multi-turn advantages (rollhpc.algo.agentic) against values worked out by hand."""

import numpy as np
import pytest

from rollhpc.algo.advantages import reinforce_pp_advantages
from rollhpc.algo.agentic import (
    discounted_returns,
    episode_level_advantages,
    episode_returns,
    gigpo_advantages,
    minibatch_order,
    spread_turn_advantages,
    step_level_advantages,
    trajectory_advantages,
)

# One group of three episodes from one reset seed (state S), gamma 0.5:
#   ep0: S -> A -> B -> goal, rewards 0, 0, 1   return-to-go G = 0.25, 0.5, 1
#   ep1: S -> B -> goal,      rewards 0, 1      G = 0.5, 1
#   ep2: S -> A -> (turn limit), rewards 0, 0    G = 0, 0
REWARDS = [[0.0, 0.0, 1.0], [0.0, 1.0], [0.0, 0.0]]
KEYS = [["S", "A", "B"], ["S", "B"], ["S", "A"]]


def test_discounted_returns_by_hand():
    # G2 = 2, G1 = 0 + 0.5 * 2 = 1, G0 = 1 + 0.5 * 1 = 1.5
    np.testing.assert_allclose(discounted_returns([1.0, 0.0, 2.0], gamma=0.5), [1.5, 1.0, 2.0])
    np.testing.assert_allclose(discounted_returns([1.0, 0.0, 2.0]), [3.0, 2.0, 2.0])
    assert discounted_returns([]).shape == (0,)
    np.testing.assert_allclose(episode_returns(REWARDS), [1.0, 1.0, 0.0])
    np.testing.assert_allclose(episode_returns(REWARDS, gamma=0.5), [0.25, 0.5, 0.0])
    with pytest.raises(ValueError, match="gamma"):
        discounted_returns([1.0], gamma=1.5)


def test_trajectory_advantages_are_the_group_estimators_on_returns():
    returns = np.array([[1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    # grpo row 0: mean 0.5, std 0.5 -> +-1; row 1: mean 0.5, std sqrt((2.25 + 3 * 0.25) / 4) = sqrt(0.75)
    adv = trajectory_advantages(returns, eps=0.0)
    np.testing.assert_allclose(adv[0], [1, 1, -1, -1])
    np.testing.assert_allclose(adv[1], np.array([1.5, -0.5, -0.5, -0.5]) / np.sqrt(0.75))
    np.testing.assert_allclose(
        trajectory_advantages(returns, scale=False)[1], [1.5, -0.5, -0.5, -0.5]
    )
    # rloo row 1: 2 - 0 = 2; 0 - (2 + 0 + 0) / 3 = -2/3
    np.testing.assert_allclose(
        trajectory_advantages(returns, "rloo")[1], [2, -2 / 3, -2 / 3, -2 / 3]
    )
    with pytest.raises(ValueError, match="estimator"):
        trajectory_advantages(returns, "ppo")  # type: ignore[arg-type]


def test_trajectory_rows_with_reinforce_pp_skip_observation_tokens():
    # a trajectory row: generated at positions 0, 1 (turn 0, reward 1 on position 1), an observation at 2, 3,
    # generated at 4 (turn 1, reward 2). gamma 0.5 over generated tokens only: G4 = 2, G1 = 1 + 0.5 * 2 = 2,
    # G0 = 0.5 * 2 = 1 -- the observation in between is not a time step.
    mask = np.array([[1, 1, 0, 0, 1]])
    rewards = np.array([[0.0, 1.0, 0.0, 0.0, 2.0]])
    # returns 1, 2, 2: mean 5/3, deviations -2/3, 1/3, 1/3, var (4 + 1 + 1) / 27 = 2/9, std sqrt(2)/3
    adv = reinforce_pp_advantages(rewards, mask, gamma=0.5, eps=0.0)
    s = np.sqrt(2) / 3
    np.testing.assert_allclose(adv, [[-2 / 3 / s, 1 / 3 / s, 0, 0, 1 / 3 / s]])


def test_episode_level_advantages_by_hand():
    # returns 1, 1, 0: mean 2/3 -> 1/3, 1/3, -2/3; std sqrt((1/9 + 1/9 + 4/9) / 3) = sqrt(2)/3
    np.testing.assert_allclose(
        episode_level_advantages([1.0, 1.0, 0.0], scale=False), [1 / 3, 1 / 3, -2 / 3]
    )
    np.testing.assert_allclose(
        episode_level_advantages([1.0, 1.0, 0.0], eps=0.0),
        [1 / np.sqrt(2), 1 / np.sqrt(2), -np.sqrt(2)],
    )
    with pytest.raises(ValueError, match="non-empty"):
        episode_level_advantages([])


def test_step_level_advantages_by_hand():
    # anchor S: G = 0.25 (ep0), 0.5 (ep1), 0 (ep2): mean 0.25 -> 0, 0.25, -0.25
    # anchor A: G = 0.5 (ep0 turn 1), 0 (ep2 turn 1): mean 0.25 -> 0.25, -0.25
    # anchor B: G = 1 (ep0 turn 2), 1 (ep1 turn 1): equal -> 0
    adv = step_level_advantages(REWARDS, KEYS, gamma=0.5, scale=False)
    for got, want in zip(adv, [[0, 0.25, 0], [0.25, 0], [-0.25, -0.25]]):
        np.testing.assert_allclose(got, want)
    # scaled: S has std sqrt((0 + 1/16 + 1/16) / 3) = sqrt(1/24) -> 0.25 / sqrt(1/24) = sqrt(1.5); A has std 0.25;
    # B stays 0 (0 / (0 + eps))
    adv = step_level_advantages(REWARDS, KEYS, gamma=0.5, eps=1e-12)
    for got, want in zip(adv, [[0, 1, 0], [np.sqrt(1.5), 0], [-np.sqrt(1.5), -1]]):
        np.testing.assert_allclose(got, want, atol=1e-12)


def test_step_level_singletons_and_missing_keys_get_zero():
    # ep0's turn 1 is the only visit of "X", None matches nothing: both 0. Turn 0 of both: S with G = 1 and 3
    # (gamma 1: ep0 0 + 1, ep1 3) -> -1, +1 unscaled.
    adv = step_level_advantages([[0.0, 1.0], [3.0]], [["S", "X"], ["S"]], gamma=1.0, scale=False)
    np.testing.assert_allclose(adv[0], [-1.0, 0.0])
    np.testing.assert_allclose(adv[1], [1.0])
    adv = step_level_advantages([[1.0], [0.0]], [[None], [None]], gamma=1.0)
    np.testing.assert_allclose(np.concatenate(adv), [0.0, 0.0])


def test_gigpo_combines_the_two_levels_by_hand():
    # episode term (unscaled): 1/3, 1/3, -2/3 on every turn; step term from test_step_level_advantages_by_hand
    adv = gigpo_advantages(REWARDS, KEYS, gamma=0.5, w_episode=1.0, w_step=2.0, scale=False)
    want = [[1 / 3, 1 / 3 + 0.5, 1 / 3], [1 / 3 + 0.5, 1 / 3], [-2 / 3 - 0.5, -2 / 3 - 0.5]]
    for got, w in zip(adv, want):
        np.testing.assert_allclose(got, w)
    # w_step = 0 is GRPO on episode returns, spread over the turns
    adv = gigpo_advantages(REWARDS, KEYS, gamma=0.5, w_step=0.0, scale=False)
    np.testing.assert_allclose(np.concatenate(adv), [1 / 3] * 5 + [-2 / 3] * 2)


def test_gigpo_checks_its_inputs():
    with pytest.raises(ValueError, match="episode 1 has 2 turn rewards but 1 state keys"):
        gigpo_advantages([[0.0], [0.0, 1.0]], [["S"], ["S"]])
    with pytest.raises(ValueError, match="2 episodes of rewards but 1"):
        gigpo_advantages([[0.0], [1.0]], [["S"]])
    with pytest.raises(ValueError, match="at least one episode"):
        gigpo_advantages([], [])


def test_spread_turn_advantages_onto_tokens():
    # row 0: a trajectory row with turns 0 and 1; row 1: the step row of turn 1 of another episode
    turn_ids = np.array([[-1, 0, 0, -1, 1], [-1, -1, -1, 1, -1]])
    out = spread_turn_advantages([[0.5, -1.0], np.array([9.0, 2.0])], turn_ids)
    np.testing.assert_allclose(out, [[0, 0.5, 0.5, 0, -1.0], [0, 0, 0, 2.0, 0]])
    with pytest.raises(ValueError, match="turn 1 but 1 turn advantages"):
        spread_turn_advantages([[0.5], [1.0]], turn_ids)
    with pytest.raises(ValueError, match="B = 1 rows"):
        spread_turn_advantages([[0.5]], turn_ids)


def test_minibatch_order_gives_a_fixed_number_of_full_minibatches():
    order = minibatch_order(7, 3, seed=0)
    assert sorted(order.tolist()) == list(range(7))
    # the trainer's split: 3 steps, none empty
    assert [len(c) for c in np.array_split(order, 3)] == [
        3,
        2,
        2,
    ]
    np.testing.assert_array_equal(order, minibatch_order(7, 3, seed=0))
    with pytest.raises(ValueError, match="cannot fill 3 mini-batches"):
        minibatch_order(2, 3, seed=0)


def test_gigpo_on_trajectory_rows_is_the_step_rows_loss_and_gradient():
    """``advantage: gigpo`` on one row per episode trains on exactly what step rows train on: each turn's
    tokens see the same prefix (attention is causal) and carry the same advantage, so the token-mean loss
    and its gradient agree, with one forward per episode instead of one per turn."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollhpc.algo.losses import policy_loss
    from rollhpc.rollout.episode import Episode, Turn
    from rollhpc.rollout.rows import pad_rows, step_rows, trajectory_row

    rng = np.random.default_rng(0)

    def episode(turns: int, index: int) -> Episode:
        return Episode(
            prompt=rng.integers(3, 60, 5).tolist(),
            group=0,
            index=index,
            seed=1,
            turns=[
                Turn(
                    response=rng.integers(3, 60, 2).tolist(),
                    logprobs=(-rng.random(2)).tolist(),
                    version=0,
                    observation=rng.integers(3, 60, 3).tolist(),
                    reward=float(rng.normal()),
                    state_key=f"s{k % 2}",
                )
                for k in range(turns)
            ],
        )

    group = [episode(3, 0), episode(2, 1), episode(4, 2)]
    per_episode = gigpo_advantages(
        [[t.reward for t in e.turns] for e in group],
        [[t.state_key for t in e.turns] for e in group],
        gamma=0.9,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )

    def loss_and_grad(rows, turn_advantages):
        data = pad_rows(rows, pad_id=0)
        tokens = torch.as_tensor(data["tokens"])
        logits = model(input_ids=tokens, attention_mask=(tokens != 0).long()).logits[:, :-1].float()
        logprob = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
        advantage = torch.as_tensor(
            spread_turn_advantages(turn_advantages, data["turn_ids"]), dtype=torch.float32
        )
        model.zero_grad()
        loss, _ = policy_loss(
            logprob,
            torch.as_tensor(data["gen_logprob"], dtype=torch.float32),
            advantage,
            torch.as_tensor(data["loss_mask"]),
            agg="token-mean",
        )
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    steps = [(row, adv) for e, adv in zip(group, per_episode) for row in step_rows(e)]
    step_loss, step_grads = loss_and_grad([r for r, _ in steps], [a for _, a in steps])
    traj_loss, traj_grads = loss_and_grad([trajectory_row(e) for e in group], per_episode)
    assert traj_loss == pytest.approx(step_loss, rel=1e-5) and abs(step_loss) > 1e-3
    for a, b in zip(traj_grads, step_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
