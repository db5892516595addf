"""Stage ``rloo``: RLOOTrainer (TRL 1.16 API, leave-one-out baseline) of the SFT policy on the training prompts
against the learned reward model (or the gold judge: ``rloo.reward: gold``), KL to the SFT reference. Writes
``models/rloo``; the body is the one ``grpo`` shares (``tasks/stages/common/group_policy.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.stages.common.group_policy import COLUMNS, GroupSampledParams, OnlineStageParams, train_group_sampled
from tasks.spec.stage import StageContext, StageResult

RLOO_CONFIG_KEYS = (
    "learning_rate", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
    "beta", "epsilon", "num_iterations", "normalize_advantages", "temperature", "seed",
)
"""The ``RLOOConfig`` fields (TRL 1.16 names) the rloo section sets, in params.yaml's order (docs: ``RLOOConfig``)."""
PLOT = dict(title="RLOO mean reward per step (reward model, or the gold judge with rloo.reward gold)", x="step",
            y="reward")
"""DVC's options of ``plots/rloo.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


@dataclass(frozen=True)
class RLOOParams(GroupSampledParams, config="RLOOConfig", keys=RLOO_CONFIG_KEYS, stage=OnlineStageParams):
    """RLOO of the SFT policy against the reward (leave-one-out baseline): ``RLOOConfig`` keys + stage keys."""


def body(ctx: StageContext) -> StageResult:
    """Train ``models/rloo``."""
    # imported here, by name, so that dvc.yaml's deps (the walk of this module's imports) hold the trainer's code
    from rlhf_core import RLOOConfig, RLOOTrainer  # the trainer loads transformers: only when the stage runs

    return train_group_sampled(ctx, RLOOConfig, RLOOTrainer)


__all__ = ["COLUMNS", "RLOO_CONFIG_KEYS", "RLOOParams", "body"]
