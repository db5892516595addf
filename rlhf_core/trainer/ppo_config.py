"""`trl.trainer.ppo_config` of TRL 0.11: re-exports `rlhf_core.trainers.ppo.config`."""

from rlhf_core.trainers.ppo.config import *  # noqa: F401,F403
