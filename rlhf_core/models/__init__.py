"""``rlhf_core.models``: the models at TRL 0.11's ``trl.models`` path (names imported on first use).

Value-head wrappers (``value_head``), the frozen reference copy (``reference``), PEFT detection
(``peft_support``), reward-model scoring (``reward_model``) and offline tiny models (``tiny``); the DDPO
pipelines live in ``rlhf_core.ddpo`` and are re-exported here under their TRL names.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# the modules whose public names (rlhf_core._lazy.PUBLIC) this package exports
__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), "rlhf_core.models", "rlhf_core.ddpo.pipeline")
