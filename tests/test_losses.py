"""PPO math on hand-computed values, and GAE against a naive float64 loop."""

import math

import pytest
import torch

from rlhf_core import losses
from rlhf_core.core import masked_whiten


def test_kl_penalties_on_hand_computed_values():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    assert torch.allclose(losses.kl_penalty(logp, ref, "kl"), torch.tensor([[0.5, -1.0]]))
    assert torch.allclose(losses.kl_penalty(logp, ref, "abs"), torch.tensor([[0.5, 1.0]]))
    assert torch.allclose(losses.kl_penalty(logp, ref, "mse"), torch.tensor([[0.125, 0.5]]))  # 0.5 * d^2


def test_full_kl_is_exact_kl_divergence():
    p = torch.log(torch.tensor([[[0.5, 0.5]]]))
    q = torch.log(torch.tensor([[[0.25, 0.75]]]))
    # KL(p||q) = 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.5 (ln 2 + ln 2/3)
    expected = 0.5 * (math.log(2.0) + math.log(2.0 / 3.0))
    assert torch.allclose(losses.kl_penalty(p, q, "full"), torch.tensor([[expected]]))
    assert losses.kl_penalty(p, p, "full").abs().max() == 0


def test_unknown_kl_penalty_raises():
    with pytest.raises(ValueError, match="kl_penalty"):
        losses.kl_penalty(torch.zeros(1), torch.zeros(1), "bogus")


def test_per_token_rewards_put_score_on_last_real_token():
    scores = torch.tensor([2.0, -1.0])
    kls = torch.tensor([[0.5, -1.0, 0.3], [0.2, 0.4, 0.6]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rewards, non_score = losses.per_token_rewards(scores, kls, mask, kl_coef=0.1)
    # non-score = -0.1 * kl; row 0's score lands on index 1 (its last real token), row 1's on index 2
    assert torch.allclose(non_score, torch.tensor([[-0.05, 0.1, -0.03], [-0.02, -0.04, -0.06]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 2.1, -0.03], [-0.02, -0.04, -1.06]]))


def test_per_token_rewards_respect_holes_in_a_user_mask():
    rewards, _ = losses.per_token_rewards(torch.tensor([1.0]), torch.zeros(1, 4), torch.tensor([[1, 1, 0, 0]]), 0.2)
    assert rewards.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def _naive_gae(values, rewards, lengths, gamma, lam):
    """Per row, over its real tokens only, in float64."""
    out = []
    for row in range(values.shape[0]):
        n = lengths[row]
        adv = [0.0] * n
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[row, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[row, t].item() + gamma * next_value - values[row, t].item()
            last = delta + gamma * lam * last
            adv[t] = last
        out.append(adv)
    return out


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0)])
def test_gae_matches_naive_loop(gamma, lam):
    torch.manual_seed(0)
    values = torch.randn(3, 6, dtype=torch.float64)
    rewards = torch.randn(3, 6, dtype=torch.float64)
    lengths = [6, 4, 2]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths], dtype=torch.float64)
    masked_values, advantages, returns = losses.gae_advantages(values, rewards, mask, gamma, lam)
    naive = _naive_gae(values, rewards, lengths, gamma, lam)
    raw = torch.zeros(3, 6, dtype=torch.float64)
    for row, adv in enumerate(naive):
        raw[row, : len(adv)] = torch.tensor(adv, dtype=torch.float64)
    # returns are the raw advantages plus values on real tokens
    assert torch.allclose((returns * mask), (raw + values) * mask, atol=1e-12)
    assert torch.allclose(advantages * mask, masked_whiten(raw, mask) * mask, atol=1e-10)
    assert torch.equal(masked_values, values * mask)


