"""``trl.models.utils`` of TRL 0.11: ``setup_chat_format`` and the value-head classes a trainer accepts."""

from rlhf_core.models.chat_format import setup_chat_format  # noqa: F401
from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead

SUPPORTED_ARCHITECTURES = (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)
