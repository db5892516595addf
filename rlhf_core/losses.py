"""Pure loss functions: PPO (KL penalty, per-token rewards, GAE, clipped losses), DPO and pairwise reward.

Tensors in, tensors (and a dict of detached stats) out. Shapes: ``B`` batch, ``A`` response tokens,
``V`` vocab. ``response_mask`` (B, A) is 1 on a real response token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlhf_core.core import entropy_from_logits, masked_mean, masked_var, masked_whiten, clip_by_value

KL_PENALTIES = ("kl", "abs", "mse", "full")
# f-divergences regularising DPO ("Beyond Reverse KL", Wang et al. 2023); reverse_kl is standard DPO.
F_DIVERGENCE_TYPES = ("reverse_kl", "js_divergence", "alpha_divergence")

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
    whiten_rewards: bool = False, whiten: Callable[..., torch.Tensor] = masked_whiten,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the response tokens.

    values, rewards, response_mask: (B, A). Values and rewards are zeroed where the mask is 0, so the
    value after the last real token is 0 (the episode ends there). Returns ``(values, advantages,
    returns)`` where ``returns = advantages + values`` and the advantages are whitened over the mask.
    ``whiten(values, mask, shift_mean=...)``: ``masked_whiten``, or one whose statistics span several processes.
    """
    mask = response_mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    if whiten_rewards:
        rewards = whiten(rewards, mask, shift_mean=False)
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
    advantages = whiten(advantages, mask).detach()
    return values, advantages, returns


