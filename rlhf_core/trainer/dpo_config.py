"""`trl.trainer.dpo_config` of TRL 0.11: re-exports `rlhf_core.trainers.dpo`."""

from rlhf_core.trainers.dpo import DPOConfig, FDivergenceType  # noqa: F401
