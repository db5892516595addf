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


# ---- KTO
# Kahneman-Tversky Optimisation on unpaired (prompt, completion, label) rows, TRL 1.16's formulation.

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_kl_estimate(policy_kl_logps: torch.Tensor, reference_kl_logps: torch.Tensor) -> torch.Tensor:
    """One process's estimate of KL(policy || reference): mean of the log-ratios of mismatched pairs, detached.

    ``*_kl_logps`` (B,) are summed log-probs of completions paired with another row's prompt (the completion of
    row ``i - 1`` after the prompt of row ``i``), so they estimate the KL over the batch's prompts without being
    the rows being learned from. -> () scalar.
    Example: policy [-3, -5], reference [-4, -4] -> mean(1, -1) = 0.
    """
    return (policy_kl_logps - reference_kl_logps).detach().mean()


def kto_reference_point(process_kl_estimates: torch.Tensor) -> torch.Tensor:
    """The KTO reference point z0: the mean of every process's KL estimate (P,), clamped at 0, detached. -> ()

    Example: estimates [0.3, -0.5] -> mean -0.1 -> clamped 0.0; [0.3, 0.1] -> 0.2.
    """
    return process_kl_estimates.detach().float().mean().clamp(min=0)


def kto_loss(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row KTO losses (B,) (weights applied) and implicit rewards ``beta * (policy - reference)`` (B,), detached.

    policy/reference logps (B,): summed completion log-probs; labels (B,) bool, True = desirable; kl: z0.
    ``kto``: desirable ``w_d * (1 - sigmoid(beta * (r - z0)))``, undesirable ``w_u * (1 - sigmoid(beta * (z0 - r)))``
    with ``r`` the log-ratio; ``apo_zero_unpaired``: ``w_d * (1 - sigmoid(beta * r))`` and ``w_u * sigmoid(beta * r)``
    (no KL term). The batch loss is the mean of the returned losses.
    Example: beta 1, z0 0, r = [0, ln 3], labels [True, False] -> [1 - 1/2, 1 - sigmoid(-ln 3)] = [0.5, 0.75].
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    desirable = labels.to(torch.bool)  # (B,)
    logratios = policy_logps - reference_logps  # (B,)
    if loss_type == "kto":
        kl = torch.as_tensor(kl, dtype=logratios.dtype, device=logratios.device).detach()
        desirable_losses = 1 - torch.sigmoid(beta * (logratios - kl))
        undesirable_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    else:
        desirable_losses = 1 - torch.sigmoid(beta * logratios)
        undesirable_losses = torch.sigmoid(beta * logratios)
    losses = torch.where(
        desirable, desirable_weight * desirable_losses, undesirable_weight * undesirable_losses
    )  # (B,)
    return losses, beta * logratios.detach()


def kto_stat_sums(
    rewards: torch.Tensor, policy_logps: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Sums to average over desirable/undesirable rows across processes: rewards, logps, labels (B,) -> (6,).

    [sum reward desirable, sum logps desirable, n desirable, sum reward undesirable, sum logps undesirable,
    n undesirable]; add these over processes, then :func:`kto_stats_from_sums` divides.
    """
    desirable = labels.to(torch.bool)
    rewards, logps = rewards.detach().float(), policy_logps.detach().float()
    zero = torch.zeros_like(rewards)
    return torch.stack([
        torch.where(desirable, rewards, zero).sum(), torch.where(desirable, logps, zero).sum(), desirable.sum().float(),
        torch.where(desirable, zero, rewards).sum(), torch.where(desirable, zero, logps).sum(),
        (~desirable).sum().float(),
    ])


def kto_stats_from_sums(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """``rewards/chosen``, ``logps/chosen`` (desirable rows), ``.../rejected`` (undesirable), ``rewards/margins``.

    ``sums`` (6,) from :func:`kto_stat_sums` (possibly summed over processes). A side with no rows is left out,
    and the margin needs both sides (as TRL 1.16 logs them).
    """
    stats: dict[str, torch.Tensor] = {}
    for offset, side in ((0, "chosen"), (3, "rejected")):
        count = sums[offset + 2]
        if count > 0:
            stats[f"rewards/{side}"] = sums[offset] / count
            stats[f"logps/{side}"] = sums[offset + 1] / count
    if "rewards/chosen" in stats and "rewards/rejected" in stats:
        stats["rewards/margins"] = stats["rewards/chosen"] - stats["rewards/rejected"]
    return stats