# --------------------------------------------------------------------------------------------
# PPO: clipped losses
# --------------------------------------------------------------------------------------------


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float, delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate, negated to be minimised: ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)``,
    with ``r`` capped at ``delta`` in the unclipped term when given (two-sided clipping). The one copy PPO, GRPO and
    RLOO call. ratio and advantages broadcast: (B, A) and (B, A) for PPO, (B, A) or (B, 1) and (B, 1) for GRPO, (B,)
    for RLOO. -> their broadcast shape, with grad.

    Example: r = 1.5, A = 2, eps = 0.2: -min(3.0, 1.2 * 2) = -2.4 (clipped); A = -2: -min(-3.0, -2.4) = 3.0.
    """
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * advantages, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * advantages)


def clipped_fraction(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                     ) -> torch.Tensor:
    """Where the clipped term is the one :func:`clipped_surrogate` takes (``clip(r) * A < r * A``): 1.0, else 0.0.
    PPO's ``policy/clipfrac`` is its masked mean."""
    with torch.no_grad():
        return torch.gt(-advantages * torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high),
                        -advantages * ratio).float()


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

    All inputs (B, A) except ``logits``: the (B, A, V) logits, or their per-token entropy (B, A) already
    computed (only the ``policy/entropy`` stat reads it). Returns ``(pg_loss, vf_loss, stats)`` where
    ``vf_loss`` is not yet multiplied by ``vf_coef``; stats are detached and flattened-ready. Nothing is read
    on the host (a mini-batch without a response token gives NaN, not an error).
    """
    response_mask = response_mask.to(vpreds.dtype)  # once, not in each of the ~20 masked means below
    vpred_clipped = clip_by_value(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), response_mask)

    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    pg_loss = masked_mean(clipped_surrogate(ratio, advantages, cliprange, cliprange), response_mask)

    with torch.no_grad():  # the stats: the same values without recording a graph (~30 operators per update)
        stats = {
            "policy/entropy": masked_mean(logits if logits.dim() == response_mask.dim() else entropy_from_logits(logits),
                                          response_mask),
            "policy/approxkl": 0.5 * masked_mean((logprobs - old_logprobs) ** 2, response_mask),
            "policy/policykl": masked_mean(old_logprobs - logprobs, response_mask),
            "policy/clipfrac": masked_mean(clipped_fraction(ratio, advantages, cliprange, cliprange), response_mask),
            "policy/advantages": advantages,
            "policy/advantages_mean": masked_mean(advantages, response_mask),
            "policy/ratio": ratio,
            "policy/ratio_mean": masked_mean(ratio, response_mask),
            "returns/mean": masked_mean(returns, response_mask),
            "returns/var": masked_var(returns, response_mask, check=False),
            "val/vpred": masked_mean(vpreds, response_mask),
            "val/error": masked_mean((vpreds - returns) ** 2, response_mask),
            "val/clipfrac": masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask),
            "val/mean": masked_mean(old_values, response_mask),
            "val/var": masked_var(old_values, response_mask, check=False),
        }
    return pg_loss, vf_loss, {key: value.detach() for key, value in stats.items()}


# --------------------------------------------------------------------------------------------
# preference losses
# --------------------------------------------------------------------------------------------


def capped_exp(value: torch.Tensor, decimals: int = 4) -> torch.Tensor:
    """``exp(value)`` with the exponent clamped to ``log(finfo(dtype).max)`` rounded down to ``decimals``
    places (88.7228 for float32, 709.7827 for float64), so the result stays finite."""
    log_max = torch.log(torch.tensor(torch.finfo(value.dtype).max, dtype=value.dtype))
    cap = torch.floor(log_max * 10**decimals) / 10**decimals
    return torch.exp(torch.clamp(value, max=cap.item()))


def f_divergence_logits(
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    pi_ref_logratios: torch.Tensor,
    f_divergence_type: str = "reverse_kl",
    alpha: float = 1.0,
) -> torch.Tensor:
    """The DPO logit ``f'(u_w) - f'(u_l)`` of an f-divergence, (B,); ``u = pi / pi_ref`` of a response.

    ``chosen_logratios``/``rejected_logratios`` (B,) are ``log u_w``/``log u_l``; ``pi_ref_logratios`` (B,) is
    the same ``log u_w - log u_l`` as DPO groups it, ``(log pi_w - log pi_l) - (log ref_w - log ref_l)``.
    - ``reverse_kl``: f(u) = u log u, f'(u) = log u + 1 -> ``log u_w - log u_l`` (standard DPO);
    - ``js_divergence``: f(u) = u log u - (1 + u) log((1 + u) / 2), f'(u) = log(2u / (1 + u))
      -> ``log u_w - log u_l - (softplus(log u_w) - softplus(log u_l))``;
    - ``alpha_divergence``: f(u) = (u^(1-a) - (1-a) u - a) / (a (a-1)), f'(u) = (1 - u^-a) / a
      -> ``(u_l^-a - u_w^-a) / a``, each power through ``capped_exp`` (a -> 0 gives reverse KL).
    """
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"f_divergence_type must be one of {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")
    if f_divergence_type == "alpha_divergence":
        if alpha == 0:
            raise ValueError("f_alpha_divergence_coef must be non-zero (alpha -> 0 is reverse_kl)")
        return (capped_exp(-alpha * rejected_logratios) - capped_exp(-alpha * chosen_logratios)) / alpha
    if f_divergence_type == "js_divergence":
        return pi_ref_logratios - (F.softplus(chosen_logratios) - F.softplus(rejected_logratios))
    return pi_ref_logratios


# ---- DPO's loss family (TRL 0.11.4's DPOTrainer.dpo_loss, one pure function per loss_type) ----
# Two kinds: a "logit loss" takes the DPO logit h (B,) (``f_divergence_logits``: for reverse KL,
# h = (log pi_w - log pi_l) - (log ref_w - log ref_l)); a "log-ratio loss" takes each response's own
# log-ratio r_w = log pi_w - log ref_w and r_l = log pi_l - log ref_l (B,) and ignores the f-divergence.
# Each returns the per-pair losses (B,), with grad; ``dpo_loss`` adds the detached implicit rewards.

# label smoothing used by exo_pair when none is given (TRL 0.11.4 sets label_smoothing to it in place)
EXO_DEFAULT_EPSILON = 1e-3


def dpo_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, arXiv 2305.18290, eq. 7) with conservative label smoothing (cDPO, Mitchell
    2023): ``-(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h)``. logits h (B,) -> losses (B,)."""
    return -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing


