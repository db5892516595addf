"""`trl.trainer.ppo_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.ppo_trainer`."""

from rlhf_core.trainers.ppo_trainer import *  # noqa: F401,F403
