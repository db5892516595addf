"""``trl.trainer.model_config`` of TRL 0.11."""

from rlhf_core.scripts.model_config import ModelConfig  # noqa: F401
