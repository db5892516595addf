"""``GRPOTrainer``: Group Relative Policy Optimization with TRL 1.16.0's constructor and config.

A TRL 1.16 GRPO script runs after ``from trl import GRPOConfig, GRPOTrainer`` becomes
``from rlhf_core import GRPOConfig, GRPOTrainer``. The shared machinery (sampling, rewards, buffering,
checkpoints) is ``rlhf_core.trainers.online.trainer``; the math is ``rlhf_core.losses`` (``group_relative_advantages``,
``grpo_loss``).
"""

from __future__ import annotations

from typing import Any

import torch

from rlhf_core.losses import group_relative_advantages, grpo_loss
from rlhf_core.trainers.experience import Rollout
from rlhf_core.trainers.online.grpo_config import GRPOConfig
from rlhf_core.trainers.online.trainer import OnlineRLTrainer


class GRPOTrainer(OnlineRLTrainer):
    """GRPO: advantages relative to each prompt's group of ``num_generations`` completions; no value model.

    ``GRPOTrainer(model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
    processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
    quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None)``.
    """

    trainer_name = "grpo"
    config_class = GRPOConfig

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config: Any = None,
                 peft_config: Any = None, tools: list | None = None, rollout_func: Any = None,
                 environment_factory: Any = None, **tracking: Any) -> None:
        """TRL 1.16.0's positional order. ``tools``/``rollout_func``/``environment_factory`` (agent training)
        are not supported here and must be None; ``tracking`` takes ``log_with``/``tracker_project_name``/
        ``tracker_kwargs`` (see ``OnlineRLTrainer``)."""
        for name, value in (("tools", tools), ("rollout_func", rollout_func),
                            ("environment_factory", environment_factory)):
            if value is not None:
                raise ValueError(f"{name} (agent/tool training in TRL 1.16) is not supported by rlhf_core; pass None")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config, **tracking)

    def token_mean_stats(self) -> tuple[str, ...]:
        """``kl`` and ``entropy`` are token means; the clip ratios too unless the ratio is per sequence."""
        clip = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
        return ("kl", "entropy") + (clip if self.args.importance_sampling_level == "token" else ())

    def _advantages(self, scores: torch.Tensor, extras: torch.Tensor, mode: str) -> torch.Tensor:
        advantages, _ = group_relative_advantages(scores, self._group_size(mode), self.args.scale_rewards)
        return advantages

    def _policy_loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, rollout: Rollout, mode: str
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = self.args
        accumulation = self.grad_accumulation(mode)
        # dapo: the token count of one accumulation window on this process (the generation batch spans
        # steps_per_generation micro-batches on each of num_processes processes).
        window_items = rollout.num_items / self.accelerator.num_processes
        if mode == "train":
            window_items = window_items * accumulation / args.steps_per_generation
        loss, stats = grpo_loss(
            logprobs, rollout.old_logprobs, rollout.advantages, rollout.batch.response_mask,
            loss_type=args.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            beta=self.beta, ref_logprobs=rollout.ref_logprobs, delta=args.delta,
            importance_sampling_level=args.importance_sampling_level, bias_correction_kl=args.use_bias_correction_kl,
            max_completion_length=args.max_completion_length, num_items=window_items,
        )
        stats["policy_loss"] = loss.detach()
        if args.loss_type != "dapo":  # the others are per-micro-batch means: average over the window
            loss = loss / accumulation
        if args.entropy_coef:
            mask = rollout.batch.response_mask
            mean_entropy = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
            loss = loss - args.entropy_coef * mean_entropy / accumulation
            if mode == "train":
                self._metrics[mode]["entropy_coef"].append(float(args.entropy_coef))  # logged as TRL 1.16 does
        return loss, stats


__all__ = ["GRPOConfig", "GRPOTrainer"]