def dpo_robust_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024, arXiv 2403.00409), unbiased under label flips of rate e:
    ``((1 - e) (-log sigmoid(beta h)) - e (-log sigmoid(-beta h))) / (1 - 2e)``. logits (B,) -> losses (B,)."""
    return (
        -F.logsigmoid(beta * logits) * (1 - label_smoothing) + F.logsigmoid(-beta * logits) * label_smoothing
    ) / (1 - 2 * label_smoothing)


def dpo_hinge_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """SLiC's hinge (Zhao et al. 2023, arXiv 2305.10425) on the DPO logit:
    ``relu(1 - beta h)``. logits (B,) -> losses (B,)."""
    return torch.relu(1 - beta * logits)


def dpo_ipo_loss(logits: torch.Tensor, beta: float) -> torch.Tensor:
    """IPO (Azar et al. 2023, arXiv 2310.12036, eq. 17, beta = tau): ``(h - 1 / (2 beta))^2``; the trainer
    feeds it length-averaged log-probs, as TRL 0.11.4 does. logits (B,) -> losses (B,)."""
    return (logits - 1 / (2 * beta)) ** 2


def dpo_exo_pair_loss(logits: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """EXO, pairwise (Ji et al. 2024, arXiv 2402.00856, eq. 16): the reverse KL from the model's preference
    ``p = sigmoid(beta h)`` to the smoothed label ``(1 - e, e)``:
    ``p (log p - log(1 - e)) + (1 - p) (log(1 - p) - log e)``, ``e = label_smoothing`` or 1e-3 when 0 (as
    TRL 0.11.4). logits (B,) -> losses (B,)."""
    epsilon = label_smoothing or EXO_DEFAULT_EPSILON
    return (beta * logits).sigmoid() * (F.logsigmoid(beta * logits) - math.log(1 - epsilon)) + (
        -beta * logits
    ).sigmoid() * (F.logsigmoid(-beta * logits) - math.log(epsilon))


def dpo_bco_pair_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, delta: torch.Tensor | float
) -> torch.Tensor:
    """BCO, pairwise (Jung et al. 2024, arXiv 2404.04656): a binary classifier on the implicit rewards
    shifted by ``delta``, the running mean of the batch-mean reward (``bco_reward_shift``):
    ``-log sigmoid(beta r_w - delta) - log sigmoid(-(beta r_l - delta))``. log-ratios (B,) -> losses (B,)."""
    return -F.logsigmoid(beta * chosen_logratios - delta) - F.logsigmoid(-(beta * rejected_logratios - delta))


def bco_batch_reward(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """The batch's mean implicit reward ``mean(beta [r_w; r_l])`` (detached), which BCO's running mean ``delta``
    folds in before the batch's loss (TRL 0.11.4: ``RunningMoments.update`` then ``.mean``). (B,), (B,) -> ()."""
    return torch.cat((beta * chosen_logratios, beta * rejected_logratios), 0).mean().detach()


def dpo_sppo_hard_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """SPPO with hard labels (Wu et al. 2024, arXiv 2405.00675, eq. 4.7 with P(winner) = 1, P(loser) = 0):
    ``(r_w - 1 / (2 beta))^2 + (r_l + 1 / (2 beta))^2``. log-ratios (B,) -> losses (B,)."""
    return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2


def dpo_nca_pair_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """NCA, pairwise (Chen et al. 2024, arXiv 2402.05369, with K = 2 responses):
    ``-log sigmoid(beta r_w) - 1/2 log sigmoid(-beta r_w) - 1/2 log sigmoid(-beta r_l)``. (B,) -> losses (B,)."""
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    return -F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards) - 0.5 * F.logsigmoid(-rejected_rewards)


def dpo_aot_pair_loss(
    chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float, label_smoothing: float = 0.0
) -> torch.Tensor:
    """AOT for unpaired data (Melnyk et al. 2024, arXiv 2406.05882): the sigmoid loss on the gap between
    the sorted chosen and the sorted rejected log-ratios (first-order stochastic dominance of the chosen reward
    distribution, over the batch): ``sigmoid_loss(sort(r_w)_i - sort(r_l)_i)``. (B,) -> losses (B,), in sorted order."""
    chosen_sorted, _ = torch.sort(chosen_logratios, dim=0)
    rejected_sorted, _ = torch.sort(rejected_logratios, dim=0)
    return dpo_sigmoid_loss(chosen_sorted - rejected_sorted, beta, label_smoothing)


