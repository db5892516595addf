"""`trl.trainer.reward_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.preference.reward`."""

from rlhf_core.trainers.preference.reward import *  # noqa: F401,F403
