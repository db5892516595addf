"""`trl.trainer.reward_config` of TRL 0.11: re-exports `rlhf_core.trainers.reward`."""

from rlhf_core.trainers.reward import RewardConfig  # noqa: F401
