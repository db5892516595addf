"""`trl.trainer.ppo_config` of TRL 0.11: re-exports `rlhf_core.trainers.ppo_config`."""

from rlhf_core.trainers.ppo_config import *  # noqa: F401,F403
