"""Pure math for DDPO (Black et al., "Training Diffusion Models with Reinforcement Learning").

A DDIM step with ``eta > 0`` is a Gaussian policy ``p(x_{t-1} | x_t, c) = N(mean, std^2 I)``; DDPO
records the log-density of each sampled ``x_{t-1}`` and optimises it with a clipped PPO objective.

Everything here is a pure function (tensors in, tensors out) except ``PerPromptStatTracker``, which is
the small stateful buffer the paper uses to normalise rewards per prompt. Shapes: ``B`` batch, ``C``
latent channels, ``H``/``W`` latent height/width, ``S`` sampling steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import torch

PREDICTION_TYPES = ("epsilon", "sample", "v_prediction")
# Added to the standard deviation before dividing, as in the paper's code, so a constant batch gives 0.
ADVANTAGE_EPS = 1e-6
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
# Log-ratios beyond this are clamped before exp(): the clip range makes them irrelevant anyway.
MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------------------------
# DDIM step as a Gaussian policy
# --------------------------------------------------------------------------------------------


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape per-sample values (B,) or a scalar to broadcast against ``like`` (B, ...)."""
    values = values.to(like.dtype)
    if values.ndim == 0:
        return values
    return values.reshape(values.shape[0], *([1] * (like.ndim - 1)))  # (B, 1, 1, 1)


