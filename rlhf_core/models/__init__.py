"""``rlhf_core.models``: the models at TRL 0.11's ``trl.models`` path (names imported on first use).

Value-head wrappers (``value_head``), the frozen reference copy (``reference``), PEFT detection
(``peft_support``), reward-model scoring (``reward_model``) and offline tiny models (``tiny``); the DDPO
pipelines live in ``rlhf_core.ddpo`` and are re-exported here under their TRL names.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "PreTrainedModelWrapper": "rlhf_core.models.value_head",
    "AutoModelForCausalLMWithValueHead": "rlhf_core.models.value_head",
    "AutoModelForSeq2SeqLMWithValueHead": "rlhf_core.models.value_head",
    "create_reference_model": "rlhf_core.models.reference",
    "is_peft_model": "rlhf_core.models.peft_support",
    "sequence_rewards": "rlhf_core.models.reward_model",
    "DDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
    "DefaultDDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
