"""`trl.trainer.sft_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.sft`."""

from rlhf_core.trainers.sft import *  # noqa: F401,F403
