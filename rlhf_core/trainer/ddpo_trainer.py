"""`trl.trainer.ddpo_trainer` of TRL 0.11: re-exports `rlhf_core.ddpo.trainer`."""

from rlhf_core.ddpo.trainer import *  # noqa: F401,F403
