"""`trl.trainer.utils` of TRL 0.11: the collators, `ConstantLengthDataset` and the KL controllers."""

from rlhf_core.trainers.collators import *  # noqa: F401,F403
from rlhf_core.kl_control import AdaptiveKLController, FixedKLController, RunningMoments  # noqa: F401
