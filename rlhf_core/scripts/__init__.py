"""``rlhf_core.scripts``: the helper layer of TRL's example scripts, at TRL 1.x's ``trl.scripts`` path.

``TrlParser`` (command line + ``--config`` YAML), ``ScriptArguments`` and TRL 0.11's per-script argument classes,
``ModelConfig`` with ``get_peft_config`` / ``get_quantization_config`` / ``get_kbit_device_map``, and
``DatasetMixtureConfig`` / ``get_dataset``. Names are imported on first use.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# the modules whose public names (rlhf_core._lazy.PUBLIC) this package exports
__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), "rlhf_core.scripts")
