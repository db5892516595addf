"""Pure loss functions: PPO (KL penalty, per-token rewards, GAE, clipped losses), DPO and pairwise reward.

Tensors in, tensors (and a dict of detached stats) out. Shapes: ``B`` batch, ``A`` response tokens,
``V`` vocab. ``response_mask`` (B, A) is 1 on a real response token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.core import entropy_from_logits, masked_mean, masked_var, masked_whiten, clip_by_value

KL_PENALTIES = ("kl", "abs", "mse", "full")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")

# Log-ratios beyond this are clamped before exp(): exp(20) is already a ratio of 5e8, far past any clip.
MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------------
# PPO: rewards and advantages
# --------------------------------------------------------------------------------------------


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, mode: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between policy and reference.

    ``kl``/``abs``/``mse`` take gathered log-probs (B, A); ``full`` takes full log-softmax (B, A, V)
    and returns the exact KL(policy || reference) per token, summed over the vocabulary.
    """
    if mode == "kl":
        return logprob - ref_logprob
    if mode == "abs":
        return (logprob - ref_logprob).abs()
    if mode == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    if mode == "full":
        return (logprob.exp() * (logprob - ref_logprob)).sum(-1)  # (B, A)
    raise ValueError(f"kl_penalty must be one of {KL_PENALTIES}, got {mode!r}")


def per_token_rewards(
    scores: torch.Tensor, kls: torch.Tensor, response_mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rewards (B, A): ``-kl_coef * kl`` on every token, plus the score on the last real response token.

    scores (B,), kls (B, A), response_mask (B, A). Returns ``(rewards, non_score_rewards)``; every row
    must have at least one real token.
    """
    non_score = -kl_coef * kls  # (B, A)
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)  # (A,)
    last = (response_mask.bool() * positions).amax(dim=1)  # (B,)  index of the last real token
    score_at_last = F.one_hot(last, response_mask.shape[1]).to(non_score.dtype) * scores.to(non_score.dtype)[:, None]
    return non_score + score_at_last, non_score


def gae_advantages(
    values: torch.Tensor, rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float,
    whiten_rewards: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    values, rewards, response_mask: (B, A). Values and rewards are zeroed where the mask is 0, so the
    value after the last real token is 0 (the episode ends there). Returns ``(values, advantages,
    returns)`` where ``returns = advantages + values`` and the advantages are whitened over the mask.
    """
    mask = response_mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    length = rewards.shape[-1]
    last_gae = torch.zeros_like(rewards[:, 0])  # (B,)
    reversed_advantages = []
    for t in reversed(range(length)):
        next_value = values[:, t + 1] if t < length - 1 else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = delta + gamma * lam * last_gae
        reversed_advantages.append(last_gae)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)  # (B, A)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask).detach()
    return values, advantages, returns


# --------------------------------------------------------------------------------------------
# PPO: clipped losses
# --------------------------------------------------------------------------------------------


def ppo_losses(
    old_logprobs: torch.Tensor,
    old_values: torch.Tensor,
    logits: torch.Tensor,
    vpreds: torch.Tensor,
    logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    cliprange: float,
    cliprange_value: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy loss and clipped value loss (both masked means), with their stats.

    All inputs (B, A) except logits (B, A, V). Returns ``(pg_loss, vf_loss, stats)`` where
    ``vf_loss`` is not yet multiplied by ``vf_coef``; stats are detached and flattened-ready.
    """
    vpred_clipped = clip_by_value(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), response_mask)
    vf_clipfrac = masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)

    log_ratio = (logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = masked_mean(torch.max(pg_losses1, pg_losses2), response_mask)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    stats = {
        "policy/entropy": masked_mean(entropy_from_logits(logits), response_mask),
        "policy/approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, response_mask),
        "policy/policykl": masked_mean(old_logprobs - logprobs, response_mask),
        "policy/clipfrac": pg_clipfrac,
        "policy/advantages": advantages,
        "policy/advantages_mean": masked_mean(advantages, response_mask),
        "policy/ratio": ratio,
        "policy/ratio_mean": masked_mean(ratio, response_mask),
        "returns/mean": masked_mean(returns, response_mask),
        "returns/var": masked_var(returns, response_mask),
        "val/vpred": masked_mean(vpreds, response_mask),
        "val/error": masked_mean((vpreds - returns) ** 2, response_mask),
        "val/clipfrac": vf_clipfrac,
        "val/mean": masked_mean(old_values, response_mask),
        "val/var": masked_var(old_values, response_mask),
    }
    return pg_loss, vf_loss, {key: value.detach() for key, value in stats.items()}


# --------------------------------------------------------------------------------------------
# preference losses
# --------------------------------------------------------------------------------------------


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO losses (B,) and implicit rewards ``beta * (policy - reference)`` for chosen and rejected (B,).

    loss types: ``sigmoid`` (with conservative label smoothing), ``robust`` (unbiased under label
    noise), ``hinge`` and ``ipo``. With ``reference_free`` the reference log-ratio is taken as 0.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = torch.zeros_like(pi_logratios) if reference_free else reference_chosen_logps - reference_rejected_logps
    logits = pi_logratios - ref_logratios  # (B,)

    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    elif loss_type == "robust":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing) + F.logsigmoid(-beta * logits) * label_smoothing
        ) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * logits)
    else:  # ipo: squared distance of the log-ratio gap from 1 / (2 beta)
        losses = (logits - 1 / (2 * beta)) ** 2

    ref_chosen = torch.zeros_like(reference_chosen_logps) if reference_free else reference_chosen_logps
    ref_rejected = torch.zeros_like(reference_rejected_logps) if reference_free else reference_rejected_logps
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def pairwise_reward_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Bradley-Terry reward-model loss ``-log sigmoid(r_c - r_r - margin)``, mean over the batch.

    rewards (B,) or (B, 1); optional ``margin`` (B,). The optional centring term
    ``coef * mean((r_c + r_r)^2)`` keeps rewards near zero.
    """
    rewards_chosen = rewards_chosen.reshape(-1).float()
    rewards_rejected = rewards_rejected.reshape(-1).float()
    diff = rewards_chosen - rewards_rejected
    if margin is not None:
        diff = diff - margin.reshape(-1).to(diff.dtype)
    loss = -F.logsigmoid(diff).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss
