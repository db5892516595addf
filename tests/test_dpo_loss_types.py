"""Every DPO loss type of TRL 0.11.4 against its paper's formula, written as a naive float64 loop over the pairs.

Each ``naive_*`` function below is the paper's per-pair formula in plain Python floats (math.log / math.exp);
the vectorised ``rlhf_core.losses`` function must give the same numbers in float64 (atol 1e-12: the two differ
only by the order of a handful of float64 operations on values of order 1-10).
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.losses import DPO_LOSS_TYPES, bco_batch_reward, dpo_loss, rpo_nll_loss

ATOL = 1e-12


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def log_sigmoid(x: float) -> float:
    """log(1 / (1 + e^-x)), stable for large |x|."""
    return -(max(-x, 0.0) + math.log1p(math.exp(-abs(x))))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


# Four pairs; policy / reference summed log-probs of chosen (w) and rejected (l) responses.
PC = [-1.0, -4.0, -2.5, -7.0]
PR = [-3.0, -1.0, -2.0, -6.5]
RC = [-2.0, -1.0, -3.5, -6.0]
RR = [-2.5, -1.0, -1.0, -8.0]
BETA = 0.7
E = 0.2  # label smoothing


def pairs():
    """(r_w, r_l, pi margin, ref margin) per pair: r = log pi - log ref of one response."""
    for pc, pr, rc, rr in zip(PC, PR, RC, RR):
        yield pc - rc, pr - rr, pc - pr, rc - rr


def run(loss_type: str, **kwargs) -> torch.Tensor:
    losses, _, _ = dpo_loss(t(*PC), t(*PR), t(*RC), t(*RR), beta=BETA, loss_type=loss_type, **kwargs)
    return losses


def sigmoid_loss(h: float, e: float) -> float:
    """cDPO: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)."""
    return -(1 - e) * log_sigmoid(BETA * h) - e * log_sigmoid(-BETA * h)


def naive(loss_type: str, e: float = 0.0, delta: float = 0.0) -> list[float]:
    """The paper's per-pair loss (float64 Python arithmetic), for every pair in order."""
    rows = list(pairs())
    if loss_type == "aot":  # Melnyk et al. 2024, paired: sorted policy margins against sorted reference margins
        pi = sorted(r[2] for r in rows)
        ref = sorted(r[3] for r in rows)
        return [sigmoid_loss(a - b, e) for a, b in zip(pi, ref)]
    if loss_type == "aot_pair":  # unpaired: sorted chosen log-ratios against sorted rejected log-ratios
        chosen = sorted(r[0] for r in rows)
        rejected = sorted(r[1] for r in rows)
        return [sigmoid_loss(a - b, e) for a, b in zip(chosen, rejected)]
    out = []
    for rw, rl, pi, ref in rows:
        h = pi - ref  # the DPO logit (reverse KL)
        if loss_type == "sigmoid":  # Rafailov et al. 2023 eq. 7
            out.append(sigmoid_loss(h, e))
        elif loss_type == "robust":  # Chowdhury et al. 2024
            out.append(((1 - e) * -log_sigmoid(BETA * h) - e * -log_sigmoid(-BETA * h)) / (1 - 2 * e))
        elif loss_type == "hinge":  # SLiC
            out.append(max(0.0, 1 - BETA * h))
        elif loss_type == "ipo":  # Azar et al. 2023 eq. 17
            out.append((h - 1 / (2 * BETA)) ** 2)
        elif loss_type == "exo_pair":  # Ji et al. 2024 eq. 16: KL(p_model || p_label), p = sigmoid(beta h)
            eps = e or 1e-3
            p = sigmoid(BETA * h)
            out.append(p * (math.log(p) - math.log(1 - eps)) + (1 - p) * (math.log(1 - p) - math.log(eps)))
        elif loss_type == "bco_pair":  # Jung et al. 2024
            out.append(-log_sigmoid(BETA * rw - delta) - log_sigmoid(-(BETA * rl - delta)))
        elif loss_type == "sppo_hard":  # Wu et al. 2024 eq. 4.7, P = 1 for the winner and 0 for the loser
            out.append((rw - (1 - 0.5) / BETA) ** 2 + (rl - (0 - 0.5) / BETA) ** 2)
        elif loss_type == "nca_pair":  # Chen et al. 2024: -log s(beta r_w) - 1/2 sum_y log s(-beta r_y)
            out.append(-log_sigmoid(BETA * rw) - 0.5 * (log_sigmoid(-BETA * rw) + log_sigmoid(-BETA * rl)))
        elif loss_type == "apo_zero":  # D'Oosterlinck et al. 2024 eq. 7
            out.append((1 - sigmoid(BETA * rw)) + sigmoid(BETA * rl))
        elif loss_type == "apo_down":  # eq. 8
            out.append(sigmoid(BETA * rw) + (1 - sigmoid(BETA * (rw - rl))))
        else:
            raise AssertionError(loss_type)
    return out


