"""dpo_loss and pairwise_reward_loss against their closed forms, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.losses import dpo_loss, pairwise_reward_loss


def t(*values: float) -> torch.Tensor:
    """A float64 vector."""
    return torch.tensor(values, dtype=torch.float64)


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x), computed stably."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


# Row 0: pi log-ratio = -1 - (-3) = 2, reference log-ratio = -2 - (-2.5) = 0.5 -> logit h = 1.5.
# Row 1: pi = -4 - (-1) = -3, reference = -1 - (-1) = 0                        -> logit h = -3.
PC, PR, RC, RR = t(-1.0, -4.0), t(-3.0, -1.0), t(-2.0, -1.0), t(-2.5, -1.0)
H = [1.5, -3.0]
BETA = 0.1


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_sigmoid_closed_form(label_smoothing):
    losses, chosen, rejected = dpo_loss(PC, PR, RC, RR, beta=BETA, loss_type="sigmoid", label_smoothing=label_smoothing)
    # -(1-e) log s(b h) - e log s(-b h) = (1-e) softplus(-b h) + e softplus(b h)
    expected = [(1 - label_smoothing) * softplus(-BETA * h) + label_smoothing * softplus(BETA * h) for h in H]
    torch.testing.assert_close(losses, t(*expected), atol=1e-6, rtol=0)
    # implicit rewards: beta * (policy - reference)
    torch.testing.assert_close(chosen, t(0.1 * 1.0, 0.1 * -3.0), atol=1e-12, rtol=0)
    torch.testing.assert_close(rejected, t(0.1 * -0.5, 0.1 * 0.0), atol=1e-12, rtol=0)


def test_sigmoid_row0_by_hand():
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA)
    # e^-0.15 = 0.8607080, ln(1.8607080) = 0.6209570
    assert abs(losses[0].item() - math.log(1 + math.exp(-0.15))) < 1e-12
    assert abs(losses[0].item() - 0.6209570) < 1e-6


def test_robust_closed_form():
    e = 0.2
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, loss_type="robust", label_smoothing=e)
    # ((1-e) softplus(-b h) - e softplus(b h)) / (1 - 2e)
    expected = [((1 - e) * softplus(-BETA * h) - e * softplus(BETA * h)) / (1 - 2 * e) for h in H]
    torch.testing.assert_close(losses, t(*expected), atol=1e-6, rtol=0)


def test_robust_without_smoothing_equals_sigmoid():
    robust, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, loss_type="robust")
    sigmoid, _, _ = dpo_loss(PC, PR, RC, RR, beta=BETA, loss_type="sigmoid")
    torch.testing.assert_close(robust, sigmoid, atol=1e-12, rtol=0)


def test_hinge_closed_form():
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=2.0, loss_type="hinge")
    # relu(1 - 2 * 1.5) = 0 ; relu(1 - 2 * -3) = 7
    torch.testing.assert_close(losses, t(0.0, 7.0), atol=1e-6, rtol=0)


def test_ipo_closed_form():
    losses, _, _ = dpo_loss(PC, PR, RC, RR, beta=0.5, loss_type="ipo")
    # (h - 1 / (2 * 0.5))^2 = (1.5 - 1)^2 = 0.25 ; (-3 - 1)^2 = 16
    torch.testing.assert_close(losses, t(0.25, 16.0), atol=1e-6, rtol=0)


def test_reference_free_ignores_reference():
    losses, chosen, rejected = dpo_loss(PC, PR, RC, RR, beta=BETA, reference_free=True)
    expected = [softplus(-BETA * 2.0), softplus(-BETA * -3.0)]  # h = policy log-ratio only
    torch.testing.assert_close(losses, t(*expected), atol=1e-6, rtol=0)
    torch.testing.assert_close(chosen, BETA * PC, atol=1e-12, rtol=0)
    torch.testing.assert_close(rejected, BETA * PR, atol=1e-12, rtol=0)


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])  # all types: test_dpo_loss_types.py
def test_finite_at_extreme_log_probs(loss_type):
    big = t(-1e4, -1e-8, -5e3)
    small = t(-1e-8, -1e4, -5e3)
    losses, chosen, rejected = dpo_loss(big, small, small, big, beta=1.0, loss_type=loss_type, label_smoothing=0.1)
    assert torch.isfinite(losses).all() and torch.isfinite(chosen).all() and torch.isfinite(rejected).all()
    if loss_type == "sigmoid":  # h = -2e4: loss = 0.9 * 2e4 + 0.1 * softplus(-2e4)
        assert abs(losses[0].item() - 0.9 * 2e4) < 1e-6


def test_gradients_flow_to_policy_only_and_rewards_are_detached():
    pc, pr = PC.clone().requires_grad_(True), PR.clone().requires_grad_(True)
    losses, chosen, rejected = dpo_loss(pc, pr, RC, RR, beta=BETA)
    assert not chosen.requires_grad and not rejected.requires_grad
    losses.sum().backward()
    # d/dpc softplus(-b h) = -b * sigmoid(-b h)
    expected = [-BETA / (1 + math.exp(BETA * h)) for h in H]
    torch.testing.assert_close(pc.grad, t(*expected), atol=1e-9, rtol=0)
    torch.testing.assert_close(pr.grad, -pc.grad, atol=1e-12, rtol=0)


def test_dpo_loss_does_not_modify_inputs():
    before = [x.clone() for x in (PC, PR, RC, RR)]
    dpo_loss(PC, PR, RC, RR, beta=BETA, loss_type="ipo")
    assert all(torch.equal(a, b) for a, b in zip(before, (PC, PR, RC, RR)))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"loss_type": "kto"}, "loss_type"), ({"label_smoothing": 0.5}, "label_smoothing"), ({"beta": 0.0}, "beta")],
)
def test_dpo_loss_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dpo_loss(PC, PR, RC, RR, **kwargs)


def test_pairwise_reward_loss_closed_form():
    rc, rr = t(2.0, 0.0, -1.0), t(1.0, 0.5, 3.0)
    loss = pairwise_reward_loss(rc, rr)
    expected = sum(softplus(-(a - b)) for a, b in [(2.0, 1.0), (0.0, 0.5), (-1.0, 3.0)]) / 3
    assert abs(loss.item() - expected) < 1e-6


def test_pairwise_reward_loss_margin_and_centring():
    rc, rr, margin = t(2.0, 0.0), t(1.0, 0.5), t(0.5, -1.0)
    loss = pairwise_reward_loss(rc.reshape(-1, 1), rr.reshape(-1, 1), margin=margin, center_rewards_coefficient=0.01)
    # diffs - margin: 1 - 0.5 = 0.5 ; -0.5 + 1 = 0.5 -> softplus(-0.5); centring: 0.01 * mean(3^2, 0.5^2)
    expected = softplus(-0.5) + 0.01 * (9.0 + 0.25) / 2
    assert abs(loss.item() - expected) < 1e-6


def test_pairwise_reward_loss_finite_and_gradient():
    rc = t(1e4, -1e4).requires_grad_(True)
    rr = t(-1e4, 1e4)
    loss = pairwise_reward_loss(rc, rr)
    assert torch.isfinite(loss) and abs(loss.item() - 1e4) < 1e-6  # (0 + 2e4) / 2
    loss.backward()
    torch.testing.assert_close(rc.grad, t(0.0, -0.5), atol=1e-9, rtol=0)
