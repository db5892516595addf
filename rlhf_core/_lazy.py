"""Lazy package exports: a name is imported from its module on first access (PEP 562), so importing a package
loads none of its heavy submodules (diffusers, transformers trainers) until one of its names is used.

``PUBLIC`` is the one table of where each public name is defined; every package (``rlhf_core`` and its TRL-path
mirrors ``rlhf_core.trainer``, ``rlhf_core.models``, ``rlhf_core.ddpo``) re-exports the names of the modules it
names, so a new public name is added here once and appears at every path that covers its module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# module -> the public names it defines
PUBLIC: dict[str, tuple[str, ...]] = {
    "rlhf_core.core": ("set_seed", "LengthSampler", "respond_to_batch"),
    "rlhf_core.import_utils": ("is_diffusers_available", "is_peft_available", "is_wandb_available",
                               "is_liger_kernel_available"),
    "rlhf_core.kl_control": ("AdaptiveKLController", "FixedKLController", "RunningMoments"),
    "rlhf_core.models.value_head": ("PreTrainedModelWrapper", "AutoModelForCausalLMWithValueHead",
                                    "AutoModelForSeq2SeqLMWithValueHead"),
    "rlhf_core.models.reference": ("create_reference_model",),
    "rlhf_core.models.peft_support": ("is_peft_model",),
    "rlhf_core.models.reward_model": ("sequence_rewards",),
    "rlhf_core.trainers.ppo.config": ("PPOConfig",),
    "rlhf_core.trainers.ppo.trainer": ("PPOTrainer",),
    "rlhf_core.trainers.sft": ("SFTTrainer", "SFTConfig"),
    "rlhf_core.trainers.preference.reward": ("RewardTrainer", "RewardConfig", "compute_accuracy"),
    "rlhf_core.trainers.preference.dpo": ("DPOTrainer", "DPOConfig", "FDivergenceType"),
    "rlhf_core.trainers.collators": ("ConstantLengthDataset", "DataCollatorForCompletionOnlyLM",
                                     "RewardDataCollatorWithPadding", "DPODataCollatorWithPadding"),
    "rlhf_core.trainers.online.grpo_config": ("GRPOConfig",),
    "rlhf_core.trainers.online.grpo": ("GRPOTrainer",),
    "rlhf_core.trainers.online.rloo_config": ("RLOOConfig",),
    "rlhf_core.trainers.online.rloo": ("RLOOTrainer",),
    "rlhf_core.trainers.preference.kto_config": ("KTOConfig",),
    "rlhf_core.trainers.preference.kto": ("KTOTrainer",),
    "rlhf_core.scripts.model_config": ("ModelConfig",),
    "rlhf_core.scripts.model_helpers": ("get_peft_config", "get_quantization_config", "get_kbit_device_map"),
    "rlhf_core.scripts.parser": ("TrlParser", "init_zero_verbose"),
    "rlhf_core.scripts.arguments": ("ScriptArguments", "SFTScriptArguments", "DPOScriptArguments",
                                    "RewardScriptArguments"),
    "rlhf_core.scripts.dataset_mixture": ("DatasetConfig", "DatasetMixtureConfig", "get_dataset"),
    "rlhf_core.models.chat_format": ("setup_chat_format", "SIMPLE_CHAT_TEMPLATE", "SIMPLE_SFT_CHAT_TEMPLATE",
                                     "SIMPLE_QUERY_CHAT_TEMPLATE"),
    "rlhf_core.data_utils": ("apply_chat_template", "extract_prompt", "is_conversational",
                             "maybe_apply_chat_template", "maybe_extract_prompt", "maybe_unpair_preference_dataset",
                             "unpair_preference_dataset"),
    "rlhf_core.ddpo.config": ("DDPOConfig",),
    "rlhf_core.ddpo.trainer": ("DDPOTrainer",),
    "rlhf_core.ddpo.pipeline": ("DDPOStableDiffusionPipeline", "DefaultDDPOStableDiffusionPipeline",
                                "DDPOPipelineOutput", "DDPOSchedulerOutput", "tiny_stable_diffusion_pipeline"),
    "rlhf_core.ddpo.math": ("PerPromptStatTracker", "ddim_step_with_logprob", "ddpo_clipped_loss",
                            "normalize_rewards"),
    "rlhf_core.ddpo.rewards": ("jpeg_compressibility", "jpeg_incompressibility", "image_grid"),
}


def exported_by(*modules: str) -> dict[str, str]:
    """Public name -> defining module, for the modules of ``PUBLIC`` that are, or lie under, one of ``modules``."""
    def covered(module: str) -> bool:
        return any(module == m or module.startswith(m + ".") for m in modules)

    return {name: module for module, names in PUBLIC.items() if covered(module) for name in names}


def lazy_exports(package: str, namespace: dict[str, Any], *modules: str
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``, exporting the public names of ``modules``
    (see ``exported_by``); a resolved name is cached in the package's ``namespace`` (its ``globals()``)."""
    exports = exported_by(*modules)
    if not exports:
        raise ValueError(f"{package}: no public names under {modules}")

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return sorted(exports), __getattr__, __dir__
