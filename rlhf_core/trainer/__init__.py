"""``rlhf_core.trainer``: the trainers and their configs at TRL 0.11's ``trl.trainer`` path.

``from trl.trainer import X`` becomes ``from rlhf_core.trainer import X``; the modules below mirror
``trl.trainer.<module>`` for the names scripts and tests import from them. Names are imported on first use.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# the modules whose public names (rlhf_core._lazy.PUBLIC) this package exports
__all__, __getattr__, __dir__ = lazy_exports(
    __name__, globals(), "rlhf_core.trainers", "rlhf_core.kl_control", "rlhf_core.ddpo.config", "rlhf_core.ddpo.trainer",
    "rlhf_core.scripts.model_config", "rlhf_core.scripts.model_helpers")
