"""`trl.trainer.ppo_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.ppo.trainer`."""

from rlhf_core.trainers.ppo.trainer import *  # noqa: F401,F403
