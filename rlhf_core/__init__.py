"""rlhf_core: the classic TRL API (PPO, SFT, reward modelling, DPO, DDPO), re-implemented.

A script written against classic TRL runs after changing ``from trl import ...`` to
``from rlhf_core import ...`` (the script helpers too: ``TrlParser``, ``ModelConfig``, ``get_peft_config``, ...;
README "What this is" says exactly what runs). Heavy submodules are imported on first use, so ``import rlhf_core``
stays fast and works without the optional orchestration or diffusion packages.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

__version__ = "0.1.0"

# the modules whose public names (rlhf_core._lazy.PUBLIC) this package exports
__all__, __getattr__, __dir__ = lazy_exports(
    __name__, globals(), "rlhf_core.core", "rlhf_core.import_utils", "rlhf_core.kl_control", "rlhf_core.trainers",
    "rlhf_core.models.value_head", "rlhf_core.models.reference", "rlhf_core.models.chat_format", "rlhf_core.scripts",
    "rlhf_core.data_utils", "rlhf_core.ddpo.config", "rlhf_core.ddpo.trainer", "rlhf_core.ddpo.pipeline")
