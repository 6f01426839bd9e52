import numpy as np
import pytest
import torch

from rollhpc.algo.advantages import grpo_advantages
from rollhpc.algo.losses import clipped_pg_loss


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
