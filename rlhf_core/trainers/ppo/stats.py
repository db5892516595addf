"""The statistics of a PPO step, in classic TRL's layout: what ``step()`` returns and ``log_stats`` logs.

Functions only (tensors and dicts in, dict out); ``PPOTrainer.record_step_stats``, ``gather_stats`` and
``log_stats`` are thin methods over them, so subclasses and TRL scripts keep calling and overriding those.
Shapes: ``B`` batch, ``A`` padded response length, ``T`` padded model sequence.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf_core.core import masked_mean, stats_to_np
from rlhf_core.trainers.experience import Experience, ModelBatch


def _std(values: torch.Tensor) -> torch.Tensor:
    """Sample standard deviation, 0 for a single value (where torch's would be NaN)."""
    return values.std() if len(values) > 1 else torch.zeros(())


def _kl_stats(kls: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
              kl_coef: float) -> dict[str, Any]:
    """objective/*: per-sequence KL (B,) and its mean, the log-probs (B, A), the KL coefficient, the entropy."""
    kl_list = (kls * mask).sum(-1)  # (B,)
    mean_kl = kl_list.mean()
    if mean_kl < -1.0:
        warnings.warn(
            f"KL divergence is starting to become negative: {float(mean_kl):.2f} - this might be a precursor "
            "for failed training. Sometimes this happens because the generation kwargs are not correctly set "
            "(sampling, top_k/top_p, min_length, eos handling). Make sure the responses are sampled from the policy.",
            stacklevel=5,  # points at step(): here <- record_step_stats <- the method <- _step_stats <- step
        )
    return {
        "objective/kl": mean_kl,
        "objective/kl_dist": kl_list,
        "objective/logprobs": logprobs,
        "objective/ref_logprobs": ref_logprobs,
        "objective/kl_coef": kl_coef,
        "objective/entropy": (-logprobs * mask).sum(-1).mean(),
    }


def _length_stats(kind: str, sequences: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """tokens/<kind>_len_mean, _len_std and _dist over the (unpadded) sequences."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.float)  # (B,)
    return {f"tokens/{kind}_len_mean": lengths.mean(), f"tokens/{kind}_len_std": _std(lengths),
            f"tokens/{kind}_dist": lengths}


def record_step_stats(kl_coef: float, *, scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                      non_score_reward: torch.Tensor, train_stats: Mapping[str, torch.Tensor], masks: torch.Tensor,
                      queries: Sequence[torch.Tensor], responses: Sequence[torch.Tensor],
                      kls: torch.Tensor, **_ignored: Any) -> dict[str, Any]:
    """The classic stats dict (objective/*, ppo/*, tokens/*), tensors detached.

    ``scores`` (B,); ``logprobs``, ``ref_logprobs``, ``non_score_reward``, ``kls``, ``masks`` (B, A);
    ``train_stats`` maps a name to the stacked per-mini-batch values, averaged over dim 0 here. Other keyword
    arguments are ignored, as classic TRL's ``record_step_stats(kl_coef, **data)`` ignores extra keys.
    """
    stats = _kl_stats(kls, logprobs, ref_logprobs, masks, kl_coef)
    stats.update({
        "ppo/mean_non_score_reward": masked_mean(non_score_reward, masks),
        "ppo/mean_scores": scores.mean(),
        "ppo/std_scores": _std(scores),
    })
    stats.update(_length_stats("queries", queries))
    stats.update(_length_stats("responses", responses))
    for key, value in train_stats.items():
        stats[f"ppo/{key}"] = torch.mean(value.float(), dim=0)
    stats["ppo/val/var_explained"] = 1 - stats["ppo/val/error"] / stats["ppo/returns/var"]
    return {key: (value.detach() if isinstance(value, torch.Tensor) else value) for key, value in stats.items()}


def with_sequence_logprobs(stats: dict[str, Any], batch: ModelBatch, experience: Experience) -> dict[str, Any]:
    """Classic TRL's layout for the two log-prob arrays: (B, T-1), T the padded model sequence (not (B, A))."""
    stats["objective/logprobs"] = batch.scatter_to_sequence(experience.logprobs)  # (B, T-1)
    stats["objective/ref_logprobs"] = batch.scatter_to_sequence(experience.ref_logprobs)  # (B, T-1)
    return stats


def finish_step_stats(stats: Mapping[str, Any], learning_rate: float, skipped_updates: int) -> dict[str, Any]:
    """The gathered stats as numpy, plus the learning rate used and the updates skipped for non-finite values."""
    out = stats_to_np(stats)
    out["ppo/learning_rate"] = learning_rate
    out["ppo/skipped_updates"] = float(skipped_updates)
    return out


def gather_stats(stats: Mapping[str, Any], accelerator) -> dict[str, Any]:
    """Average tensor stats over all processes (identity in a single process).

    A stat is averaged when every process holds it with the same shape (scalars, per-sample (B,) vectors).
    Arrays whose shape depends on the data (``objective/logprobs`` (B, T-1), per-token value arrays) stay this
    process's own: an all-reduce of unequal shapes aborts the collective (classic TRL reduces them all and
    crashes there).
    """
    if accelerator.num_processes == 1:
        return stats
    from accelerate.utils import gather_object

    shapes = {key: tuple(value.shape) for key, value in stats.items() if isinstance(value, torch.Tensor)}
    every = gather_object([shapes])  # one dict per process, in rank order
    agreed = {key for key, shape in shapes.items() if all(other.get(key) == shape for other in every)}
    gathered = {}
    for key, value in stats.items():
        if key in agreed:  # (the same keys on every process, in the same order: no collective can hang)
            value = accelerator.reduce(value.to(accelerator.device).float(), "mean")
        gathered[key] = value
    return gathered


def gather_rewards(rewards, accelerator) -> torch.Tensor:
    """The batch's rewards (a list of scalars or a tensor) of every process, flattened, on the CPU: (B * P,)."""
    if not isinstance(rewards, torch.Tensor):
        rewards = torch.stack([torch.as_tensor(r).reshape(()).float() for r in rewards])
    return accelerator.gather(rewards.float().to(accelerator.device)).flatten().cpu()


def check_columns(batch: Mapping[str, Any], columns_to_log: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the columns to log that the batch lacks."""
    missing = [c for c in columns_to_log if c not in batch]
    if missing:
        raise ValueError(f"Columns to log {list(columns_to_log)} are not present in the batch (missing {missing}); "
                         f"batch has {list(batch)}")


def reward_logs(stats: Mapping[str, Any], rewards: torch.Tensor) -> dict[str, Any]:
    """``stats`` plus env/reward_mean, env/reward_std and env/reward_dist of the rewards (N,)."""
    logs = dict(stats)
    logs["env/reward_mean"] = float(rewards.mean())
    logs["env/reward_std"] = float(rewards.std()) if len(rewards) > 1 else 0.0
    logs["env/reward_dist"] = rewards.numpy()
    return logs


def game_log_rows(batch: Mapping[str, Any], columns_to_log: Sequence[str], rewards: torch.Tensor) -> list[list]:
    """One row per sample: the logged columns' values, then the reward."""
    return [[*(batch[c][i] for c in columns_to_log), float(rewards[i])] for i in range(len(batch[columns_to_log[0]]))]
