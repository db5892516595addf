"""GRPO / RLOO math against naive float64 loops and hand arithmetic (rlhf_core.losses, '---- GRPO / RLOO')."""

import math

import pytest
import torch

from rlhf_core.losses import (
    grpo_loss, group_relative_advantages, k3_kl, rloo_advantages, rloo_loss, sequence_kl_penalized_rewards,
)

D = torch.float64


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_group_advantages_by_hand():
    # group 1: [1, 3] mean 2 std sqrt(2); group 2: [5, 5] mean 5 std 0
    adv, std = group_relative_advantages(torch.tensor([1.0, 3.0, 5.0, 5.0], dtype=D), 2, "group")
    s = math.sqrt(2)
    assert adv.tolist() == pytest.approx([-1 / (s + 1e-4), 1 / (s + 1e-4), 0.0, 0.0])
    assert std.tolist() == pytest.approx([s, s, 0.0, 0.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_naive_loop(scale):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g, dtype=D)
    adv, _ = group_relative_advantages(rewards, 4, scale)
    r = rewards.tolist()
    batch_std = _std(r)
    for p in range(3):
        group = r[4 * p: 4 * p + 4]
        mean = sum(group) / 4
        for i in range(4):
            want = group[i] - mean
            if scale == "group":
                want /= _std(group) + 1e-4
            elif scale == "batch":
                want /= batch_std + 1e-4
            assert adv[4 * p + i].item() == pytest.approx(want, rel=1e-12)


def test_group_advantages_ignore_unscorable_and_reject_bad_options():
    adv, _ = group_relative_advantages(torch.tensor([1.0, float("nan"), 3.0, 0.0], dtype=D), 2, "none")
    # group 1 mean is 1 (the NaN is left out): advantage 0 for both; group 2: [1.5, -1.5]
    assert adv.tolist() == [0.0, 0.0, 1.5, -1.5]
    with pytest.raises(ValueError, match="scale_rewards"):
        group_relative_advantages(torch.zeros(4), 2, "weird")
    with pytest.raises(ValueError, match="num_generations=3"):
        group_relative_advantages(torch.zeros(4), 3)


def test_k3_by_hand():
    # ref - logp = log 2: 2 - log 2 - 1; equal log-probs: 0
    out = k3_kl(torch.tensor([[0.0, -1.0]], dtype=D), torch.tensor([[math.log(2), -1.0]], dtype=D))
    assert out.tolist()[0] == pytest.approx([1 - math.log(2), 0.0])


def _naive_grpo(logp, old, adv, mask, loss_type, eps_lo, eps_hi, beta, ref, max_len, num_items, delta=None):
    """Per-token loops in float64 (token-level importance sampling, bias-corrected KL)."""
    B, A = len(logp), len(logp[0])
    rows, total, tokens = [], 0.0, 0
    for b in range(B):
        row_sum, row_n = 0.0, 0
        for a in range(A):
            if not mask[b][a]:
                continue
            r = math.exp(logp[b][a] - old[b][a])
            rc = min(max(r, 1 - eps_lo), 1 + eps_hi)
            ru = r if delta is None else min(r, delta)
            term = -min(ru * adv[b], rc * adv[b])
            if beta:
                d = ref[b][a] - logp[b][a]
                term += beta * (math.exp(d) - d - 1) * r
            row_sum += term
            row_n += 1
        rows.append(row_sum / max(row_n, 1))
        total += row_sum
        tokens += row_n
    if loss_type == "grpo":
        return sum(rows) / B
    if loss_type == "bnpo":
        return total / tokens
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    return total / num_items


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_naive_loop(loss_type, beta):
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(3, 5, generator=g, dtype=D) * 2
    old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=D)  # ratios far enough from 1 to clip
    ref = logp + 0.5 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.tensor([1.5, -0.7, 0.2], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=D)
    loss, stats = grpo_loss(logp, old, adv, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
                            beta=beta, ref_logprobs=ref, max_completion_length=8, num_items=20.0)
    want = _naive_grpo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), loss_type, 0.2, 0.28, beta,
                       ref.tolist(), 8, 20.0)
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert ("kl" in stats) == (beta != 0.0)
    assert 0.0 < stats["clip_ratio/region_mean"].item() < 1.0


def test_asymmetric_clipping_and_delta_cap():
    # one token, ratio e^0.5 = 1.6487 and positive advantage: clipped at 1 + eps_high
    logp, old = torch.tensor([[0.5]], dtype=D), torch.tensor([[0.0]], dtype=D)
    one, mask = torch.tensor([1.0], dtype=D), torch.ones(1, 1, dtype=D)
    loss, stats = grpo_loss(logp, old, one, mask, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.28)
    assert stats["clip_ratio/high_mean"].item() == 1.0
    # negative advantage: min(-r, -clip) picks the unclipped -1.6487 -> loss +1.6487; delta caps it at 1.5
    loss, stats = grpo_loss(logp, old, -one, mask, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(math.exp(0.5))
    assert grpo_loss(logp, old, -one, mask, delta=1.5)[0].item() == pytest.approx(1.5)
    # ratio e^-0.5 = 0.6065 < 1 - eps_low with negative advantage: clipped at 0.8, counted low
    loss, stats = grpo_loss(-logp, old, -one, mask, epsilon_low=0.2, epsilon_high=0.28)
    assert loss.item() == pytest.approx(0.8)
    assert stats["clip_ratio/low_mean"].item() == 1.0


def test_first_iteration_ratio_is_one_and_gradient_is_the_policy_gradient():
    # old_logprobs equal to logprobs (first of num_iterations) or None: ratio 1, d loss / d logp = -adv / tokens
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], dtype=D, requires_grad=True)
    adv, mask = torch.tensor([2.0, -1.0], dtype=D), torch.ones(2, 2, dtype=D)
    for old in (None, logp.detach().clone()):
        loss, stats = grpo_loss(logp, old, adv, mask, loss_type="dapo")
        assert loss.item() == pytest.approx(-(2 * 2 - 1 * 2) / 4)
        (grad,) = torch.autograd.grad(loss, logp)
        assert grad.tolist() == [[-0.5, -0.5], [0.25, 0.25]]
        assert stats["clip_ratio/region_mean"].item() == 0.0