def dpo_aot_loss(
    pi_logratios: torch.Tensor, ref_logratios: torch.Tensor, beta: float, label_smoothing: float = 0.0
) -> torch.Tensor:
    """AOT for paired data (Melnyk et al. 2024, arXiv 2406.05882): the sigmoid loss on the gap between the
    sorted policy margins ``log pi_w - log pi_l`` and the sorted reference margins ``log ref_w - log ref_l``:
    ``sigmoid_loss(sort(pi)_i - sort(ref)_i)``. (B,), (B,) -> losses (B,), in sorted order."""
    pi_sorted, _ = torch.sort(pi_logratios, dim=0)
    ref_sorted, _ = torch.sort(ref_logratios, dim=0)
    return dpo_sigmoid_loss(pi_sorted - ref_sorted, beta, label_smoothing)


def dpo_apo_zero_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, arXiv 2408.06266, eq. 7), for chosen outputs better than the model's:
    raise the chosen, lower the rejected likelihood: ``1 - sigmoid(beta r_w) + sigmoid(beta r_l)``. (B,) -> (B,)."""
    return 1 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)


def dpo_apo_down_loss(chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, beta: float) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, arXiv 2408.06266, eq. 8), for chosen outputs worse than the model's:
    lower both, the rejected more: ``sigmoid(beta r_w) + 1 - sigmoid(beta (r_w - r_l))``. (B,) -> losses (B,)."""
    return torch.sigmoid(beta * chosen_logratios) + 1 - torch.sigmoid(beta * (chosen_logratios - rejected_logratios))