def test_gae_padding_does_not_change_real_tokens():
    torch.manual_seed(1)
    values, rewards = torch.randn(1, 3, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    _, adv, ret = losses.gae_advantages(values, rewards, mask, 1.0, 0.95)
    pad = lambda x, v: torch.cat([x, torch.full((1, 2), v, dtype=torch.float64)], dim=1)  # noqa: E731
    _, adv_p, ret_p = losses.gae_advantages(pad(values, 7.0), pad(rewards, -3.0), pad(mask, 0.0), 1.0, 0.95)
    assert torch.allclose(adv, adv_p[:, :3]) and torch.allclose(ret, ret_p[:, :3])


def _loss_inputs():
    # token 0 is real, token 1 is padding filled with junk that must not matter
    old_logprobs = torch.log(torch.tensor([[0.5, 0.9]]))
    logprobs = torch.log(torch.tensor([[0.6, 0.1]]))
    old_values = torch.tensor([[0.0, 5.0]])
    vpreds = torch.tensor([[0.5, -5.0]])
    mask = torch.tensor([[1.0, 0.0]])
    advantages = torch.tensor([[1.0, 100.0]])
    returns = torch.tensor([[1.0, 50.0]])
    logits = torch.zeros(1, 2, 3)
    return old_logprobs, old_values, logits, vpreds, logprobs, mask, advantages, returns


def test_ppo_losses_on_hand_computed_values():
    pg_loss, vf_loss, stats = losses.ppo_losses(*_loss_inputs(), cliprange=0.1, cliprange_value=0.2)
    # ratio 0.6/0.5 = 1.2; -A*ratio = -1.2, -A*clip(ratio, 0.9, 1.1) = -1.1; max -> -1.1 (clipped)
    assert torch.isclose(pg_loss, torch.tensor(-1.1))
    assert stats["policy/clipfrac"] == 1.0
    # vpred 0.5 clipped to 0.0 +- 0.2 -> 0.2; (0.5-1)^2 = 0.25, (0.2-1)^2 = 0.64; 0.5 * max = 0.32
    assert torch.isclose(vf_loss, torch.tensor(0.32))
    assert stats["val/clipfrac"] == 1.0
    assert torch.isclose(stats["policy/approxkl"], torch.tensor(0.5 * math.log(1.2) ** 2))
    assert torch.isclose(stats["policy/policykl"], torch.tensor(-math.log(1.2)))
    assert torch.isclose(stats["policy/entropy"], torch.tensor(math.log(3.0)))
    assert torch.isclose(stats["val/error"], torch.tensor(0.25))


def test_ppo_losses_unclipped_case():
    inputs = list(_loss_inputs())
    inputs[6] = torch.tensor([[-1.0, 0.0]])  # negative advantage: -A*ratio = 1.2 > -A*clip = 1.1
    pg_loss, _, stats = losses.ppo_losses(*inputs, cliprange=0.1, cliprange_value=1.0)
    assert torch.isclose(pg_loss, torch.tensor(1.2)) and stats["policy/clipfrac"] == 0.0


def test_ppo_losses_clamp_extreme_log_ratios():
    inputs = list(_loss_inputs())
    inputs[4] = torch.tensor([[1000.0, 0.0]])  # absurd new log-prob
    pg_loss, vf_loss, stats = losses.ppo_losses(*inputs, cliprange=0.2, cliprange_value=0.2)
    assert torch.isfinite(pg_loss) and torch.isfinite(stats["policy/ratio"]).all()


def test_ppo_losses_return_detached_stats():
    inputs = list(_loss_inputs())
    inputs[4] = inputs[4].clone().requires_grad_(True)
    pg_loss, _, stats = losses.ppo_losses(*inputs, cliprange=0.2, cliprange_value=0.2)
    assert pg_loss.requires_grad and not any(v.requires_grad for v in stats.values())


def test_clipped_surrogate_is_the_one_ppo_grpo_and_rloo_call():
    """Issue 31: one clipped surrogate. The example of its docstring, and bit-equality with PPO's old form
    ``max(-A * r, -A * clip(r))`` (negation is exact and max(-x, -y) = -min(x, y), on every CPU kind)."""
    from rlhf_core.losses import clipped_fraction, clipped_surrogate

    r, a = torch.tensor([1.5, 1.5, 0.5]), torch.tensor([2.0, -2.0, -1.0])
    # 1.5 * 2 = 3.0 vs 1.2 * 2 = 2.4 -> -2.4; -3.0 vs -2.4 -> 3.0; -0.5 vs -0.8 -> 0.8
    assert torch.allclose(clipped_surrogate(r, a, 0.2, 0.2), torch.tensor([-2.4, 3.0, 0.8]))
    assert clipped_fraction(r, a, 0.2, 0.2).tolist() == [1.0, 0.0, 1.0]
    assert torch.allclose(clipped_surrogate(r, a, 0.2, 0.2, delta=1.3), torch.tensor([-2.4, 2.6, 0.8]))
    g = torch.Generator().manual_seed(0)
    ratio, adv = torch.rand(64, 16, generator=g) * 2, torch.randn(64, 16, generator=g)
    old_form = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - 0.2, 1.0 + 0.2))
    assert torch.equal(clipped_surrogate(ratio, adv, 0.2, 0.2), old_form)


def test_aggregate_tokens_by_loss_type():
    from rlhf_core.losses import aggregate_tokens

    per_token, mask = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_tokens(per_token, mask, "grpo").item() == 2.0  # (2/2 + 3/1) / 2
    assert aggregate_tokens(per_token, mask, "bnpo").item() == pytest.approx(5 / 3)
    assert aggregate_tokens(per_token, mask, "dr_grpo", max_completion_length=5).item() == 0.5  # 5 / (2 * 5)
    assert aggregate_tokens(per_token, mask, "dapo", num_items=10).item() == 0.5
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_tokens(per_token, mask, "dr_grpo")