def test_sequence_level_importance_sampling():
    # GSPO: one ratio per row, exp(mean log-ratio over real tokens) = exp(0.1) for row 0
    logp = torch.tensor([[0.1, 0.3, 9.0]], dtype=D)
    old = torch.tensor([[0.0, 0.2, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    loss, _ = grpo_loss(logp, old, torch.tensor([1.0], dtype=D), mask, loss_type="grpo",
                        importance_sampling_level="sequence", epsilon_high=0.5)
    assert loss.item() == pytest.approx(-math.exp(0.1))


def test_clip_stats_per_sequence_and_overall_as_trl_116():
    # row 0 (adv +1): ratios e^0.5 (high-clipped), 1, [masked]; row 1 (adv -1): e^-0.5 (low-clipped), e^-0.1, 1;
    # row 2: no real token (a masked truncated completion).
    logp = torch.tensor([[0.5, 0.0, 0.9], [-0.5, -0.1, 0.0], [0.9, 0.9, 0.9]], dtype=D)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    _, stats = grpo_loss(logp, torch.zeros_like(logp), adv, mask, epsilon_low=0.2, epsilon_high=0.2)
    # token means over the 5 real tokens; per sequence: each row's token mean (NaN without tokens)
    assert [stats[f"clip_ratio/{k}_mean"].item() for k in ("low", "high", "region")] == pytest.approx(
        [1 / 5, 1 / 5, 2 / 5])
    low, high = stats["clip_ratio/low_min"].tolist(), stats["clip_ratio/high_max"].tolist()
    assert low[:2] == pytest.approx([0.0, 1 / 3]) and high[:2] == pytest.approx([0.5, 0.0])
    assert math.isnan(low[2]) and math.isnan(high[2])
    # sequence-level ratios: row 0 exp(0.25) = 1.284 high-clipped; row 1 exp(-0.2) = 0.819 inside; row 2 ratio 1.
    # Means over the 3 sequences (TRL 1.16 counts sequences, not tokens, at this level).
    _, stats = grpo_loss(logp, torch.zeros_like(logp), adv, mask, importance_sampling_level="sequence")
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/low_mean"].item() == 0.0 and stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/high_max"].tolist() == [1.0, 0.0, 0.0]
    assert stats["clip_ratio/low_min"].tolist() == [0.0] * 3


def test_grpo_loss_rejects_unknown_options():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(x, None, torch.zeros(1), x, loss_type="cispo")
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(x, None, torch.zeros(1), torch.ones(1, 1), beta=0.1)
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(x, None, torch.zeros(1), torch.ones(1, 1), loss_type="dr_grpo")


def test_rloo_advantages_match_naive_loop():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(8, generator=g, dtype=D)
    adv = rloo_advantages(rewards, 4)
    r = rewards.tolist()
    for p in range(2):
        for i in range(4):
            others = [r[4 * p + j] for j in range(4) if j != i]
            assert adv[4 * p + i].item() == pytest.approx(r[4 * p + i] - sum(others) / 3, rel=1e-12)
    # by hand: [1, 2, 6] -> baselines [4, 3.5, 1.5] -> [-3, -1.5, 4.5]
    assert rloo_advantages(torch.tensor([1.0, 2.0, 6.0], dtype=D), 3).tolist() == [-3.0, -1.5, 4.5]
    normalized = rloo_advantages(rewards, 4, normalize=True)
    assert normalized.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert normalized.std().item() == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(ValueError, match="num_generations >= 2"):
        rloo_advantages(rewards, 1)


def test_rloo_kl_penalty_is_sequence_level_in_the_reward():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=D)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=D)
    # KL = (-1 + 1.5) + (-2 + 1) = -0.5 (third token masked); reward = 2 - 0.1 * (-0.5) = 2.05
    rewards, kl = sequence_kl_penalized_rewards(torch.tensor([2.0], dtype=D), logp, ref, mask, beta=0.1)
    assert kl.tolist() == [-0.5] and rewards.tolist() == pytest.approx([2.05])


def test_rloo_loss_by_hand():
    seq = torch.tensor([0.5, -0.5, 0.0], dtype=D, requires_grad=True)
    old = torch.zeros(3, dtype=D)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=D)
    loss, stats = rloo_loss(seq, old, adv, 0.2, 0.2)
    # row 0: min(1.6487, 1.2) = 1.2; row 1: min(-0.6065, -0.8) = -0.8; row 2: 2 -> -(1.2 - 0.8 + 2) / 3
    assert loss.item() == pytest.approx(-(1.2 - 0.8 + 2.0) / 3)
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(2 / 3)
    # per sequence, for TRL 1.16's clip_ratio/low_min and high_max: row 1 is clipped low, row 0 high
    assert stats["clip_ratio/low_min"].tolist() == [0.0, 1.0, 0.0]
    assert stats["clip_ratio/high_max"].tolist() == [1.0, 0.0, 0.0]
    on_policy, _ = rloo_loss(seq, None, adv)
    (grad,) = torch.autograd.grad(on_policy, seq)
    assert grad.tolist() == pytest.approx([-1 / 3, 1 / 3, -2 / 3])
