"""`trl.trainer.dpo_config` of TRL 0.11: re-exports `rlhf_core.trainers.preference.dpo`."""

from rlhf_core.trainers.preference.dpo import DPOConfig, FDivergenceType  # noqa: F401