# TRL 0.11.4's DPOConfig.loss_type values, in its order
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_pair",
    "apo_zero", "apo_down",
)
# the loss types that read label_smoothing (TRL 0.11.4 warns that the others ignore it)
DPO_SMOOTHED_LOSS_TYPES = ("sigmoid", "robust", "exo_pair", "aot", "aot_pair")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 1.0,
    bco_delta: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO losses (B,) of ``loss_type`` and implicit rewards ``beta * (policy - reference)`` for chosen and
    rejected (B,), detached. Log-probs: (B,) each.

    ``loss_type`` is one of ``DPO_LOSS_TYPES`` (TRL 0.11.4's), computed by the ``dpo_<loss_type>_loss`` above.
    With ``reference_free`` the reference log-probs are taken as 0 for every loss type and for the rewards.
    ``f_divergence_type`` picks the divergence whose ``f'`` turns the log-ratios into the logit of the logit
    losses (``f_divergence_logits``; ``f_alpha_divergence_coef`` is alpha); the log-ratio losses do not use it.
    ``bco_pair`` needs ``bco_delta``, the running mean reward after folding in this batch's ``bco_batch_reward``.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if loss_type == "bco_pair" and bco_delta is None:
        raise ValueError("loss_type='bco_pair' needs bco_delta (the running mean reward, see bco_batch_reward)")
    ref_chosen = torch.zeros_like(reference_chosen_logps) if reference_free else reference_chosen_logps
    ref_rejected = torch.zeros_like(reference_rejected_logps) if reference_free else reference_rejected_logps
    chosen_logratios = policy_chosen_logps - ref_chosen  # (B,)
    rejected_logratios = policy_rejected_logps - ref_rejected  # (B,)
    pi_logratios = policy_chosen_logps - policy_rejected_logps  # (B,)
    ref_logratios = torch.zeros_like(pi_logratios) if reference_free else reference_chosen_logps - reference_rejected_logps

    r_w, r_l, e = chosen_logratios, rejected_logratios, label_smoothing

    def logits() -> torch.Tensor:  # (B,) the f-divergence's DPO logit, for the logit losses only
        return f_divergence_logits(r_w, r_l, pi_logratios - ref_logratios, f_divergence_type, f_alpha_divergence_coef)

    losses = {
        "sigmoid": lambda: dpo_sigmoid_loss(logits(), beta, e),
        "hinge": lambda: dpo_hinge_loss(logits(), beta),
        "ipo": lambda: dpo_ipo_loss(logits(), beta),
        "exo_pair": lambda: dpo_exo_pair_loss(logits(), beta, e),
        "nca_pair": lambda: dpo_nca_pair_loss(r_w, r_l, beta),
        "robust": lambda: dpo_robust_loss(logits(), beta, e),
        "bco_pair": lambda: dpo_bco_pair_loss(r_w, r_l, beta, bco_delta),
        "sppo_hard": lambda: dpo_sppo_hard_loss(r_w, r_l, beta),
        "aot": lambda: dpo_aot_loss(pi_logratios, ref_logratios, beta, e),
        "aot_pair": lambda: dpo_aot_pair_loss(r_w, r_l, beta, e),
        "apo_zero": lambda: dpo_apo_zero_loss(r_w, r_l, beta),
        "apo_down": lambda: dpo_apo_down_loss(r_w, r_l, beta),
    }[loss_type]()  # (B,)

    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    return losses, chosen_rewards, rejected_rewards


def rpo_nll_loss(token_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """RPO's term (Pang et al. 2024, arXiv 2404.19733 v3): the negative log-likelihood of the chosen responses,
    averaged over all their tokens in the batch (TRL 0.11.4: ``CrossEntropyLoss(ignore_index=label_pad)`` on the
    chosen half). token_logprobs (B, A), response_mask (B, A) -> (); 0 when no token is masked in."""
    mask = response_mask.to(token_logprobs.dtype)
    return -(token_logprobs * mask).sum() / mask.sum().clamp(min=1)


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


# --------------------------------------------------------------------------------------------
# ---- GRPO / RLOO (critic-free online methods; TRL 1.16 semantics, see rlhf_core.trainers.online.trainer)
# --------------------------------------------------------------------------------------------

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
# Added to a standard deviation before dividing by it (TRL 1.16's constant).
ADVANTAGE_STD_EPS = 1e-4


def correctly_rounded_sqrt(values: torch.Tensor) -> torch.Tensor:
    """``sqrt(values)`` rounded to the nearest float32 as IEEE 754 asks, with the same bits on every CPU.

    Why: on a CPU, torch's float32 ``sqrt`` is MKL's vector-math library, which is not correctly rounded (about
    one result in five is 1 ulp off on an AMD EPYC, and an Intel Xeon is off on other inputs; no MKL setting makes
    two machines agree: ../shared/ENVIRONMENT.md). GRPO's group standard deviation reaches the weights, so the
    grpo stage wrote other bytes on Intel (issue 33 row 4). Here the float64 root rounded to float32 is within one
    float32 ulp; it is then corrected with exact operations: the midpoints between it and its float32 neighbours
    have at most 25 significant bits, so their squares are exact in float64 and compare exactly with the input.
    Other dtypes, zeros, negatives, infinities and NaN: ``torch.sqrt``'s answer (exact there).
    """
    if values.dtype != torch.float32:
        return values.sqrt()
    return _nearest_root(values, values.double().sqrt().float())


def _nearest_root(values: torch.Tensor, guess: torch.Tensor) -> torch.Tensor:
    """The float32 nearest to ``sqrt(values)``, given a ``guess`` at most one ulp away (float32 tensors)."""
    below = torch.nextafter(guess, torch.zeros_like(guess))
    above = torch.nextafter(guess, torch.full_like(guess, float("inf")))
    wide, middle = values.double(), guess.double()
    low, high = (below.double() + middle) / 2, (middle + above.double()) / 2  # exact: 25 significant bits at most
    nearest = torch.where(wide < low * low, below, torch.where(wide > high * high, above, guess))
    return torch.where(torch.isfinite(guess) & (values > 0), nearest, values.sqrt())


def _nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs; NaN where fewer than two values are finite. Its root is
    :func:`correctly_rounded_sqrt`: the same bits on every CPU."""
    dims = () if dim is None else (dim,)
    mean = torch.nanmean(values, dim=dim, keepdim=True) if dim is not None else torch.nanmean(values)
    count = (~torch.isnan(values)).sum(dim=dims or None, keepdim=keepdim)
    sq = torch.nansum((values - mean) ** 2, dim=dims or None, keepdim=keepdim)
    return correctly_rounded_sqrt(torch.where(count > 1, sq / (count - 1).clamp(min=1),
                                              torch.full_like(sq, float("nan"))))


def group_relative_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages: each reward minus its group's mean, optionally divided by a standard deviation.

    rewards (N,) with N = prompts x ``num_generations``, the completions of a prompt adjacent; NaN marks an
    unscorable completion (left out of its group's statistics; its advantage is 0). ``scale_rewards``:
    ``group`` divides by the group's std (+1e-4), ``batch`` by the std of all N rewards, ``none`` not at all.
    Returns ``(advantages (N,), std (N,))``, ``std`` the per-row std used (or that would be used) for scaling.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} (or True/False), got {scale_rewards!r}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # (N,)
    if scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = _nanstd(grouped, dim=1).repeat_interleave(num_generations)  # (N,)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean  # (N,)
    if scale_rewards != "none":
        advantages = advantages / (std + ADVANTAGE_STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0), std


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate k3 = exp(ref - logp) - (ref - logp) - 1 >= 0: (B, A) -> (B, A)."""
    delta = (ref_logprobs - logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(delta) - delta - 1


def aggregate_tokens(
    per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """One loss from per-token losses (B, A), already zero where ``mask`` (B, A) is 0, the way ``loss_type`` says:
    ``grpo`` the mean over rows of each row's token mean; ``bnpo`` sum / tokens of this micro-batch (PPO's masked
    mean); ``dr_grpo`` sum / (B * max_completion_length); ``dapo`` sum / ``num_items`` (tokens of the whole
    accumulated batch; default: this micro-batch's). -> ()

    Example: per_token [[1, 1, 0], [3, 0, 0]], mask [[1, 1, 0], [1, 0, 0]]: grpo (1 + 3) / 2 = 2.0; bnpo 5 / 3.
    """
    if loss_type == "grpo":
        return (per_token.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return per_token.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return per_token.sum() / (mask.shape[0] * max_completion_length)
    items = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=mask.dtype)
    return per_token.sum() / items.clamp(min=1.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    bias_correction_kl: bool = True,
    max_completion_length: int | None = None,
    num_items: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO surrogate loss of one micro-batch, aggregated the way ``loss_type`` says.

    logprobs (B, A) with grad; old_logprobs (B, A) the log-probs at sampling time (None: on-policy, the ratio
    is exactly 1 with the gradient of logprobs); advantages (B,); response_mask (B, A); ref_logprobs (B, A)
    when ``beta != 0``. Per token: ``-min(r * adv, clip(r, 1 - eps_low, 1 + eps_high) * adv)`` (``r`` capped
    at ``delta`` if given) ``+ beta * k3`` (``k3 * r`` with ``bias_correction_kl``). Aggregation:
    ``grpo`` mean over rows of each row's token mean; ``bnpo`` sum / tokens in this micro-batch; ``dr_grpo``
    sum / (B * max_completion_length); ``dapo`` sum / ``num_items`` (tokens of the whole accumulated batch;
    default: this micro-batch's). Returns ``(loss, stats)``, detached: scalars, except ``clip_ratio/low_min`` and
    ``clip_ratio/high_max`` (B,), each sequence's clipped fraction (the trainer logs their min/max).
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {loss_type!r}")
    mask = response_mask.to(logprobs.dtype)  # (B, A)
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    log_ratio = (logprobs - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)  # (B, A)
    if importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    elif importance_sampling_level != "token":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    ratio = torch.exp(log_ratio)  # (B, A) or (B, 1)
    adv = advantages.to(logprobs.dtype)[:, None]  # (B, 1)
    per_token = clipped_surrogate(ratio, adv, epsilon_low, epsilon_high, delta)  # (B, A) or (B, 1)
    stats: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logprobs is None:
            raise ValueError("grpo_loss: beta != 0 needs ref_logprobs")
        kl = k3_kl(logprobs, ref_logprobs)  # (B, A)
        if bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl.detach(), mask)
    loss = aggregate_tokens(per_token.expand_as(mask) * mask, mask, loss_type, max_completion_length, num_items)
    low = ((ratio < 1 - epsilon_low) & (adv < 0)).to(mask.dtype)  # (B, A) or (B, 1)
    high = ((ratio > 1 + epsilon_high) & (adv > 0)).to(mask.dtype)
    region = ((low + high) > 0).to(mask.dtype)
    if ratio.shape[-1] == 1:  # sequence-level ratio: one value per sequence, means over sequences (as TRL 1.16)
        def per_seq(x): return x[:, 0]
        def mean(x): return x.mean()
    else:  # per sequence: its token mean (NaN for a fully masked row); overall: the token mean
        def per_seq(x): return (x * mask).sum(-1) / mask.sum(-1)
        def mean(x): return (x * mask).sum() / mask.sum().clamp(min=1.0)
    stats["clip_ratio/low_mean"], stats["clip_ratio/high_mean"] = mean(low), mean(high)
    stats["clip_ratio/region_mean"] = mean(region)
    stats["clip_ratio/low_min"], stats["clip_ratio/high_max"] = per_seq(low), per_seq(high)  # (B,) each
    return loss, {k: v.detach() for k, v in stats.items()}


def sequence_kl_penalized_rewards(
    scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, response_mask: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's reward: ``score - beta * sum_t (logp_t - ref_logp_t)`` over the real response tokens.

    scores (B,), logprobs/ref_logprobs/response_mask (B, A). Returns ``(rewards (B,), kl (B,))``, ``kl`` the
    sequence-level first-order estimate (may be negative for a single sequence).
    """
    kl = ((logprobs - ref_logprobs) * response_mask.to(logprobs.dtype)).sum(-1)  # (B,)
    return scores - beta * kl, kl


def rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool = False) -> torch.Tensor:
    """Leave-one-out advantages: each reward minus the mean of the other ``num_generations - 1`` of its prompt.

    rewards (N,) with the completions of a prompt adjacent; NaN marks an unscorable completion (out of its
    siblings' baselines; advantage 0). ``normalize`` whitens the advantages over the batch (std + 1e-4).
    """
    if num_generations < 2:
        raise ValueError(f"RLOO needs num_generations >= 2 (a leave-one-out baseline), got {num_generations}")
    if rewards.numel() % num_generations:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    grouped = rewards.view(-1, num_generations)  # (P, G)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)  # (P, 1)
    total = torch.nansum(grouped, dim=1, keepdim=True)  # (P, 1)
    baseline = (total - grouped) / (count - 1)  # (P, G)
    advantages = (grouped - baseline).reshape(-1)  # (N,)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (_nanstd(advantages) + ADVANTAGE_STD_EPS)
    return torch.nan_to_num(advantages, nan=0.0, posinf=0.0, neginf=0.0)


def rloo_loss(
    seq_logprobs: torch.Tensor, old_seq_logprobs: torch.Tensor | None, advantages: torch.Tensor,
    epsilon_low: float = 0.2, epsilon_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO's clipped sequence-level surrogate, averaged over the B sequences.

    seq_logprobs (B,) with grad (sum of the response's token log-probs); old_seq_logprobs (B,) at sampling
    time (None: on-policy, ratio exactly 1); advantages (B,).
    """
    old = seq_logprobs.detach() if old_seq_logprobs is None else old_seq_logprobs
    ratio = torch.exp((seq_logprobs - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # (B,)
    loss = clipped_surrogate(ratio, advantages, epsilon_low, epsilon_high).mean()
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).float()
    stats = {"clip_ratio/low_mean": low.mean(), "clip_ratio/high_mean": high.mean(),
             "clip_ratio/region_mean": ((low + high) > 0).float().mean(),
             "clip_ratio/low_min": low, "clip_ratio/high_max": high}  # (B,): the trainer's min/max over sequences
    return loss, {k: v.detach() for k, v in stats.items()}
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
