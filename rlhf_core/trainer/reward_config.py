"""`trl.trainer.reward_config` of TRL 0.11: re-exports `rlhf_core.trainers.preference.reward`."""

from rlhf_core.trainers.preference.reward import RewardConfig  # noqa: F401
