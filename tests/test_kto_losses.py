"""KTO math (rlhf_core.losses, ``# ---- KTO`` block): exact small cases and naive float64 loops."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.losses import (
    KTO_LOSS_TYPES,
    kto_kl_estimate,
    kto_loss,
    kto_reference_point,
    kto_stat_sums,
    kto_stats_from_sums,
)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def naive_kto(policy, reference, labels, kl, beta, w_d, w_u, loss_type):
    """One row at a time, in Python floats (float64)."""
    losses, rewards = [], []
    for p, r, good in zip(policy, reference, labels):
        ratio = p - r
        if loss_type == "kto":
            loss = 1 - sigmoid(beta * (ratio - kl)) if good else 1 - sigmoid(beta * (kl - ratio))
        else:
            loss = 1 - sigmoid(beta * ratio) if good else sigmoid(beta * ratio)
        losses.append((w_d if good else w_u) * loss)
        rewards.append(beta * ratio)
    return losses, rewards


def test_hand_computed_kto_case():
    # beta 1, z0 0: desirable r=0 -> 1 - sigmoid(0) = 0.5; undesirable r=ln 3 -> 1 - sigmoid(0 - ln 3)
    # = 1 - 1/(1+3) = 0.75. Rewards are beta * r = [0, ln 3].
    policy = torch.tensor([-2.0, -1.0 + math.log(3)], dtype=torch.float64)
    reference = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    losses, rewards = kto_loss(policy, reference, torch.tensor([True, False]), kl=0.0, beta=1.0)
    torch.testing.assert_close(losses, torch.tensor([0.5, 0.75], dtype=torch.float64))
    torch.testing.assert_close(rewards, torch.tensor([0.0, math.log(3)], dtype=torch.float64))


def test_hand_computed_reference_point_and_weights():
    # z0 = ln 3, beta 1, r = 0 for both rows:
    # desirable 1 - sigmoid(0 - ln 3) = 0.75, times w_d = 2 -> 1.5;
    # undesirable 1 - sigmoid(ln 3 - 0) = 0.25, times w_u = 0.5 -> 0.125.
    zeros = torch.zeros(2, dtype=torch.float64)
    losses, _ = kto_loss(zeros, zeros, torch.tensor([True, False]), kl=math.log(3), beta=1.0,
                         desirable_weight=2.0, undesirable_weight=0.5)
    torch.testing.assert_close(losses, torch.tensor([1.5, 0.125], dtype=torch.float64))


def test_hand_computed_apo_zero_unpaired_ignores_kl():
    # beta 1, r = ln 3: desirable 1 - sigmoid(ln 3) = 0.25, undesirable sigmoid(ln 3) = 0.75 (z0 unused)
    policy = torch.full((2,), math.log(3), dtype=torch.float64)
    losses, _ = kto_loss(policy, torch.zeros(2, dtype=torch.float64), torch.tensor([True, False]), kl=5.0, beta=1.0,
                         loss_type="apo_zero_unpaired")
    torch.testing.assert_close(losses, torch.tensor([0.25, 0.75], dtype=torch.float64))


@pytest.mark.parametrize("loss_type", KTO_LOSS_TYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kto_loss_matches_a_naive_loop(loss_type, seed):
    g = torch.Generator().manual_seed(seed)
    policy = torch.randn(7, generator=g, dtype=torch.float64) * 5 - 20
    reference = policy + torch.randn(7, generator=g, dtype=torch.float64)
    labels = torch.rand(7, generator=g) > 0.4
    kl, beta, w_d, w_u = 0.37, 0.3, 1.33, 0.8
    losses, rewards = kto_loss(policy, reference, labels, kl, beta, w_d, w_u, loss_type)
    want_losses, want_rewards = naive_kto(policy.tolist(), reference.tolist(), labels.tolist(), kl, beta, w_d, w_u,
                                          loss_type)
    torch.testing.assert_close(losses, torch.tensor(want_losses, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards, torch.tensor(want_rewards, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_gradient_flows_through_the_policy_only_and_not_through_z0():
    # d/dr [1 - sigmoid(beta (r - z0))] = -beta s (1 - s), s = sigmoid(beta (r - z0)); z0 is a constant
    policy = torch.tensor([-3.0, -4.0], dtype=torch.float64, requires_grad=True)
    reference = torch.tensor([-3.5, -3.0], dtype=torch.float64, requires_grad=True)
    kl = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    beta = 0.5
    losses, rewards = kto_loss(policy, reference, torch.tensor([True, False]), kl, beta)
    losses.sum().backward()
    s0 = sigmoid(beta * (0.5 - 0.2))
    s1 = sigmoid(beta * (0.2 - (-1.0)))  # undesirable: 1 - sigmoid(beta (z0 - r)), d/dr = +beta s (1 - s)
    torch.testing.assert_close(policy.grad, torch.tensor([-beta * s0 * (1 - s0), beta * s1 * (1 - s1)],
                                                         dtype=torch.float64))
    assert kl.grad is None and not rewards.requires_grad


def test_kl_estimate_is_the_detached_mean_log_ratio():
    # policy [-3, -5] vs reference [-4, -4] -> ratios [1, -1] -> mean 0
    policy = torch.tensor([-3.0, -5.0], requires_grad=True)
    estimate = kto_kl_estimate(policy, torch.tensor([-4.0, -4.0]))
    assert estimate.shape == () and float(estimate) == 0.0 and not estimate.requires_grad
    # [-1, -2] vs [-2, -4] -> ratios [1, 2] -> 1.5
    assert float(kto_kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -4.0]))) == 1.5


def test_reference_point_averages_processes_and_clamps_at_zero():
    # two processes' estimates [0.3, 0.1] -> mean 0.2; [0.3, -0.5] -> mean -0.1 -> clamped to 0
    torch.testing.assert_close(kto_reference_point(torch.tensor([0.3, 0.1])), torch.tensor(0.2))
    assert float(kto_reference_point(torch.tensor([0.3, -0.5]))) == 0.0
    assert not kto_reference_point(torch.tensor([1.0], requires_grad=True)).requires_grad


def test_stat_sums_and_stats_exact():
    # desirable rows 0 and 2: rewards 1 + 3 = 4, logps -1 + -3 = -4, n 2; undesirable row 1: reward -2, logp -5
    rewards = torch.tensor([1.0, -2.0, 3.0])
    logps = torch.tensor([-1.0, -5.0, -3.0])
    labels = torch.tensor([True, False, True])
    sums = kto_stat_sums(rewards, logps, labels)
    torch.testing.assert_close(sums, torch.tensor([4.0, -4.0, 2.0, -2.0, -5.0, 1.0]))
    stats = kto_stats_from_sums(sums)
    assert {k: float(v) for k, v in stats.items()} == {
        "rewards/chosen": 2.0, "logps/chosen": -2.0, "rewards/rejected": -2.0, "logps/rejected": -5.0,
        "rewards/margins": 4.0,
    }
    # summing two processes' sums then dividing = the mean over every row of both
    other = kto_stat_sums(torch.tensor([5.0]), torch.tensor([-7.0]), torch.tensor([True]))
    assert float(kto_stats_from_sums(sums + other)["rewards/chosen"]) == pytest.approx((1 + 3 + 5) / 3)


def test_stats_leave_out_a_side_with_no_rows():
    stats = kto_stats_from_sums(kto_stat_sums(torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([True])))
    assert set(stats) == {"rewards/chosen", "logps/chosen"}


def test_bad_options_are_rejected():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        kto_loss(x, x, torch.tensor([True, False]), 0.0, loss_type="sigmoid")
    with pytest.raises(ValueError, match="beta"):
        kto_loss(x, x, torch.tensor([True, False]), 0.0, beta=0.0)
