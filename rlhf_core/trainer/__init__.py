"""``rlhf_core.trainer``: the trainers and their configs at TRL 0.11's ``trl.trainer`` path.

``from trl.trainer import X`` becomes ``from rlhf_core.trainer import X``; the modules below mirror
``trl.trainer.<module>`` for the names scripts and tests import from them. Names are imported on first use.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "PPOConfig": "rlhf_core.trainers.ppo_config",
    "PPOTrainer": "rlhf_core.trainers.ppo_trainer",
    "SFTConfig": "rlhf_core.trainers.sft",
    "SFTTrainer": "rlhf_core.trainers.sft",
    "RewardConfig": "rlhf_core.trainers.reward",
    "RewardTrainer": "rlhf_core.trainers.reward",
    "compute_accuracy": "rlhf_core.trainers.reward",
    "DPOConfig": "rlhf_core.trainers.dpo",
    "DPOTrainer": "rlhf_core.trainers.dpo",
    "FDivergenceType": "rlhf_core.trainers.dpo",
    "DDPOConfig": "rlhf_core.ddpo.config",
    "DDPOTrainer": "rlhf_core.ddpo.trainer",
    "ConstantLengthDataset": "rlhf_core.trainers.collators",
    "DataCollatorForCompletionOnlyLM": "rlhf_core.trainers.collators",
    "DPODataCollatorWithPadding": "rlhf_core.trainers.collators",
    "RewardDataCollatorWithPadding": "rlhf_core.trainers.collators",
    "AdaptiveKLController": "rlhf_core.kl_control",
    "FixedKLController": "rlhf_core.kl_control",
    "RunningMoments": "rlhf_core.kl_control",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
