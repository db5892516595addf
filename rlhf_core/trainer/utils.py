"""`trl.trainer.utils` of TRL 0.11: the collators, `ConstantLengthDataset`, the KL controllers, the script helpers
(`get_peft_config`, `get_quantization_config`, `get_kbit_device_map`) and the simple chat templates."""

from rlhf_core.trainers.collators import *  # noqa: F401,F403
from rlhf_core.kl_control import AdaptiveKLController, FixedKLController, RunningMoments  # noqa: F401
from rlhf_core.models.chat_format import (SIMPLE_CHAT_TEMPLATE, SIMPLE_QUERY_CHAT_TEMPLATE,  # noqa: F401
                                          SIMPLE_SFT_CHAT_TEMPLATE)
from rlhf_core.scripts.model_helpers import get_kbit_device_map, get_peft_config, get_quantization_config  # noqa: F401
