"""``trl.commands.cli_utils`` of TRL 0.11: ``TrlParser``, the per-script argument classes, ``init_zero_verbose``."""

from rlhf_core.scripts.arguments import (DPOScriptArguments, RewardScriptArguments,  # noqa: F401
                                         SFTScriptArguments)
from rlhf_core.scripts.parser import TrlParser, init_zero_verbose  # noqa: F401