def ddim_alphas(
    timestep: torch.Tensor, alphas_cumprod: torch.Tensor, final_alpha_cumprod: torch.Tensor, step_ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative alphas at ``timestep`` and at the previous DDIM timestep ``timestep - step_ratio``.

    timestep: () or (B,) integer; alphas_cumprod: (num_train_timesteps,). A previous timestep below 0
    uses ``final_alpha_cumprod`` (as diffusers' DDIMScheduler does). Returns two tensors shaped like
    ``timestep``.
    """
    timestep = torch.as_tensor(timestep, device=alphas_cumprod.device).long()
    prev_timestep = timestep - step_ratio
    alpha_prod_t = alphas_cumprod[timestep]
    alpha_prod_prev = torch.where(
        prev_timestep >= 0, alphas_cumprod[prev_timestep.clamp(min=0)], final_alpha_cumprod.to(alphas_cumprod)
    )
    return alpha_prod_t, alpha_prod_prev


def ddim_variance(alpha_prod_t: torch.Tensor, alpha_prod_prev: torch.Tensor) -> torch.Tensor:
    """DDIM's sigma_t^2 / eta^2 = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev) (DDIM paper, eq. 16)."""
    return (1 - alpha_prod_prev) / (1 - alpha_prod_t) * (1 - alpha_prod_t / alpha_prod_prev)


def predicted_original_and_noise(
    model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor, prediction_type: str = "epsilon"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_0, epsilon) predicted from the model output for the three diffusers prediction types."""
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        return (sample - beta_prod_t.sqrt() * model_output) / alpha_prod_t.sqrt(), model_output
    if prediction_type == "sample":
        return model_output, (sample - alpha_prod_t.sqrt() * model_output) / beta_prod_t.sqrt()
    if prediction_type == "v_prediction":
        original = alpha_prod_t.sqrt() * sample - beta_prod_t.sqrt() * model_output
        return original, alpha_prod_t.sqrt() * model_output + beta_prod_t.sqrt() * sample
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def gaussian_log_prob(value: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Log-density of ``value`` under N(mean, std^2), averaged over all but the batch dim: (B, ...) -> (B,).

    The average (not the sum) over latent elements is the convention of the DDPO paper's code: it keeps
    log-ratios, and so the PPO clip range, independent of the latent size.
    """
    log_density = -((value - mean) ** 2) / (2 * std**2) - torch.log(std) - LOG_SQRT_2PI  # (B, C, H, W)
    return log_density.mean(dim=tuple(range(1, value.ndim)))  # (B,)


def ddim_step_with_logprob(
    model_output: torch.Tensor,
    timestep: torch.Tensor | int,
    sample: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    final_alpha_cumprod: torch.Tensor,
    step_ratio: int,
    eta: float,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    prediction_type: str = "epsilon",
    clip_sample_range: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DDIM step x_t -> x_{t-1} and the log-probability of x_{t-1} under the step's Gaussian.

    model_output, sample, noise, prev_sample: (B, C, H, W); timestep: int or (B,). ``step_ratio`` is
    ``num_train_timesteps // num_inference_steps``. When ``prev_sample`` is None it is drawn as
    ``mean + std * noise``; when given (training), only its log-probability is computed, with gradients
    flowing through the mean. Returns ``(prev_sample, log_prob (B,), mean, std)``; matches diffusers'
    ``DDIMScheduler.step(..., variance_noise=noise)`` with ``use_clipped_model_output=False``.
    """
    if eta <= 0:
        raise ValueError(f"eta must be > 0 for a stochastic policy with a log-probability, got {eta}")
    alpha_prod_t, alpha_prod_prev = ddim_alphas(timestep, alphas_cumprod, final_alpha_cumprod, step_ratio)
    alpha_prod_t = _per_sample(alpha_prod_t, sample)  # (B, 1, 1, 1) or ()
    alpha_prod_prev = _per_sample(alpha_prod_prev, sample)  # (B, 1, 1, 1) or ()
    original, epsilon = predicted_original_and_noise(model_output, sample, alpha_prod_t, prediction_type)
    if clip_sample_range is not None:
        original = original.clamp(-clip_sample_range, clip_sample_range)
    std = eta * ddim_variance(alpha_prod_t, alpha_prod_prev).sqrt()  # (B, 1, 1, 1)
    direction = (1 - alpha_prod_prev - std**2).sqrt() * epsilon  # (B, C, H, W)
    mean = alpha_prod_prev.sqrt() * original + direction  # (B, C, H, W)
    if prev_sample is None:
        if noise is None:
            raise ValueError("ddim_step_with_logprob needs either noise (to sample) or prev_sample (to score)")
        prev_sample = mean + std * noise
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, std.expand_as(mean))  # (B,)
    return prev_sample.to(sample.dtype), log_prob, mean, std


def classifier_free_guidance(noise_uncond: torch.Tensor, noise_text: torch.Tensor, scale: float) -> torch.Tensor:
    """Guided noise prediction ``uncond + scale * (text - uncond)`` (Ho & Salimans)."""
    return noise_uncond + scale * (noise_text - noise_uncond)


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def normalize_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Global advantages: (r - mean) / (std + eps) over the batch (population std): (N,) -> (N,)."""
    rewards = rewards.double()
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + ADVANTAGE_EPS)


class PerPromptStatTracker:
    """Per-prompt reward normalisation: each prompt keeps its last ``buffer_size`` rewards.

    ``update`` returns advantages ``(r - mean) / (std + 1e-6)`` where mean and std (population) come
    from the prompt's buffer once it holds at least ``min_count`` rewards, and from the whole batch
    passed to ``update`` before that.
    """

    def __init__(self, buffer_size: int, min_count: int) -> None:
        if buffer_size < 1:
            raise ValueError(f"per_prompt_stat_tracking_buffer_size must be >= 1, got {buffer_size}")
        if min_count < 1 or min_count > buffer_size:
            raise ValueError(
                f"per_prompt_stat_tracking_min_count must be in [1, buffer_size={buffer_size}], got {min_count}"
            )
        self.buffer_size = buffer_size
        self.min_count = min_count
        self.stats: dict[str, deque[float]] = {}

    def update(self, prompts: Sequence[str], rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
        """Add ``rewards`` (N,) for ``prompts`` (N,) to the buffers and return advantages (N,) in float64."""
        rewards = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)  # (N,)
        if len(prompts) != rewards.shape[0]:
            raise ValueError(f"got {len(prompts)} prompts for {rewards.shape[0]} rewards")
        advantages = torch.empty_like(rewards)
        batch_mean, batch_std = rewards.mean(), rewards.std(unbiased=False)
        for prompt in dict.fromkeys(prompts):
            rows = torch.tensor([p == prompt for p in prompts])  # (N,) bool
            buffer = self.stats.setdefault(prompt, deque(maxlen=self.buffer_size))
            buffer.extend(rewards[rows].tolist())
            if len(buffer) < self.min_count:
                mean, std = batch_mean, batch_std
            else:
                history = torch.tensor(list(buffer), dtype=torch.float64)
                mean, std = history.mean(), history.std(unbiased=False)
            advantages[rows] = (rewards[rows] - mean) / (std + ADVANTAGE_EPS)
        return advantages

    def get_stats(self) -> dict[str, dict[str, float]]:
        """``{prompt: {"mean", "std", "count"}}`` over each prompt's current buffer."""
        out = {}
        for prompt, buffer in self.stats.items():
            history = torch.tensor(list(buffer), dtype=torch.float64)
            out[prompt] = {"mean": history.mean().item(), "std": history.std(unbiased=False).item(), "count": len(buffer)}
        return out

    def state_dict(self) -> dict[str, list[float]]:
        """The buffers as plain lists (JSON-serialisable) for checkpoints."""
        return {prompt: list(buffer) for prompt, buffer in self.stats.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        """Restore buffers saved by ``state_dict``."""
        self.stats = {prompt: deque(values, maxlen=self.buffer_size) for prompt, values in state.items()}


# --------------------------------------------------------------------------------------------
# Clipped DDPO loss
# --------------------------------------------------------------------------------------------


def ddpo_clipped_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate on one denoising step: all inputs (B,) -> scalar loss and detached stats.

    Advantages are clipped to ``[-adv_clip_max, adv_clip_max]``; ``ratio = exp(log_prob - old_log_prob)``;
    ``loss = mean(max(-A * ratio, -A * clip(ratio, 1 - clip_range, 1 + clip_range)))``. Stats:
    ``approx_kl = 0.5 * mean((log_prob - old_log_prob)^2)``, ``clipfrac`` = share of |ratio - 1| > clip_range,
    ``ratio`` = mean ratio.
    """
    advantages = advantages.to(log_prob.dtype).clamp(-adv_clip_max, adv_clip_max)
    log_ratio = (log_prob - old_log_prob).clamp(max=MAX_LOG_RATIO)  # (B,)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    stats = {
        "approx_kl": 0.5 * (log_prob - old_log_prob).detach().square().mean(),
        "clipfrac": ((ratio.detach() - 1.0).abs() > clip_range).float().mean(),
        "ratio": ratio.detach().mean(),
    }
    return loss, stats
