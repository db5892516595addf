"""``trl.scripts.utils`` of TRL 1.x: the parser, the script arguments and the dataset mixture."""

from rlhf_core.scripts.arguments import ScriptArguments  # noqa: F401
from rlhf_core.scripts.dataset_mixture import DatasetConfig, DatasetMixtureConfig, get_dataset  # noqa: F401
from rlhf_core.scripts.parser import TrlParser, init_zero_verbose  # noqa: F401
