"""``RLOOTrainer``: REINFORCE Leave-One-Out with TRL 1.16.0's constructor and config.

As in TRL 1.16, the KL to the reference is sequence-level and lives in the reward: each completion's score
minus ``beta * sum_t (logp_t - ref_logp_t)`` (log-probs at sampling time), before the leave-one-out baseline;
the loss is the clipped sequence-level surrogate. The logged ``kl`` is TRL's too: the per-token KL's mean over
all completion tokens (sum of the sequence KLs / token count), not the per-sequence sum. Math:
``rlhf_core.losses`` (``sequence_kl_penalized_rewards``, ``rloo_advantages``, ``rloo_loss``).
"""

from __future__ import annotations

import torch

from rlhf_core.core import sequence_logprobs
from rlhf_core.losses import rloo_advantages, rloo_loss, sequence_kl_penalized_rewards
from rlhf_core.trainers.experience import ModelBatch, Rollout
from rlhf_core.trainers.online.trainer import OnlineRLTrainer
from rlhf_core.trainers.online.rloo_config import RLOOConfig


class RLOOTrainer(OnlineRLTrainer):
    """RLOO: each completion's baseline is the mean reward of the other ``num_generations - 1`` of its prompt.

    ``RLOOTrainer(model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
    reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
    peft_config=None)``: TRL 1.16.0's order.
    """

    trainer_name = "rloo"
    config_class = RLOOConfig

    def _needs_sampling_logprobs(self) -> bool:
        return self.beta != 0.0  # the KL in the reward uses the policy's log-probs at sampling time

    def _reward_extras(self, batch: ModelBatch, old: torch.Tensor | None, ref: torch.Tensor | None) -> torch.Tensor:
        """(B, 2): each completion's sequence-level KL to the reference (0 without one) and its token count."""
        tokens = batch.response_mask.sum(-1).float()  # (B,)
        if ref is None:
            return torch.stack([torch.zeros_like(tokens), tokens], dim=1)
        zeros = torch.zeros(len(batch), device=ref.device)
        _, kl = sequence_kl_penalized_rewards(zeros, old, ref, batch.response_mask, self.beta)  # (B,)
        return torch.stack([kl.to(tokens.dtype), tokens], dim=1)

    def _advantages(self, scores: torch.Tensor, extras: torch.Tensor, mode: str) -> torch.Tensor:
        """scores (N,), extras (N, 2) from ``_reward_extras`` for every process's completions."""
        if self.args.reward_clip_range is not None:
            scores = scores.clamp(*self.args.reward_clip_range)
        kl, tokens = extras[:, 0], extras[:, 1]  # (N,) each
        rewards = scores - self.beta * kl  # (N,) the sequence KL (a sum over tokens) is in the reward
        if self.beta != 0.0:  # logged as TRL 1.16 does: the per-token KL's mean over all completion tokens
            self._metrics[mode]["kl"].append(float(kl.sum() / tokens.sum().clamp(min=1.0)))
        return rloo_advantages(rewards, self._group_size(mode), normalize=self.args.normalize_advantages)

    def _policy_loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, rollout: Rollout, mode: str
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = rollout.batch.response_mask
        seq = sequence_logprobs(logprobs, mask)  # (B,)
        old = None if rollout.old_logprobs is None else sequence_logprobs(rollout.old_logprobs, mask)
        loss, stats = rloo_loss(seq, old, rollout.advantages.to(seq.dtype), self.epsilon_low, self.epsilon_high)
        stats["policy_loss"] = loss.detach()
        return loss / self.grad_accumulation(mode), stats


__all__ = ["RLOOConfig", "RLOOTrainer"]
