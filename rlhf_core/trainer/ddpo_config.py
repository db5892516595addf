"""`trl.trainer.ddpo_config` of TRL 0.11: re-exports `rlhf_core.ddpo.config`."""

from rlhf_core.ddpo.config import *  # noqa: F401,F403
