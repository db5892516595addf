"""`trl.trainer.sft_config` of TRL 0.11: re-exports `rlhf_core.trainers.sft`."""

from rlhf_core.trainers.sft import SFTConfig  # noqa: F401
