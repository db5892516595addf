"""Stage ``grpo``: GRPOTrainer (TRL 1.16 API, group-relative advantages) of the SFT policy on the training prompts
against the learned reward model (or the gold judge: ``grpo.reward: gold``), KL to the SFT reference. Writes
``models/grpo``; the body is the one ``rloo`` shares (``tasks/stages/common/group_policy.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.stages.common.group_policy import COLUMNS, GroupSampledParams, OnlineStageParams, train_group_sampled
from tasks.spec.stage import StageContext, StageResult

GRPO_CONFIG_KEYS = (
    "learning_rate", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
    "beta", "epsilon", "loss_type", "scale_rewards", "num_iterations", "temperature", "seed",
)
"""The ``GRPOConfig`` fields (TRL 1.16 names) the grpo section sets, in params.yaml's order (docs: ``GRPOConfig``)."""
PLOT = dict(title="GRPO mean reward per step (reward model, or the gold judge with grpo.reward gold)", x="step",
            y="reward")
"""DVC's options of ``plots/grpo.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


@dataclass(frozen=True)
class GRPOParams(GroupSampledParams, config="GRPOConfig", keys=GRPO_CONFIG_KEYS, stage=OnlineStageParams):
    """GRPO of the SFT policy against the reward (group-relative advantages): ``GRPOConfig`` keys + stage keys."""


def body(ctx: StageContext) -> StageResult:
    """Train ``models/grpo``."""
    # imported here, by name, so that dvc.yaml's deps (the walk of this module's imports) hold the trainer's code
    from rlhf_core import GRPOConfig, GRPOTrainer  # the trainer loads transformers: only when the stage runs

    return train_group_sampled(ctx, GRPOConfig, GRPOTrainer)


__all__ = ["COLUMNS", "GRPO_CONFIG_KEYS", "GRPOParams", "body"]
