"""rlhf_core: the classic TRL API (PPO, SFT, reward modelling, DPO, DDPO), re-implemented.

A script written against classic TRL runs after changing ``from trl import ...`` to
``from rlhf_core import ...``. Heavy submodules are imported on first use, so ``import rlhf_core``
stays fast and works without the optional orchestration or diffusion packages.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "set_seed": "rlhf_core.core",
    "LengthSampler": "rlhf_core.core",
    "respond_to_batch": "rlhf_core.core",
    "is_diffusers_available": "rlhf_core.import_utils",
    "is_peft_available": "rlhf_core.import_utils",
    "is_wandb_available": "rlhf_core.import_utils",
    "is_liger_kernel_available": "rlhf_core.import_utils",
    "PPOConfig": "rlhf_core.trainers.ppo_config",
    "PPOTrainer": "rlhf_core.trainers.ppo_trainer",
    "AdaptiveKLController": "rlhf_core.kl_control",
    "FixedKLController": "rlhf_core.kl_control",
    "RunningMoments": "rlhf_core.kl_control",
    "PreTrainedModelWrapper": "rlhf_core.models.value_head",
    "AutoModelForCausalLMWithValueHead": "rlhf_core.models.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "rlhf_core.models.value_head",
    "create_reference_model": "rlhf_core.models.reference",
    "SFTTrainer": "rlhf_core.trainers.sft",
    "SFTConfig": "rlhf_core.trainers.sft",
    "ConstantLengthDataset": "rlhf_core.trainers.collators",
    "DataCollatorForCompletionOnlyLM": "rlhf_core.trainers.collators",
    "RewardTrainer": "rlhf_core.trainers.reward",
    "RewardDataCollatorWithPadding": "rlhf_core.trainers.collators",
    "compute_accuracy": "rlhf_core.trainers.reward",
    "RewardConfig": "rlhf_core.trainers.reward",
    "DPOTrainer": "rlhf_core.trainers.dpo",
    "DPOConfig": "rlhf_core.trainers.dpo",
    "FDivergenceType": "rlhf_core.trainers.dpo",
    "DPODataCollatorWithPadding": "rlhf_core.trainers.collators",
    "DDPOConfig": "rlhf_core.ddpo.config",
    "DDPOTrainer": "rlhf_core.ddpo.trainer",
    "DDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
    "DefaultDDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
    "DDPOPipelineOutput": "rlhf_core.ddpo.pipeline",
    "DDPOSchedulerOutput": "rlhf_core.ddpo.pipeline",
    "GRPOConfig": "rlhf_core.trainers.grpo_config",
    "GRPOTrainer": "rlhf_core.trainers.grpo",
    "RLOOConfig": "rlhf_core.trainers.rloo_config",
    "RLOOTrainer": "rlhf_core.trainers.rloo",
    "KTOConfig": "rlhf_core.trainers.kto_config",
    "KTOTrainer": "rlhf_core.trainers.kto",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