def test_every_trl_0_11_4_loss_type_is_offered():
    # DPOConfig.loss_type's Literal in TRL 0.11.4 (trl/trainer/dpo_config.py); kto_pair was removed there
    assert set(DPO_LOSS_TYPES) == {
        "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_pair",
        "apo_zero", "apo_down",
    }


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "exo_pair", "aot", "aot_pair"])
@pytest.mark.parametrize("e", [0.0, E])
def test_smoothed_losses_match_the_papers(loss_type, e):
    torch.testing.assert_close(run(loss_type, label_smoothing=e), t(*naive(loss_type, e)), atol=ATOL, rtol=0)


@pytest.mark.parametrize("loss_type", ["hinge", "ipo", "sppo_hard", "nca_pair", "apo_zero", "apo_down"])
def test_unsmoothed_losses_match_the_papers_and_ignore_label_smoothing(loss_type):
    expected = t(*naive(loss_type))
    torch.testing.assert_close(run(loss_type), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(run(loss_type, label_smoothing=E), expected, atol=ATOL, rtol=0)


def test_bco_pair_matches_the_paper_with_its_running_shift():
    delta = 0.3
    torch.testing.assert_close(run("bco_pair", bco_delta=delta), t(*naive("bco_pair", delta=delta)), atol=ATOL, rtol=0)
    torch.testing.assert_close(
        run("bco_pair", bco_delta=torch.tensor(delta, dtype=torch.float64)), t(*naive("bco_pair", delta=delta)),
        atol=ATOL, rtol=0,
    )
    with pytest.raises(ValueError, match="bco_delta"):
        run("bco_pair")


def test_bco_batch_reward_is_the_mean_implicit_reward_of_both_responses():
    rw, rl = t(*(r[0] for r in pairs())), t(*(r[1] for r in pairs()))
    expected = sum(BETA * x for x in [*rw.tolist(), *rl.tolist()]) / 8
    got = bco_batch_reward(rw.requires_grad_(True), rl, BETA)
    assert not got.requires_grad and abs(got.item() - expected) < ATOL


def test_exo_pair_without_smoothing_uses_trl_epsilon():
    # TRL 0.11.4 replaces label_smoothing 0 by 1e-3 for exo_pair: the loss must equal the explicit 1e-3 one
    torch.testing.assert_close(run("exo_pair"), run("exo_pair", label_smoothing=1e-3), atol=0, rtol=0)


def test_aot_sorts_over_the_batch():
    # permuting the pairs permutes nothing in the sorted losses: AOT compares distributions, not pairs
    order = [2, 0, 3, 1]
    for loss_type in ("aot", "aot_pair"):
        permuted, _, _ = dpo_loss(*(t(*[x[i] for i in order]) for x in (PC, PR, RC, RR)), beta=BETA, loss_type=loss_type)
        torch.testing.assert_close(permuted, run(loss_type), atol=0, rtol=0)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_reference_free_takes_the_reference_as_zero(loss_type):
    zeros = t(0.0, 0.0, 0.0, 0.0)
    delta = {"bco_delta": 0.1} if loss_type == "bco_pair" else {}
    free, chosen, rejected = dpo_loss(t(*PC), t(*PR), t(*RC), t(*RR), beta=BETA, loss_type=loss_type,
                                      reference_free=True, **delta)
    explicit, _, _ = dpo_loss(t(*PC), t(*PR), zeros, zeros, beta=BETA, loss_type=loss_type, **delta)
    torch.testing.assert_close(free, explicit, atol=0, rtol=0)
    torch.testing.assert_close(chosen, BETA * t(*PC), atol=ATOL, rtol=0)


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_each_loss_has_a_gradient_for_the_policy_only_and_detached_rewards(loss_type):
    pc, pr = t(*PC).requires_grad_(True), t(*PR).requires_grad_(True)
    delta = {"bco_delta": 0.1} if loss_type == "bco_pair" else {}
    losses, chosen, rejected = dpo_loss(pc, pr, t(*RC), t(*RR), beta=BETA, loss_type=loss_type, **delta)
    assert losses.shape == (4,) and not chosen.requires_grad and not rejected.requires_grad
    losses.sum().backward()
    assert torch.isfinite(pc.grad).all() and pc.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_each_loss_is_finite_at_extreme_log_probs(loss_type):
    big, small = t(-1e4, -1e-8, -5e3), t(-1e-8, -1e4, -5e3)
    delta = {"bco_delta": 0.0} if loss_type == "bco_pair" else {}
    losses, _, _ = dpo_loss(big, small, small, big, beta=1.0, loss_type=loss_type, label_smoothing=0.1, **delta)
    assert torch.isfinite(losses).all()


def test_rpo_nll_is_the_token_mean_negative_log_likelihood_over_the_batch():
    token_logps = t(-1.0, -2.0, -0.5, -3.0, -4.0, -0.25).reshape(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    total, count = 0.0, 0
    for row in range(2):
        for col in range(3):
            if mask[row, col]:
                total += -token_logps[row, col].item()
                count += 1
    assert abs(rpo_nll_loss(token_logps, mask).item() - total / count) < ATOL  # (1 + 2 + 3 + 4 + 0.25) / 5
    assert rpo_nll_loss(token_logps, torch.zeros_like(mask)).item() == 0.0
