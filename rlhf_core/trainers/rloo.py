"""``RLOOTrainer``: REINFORCE Leave-One-Out with TRL 1.16.0's constructor and config.

As in TRL 1.16, the KL to the reference is sequence-level and lives in the reward: each completion's score
minus ``beta * sum_t (logp_t - ref_logp_t)`` (log-probs at sampling time), before the leave-one-out baseline;
the loss is the clipped sequence-level surrogate. Math: ``rlhf_core.losses`` (``sequence_kl_penalized_rewards``,
``rloo_advantages``, ``rloo_loss``).
"""

from __future__ import annotations

import torch

from rlhf_core.core import sequence_logprobs
from rlhf_core.losses import rloo_advantages, rloo_loss, sequence_kl_penalized_rewards
from rlhf_core.trainers.experience import ModelBatch
from rlhf_core.trainers.online import OnlineRLTrainer, Rollout
from rlhf_core.trainers.rloo_config import RLOOConfig


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
        """(B, 1) each completion's sequence-level KL to the reference (0 without one)."""
        if ref is None:
            return batch.response_mask.new_zeros(len(batch), 1)
        zeros = torch.zeros(len(batch), device=ref.device)
        _, kl = sequence_kl_penalized_rewards(zeros, old, ref, batch.response_mask, self.beta)
        return kl[:, None]

    def _advantages(self, scores: torch.Tensor, extras: torch.Tensor, mode: str) -> torch.Tensor:
        if self.args.reward_clip_range is not None:
            scores = scores.clamp(*self.args.reward_clip_range)
        rewards = scores - self.beta * extras[:, 0]  # (N,)
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append(float(extras[:, 0].mean()))
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
