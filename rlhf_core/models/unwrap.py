"""The transformers causal LM inside the wrappers a trainer may hold: DDP/accelerate, the value-head model, PEFT.

The fast paths (packed forwards, LM head only where scored, lean decoding) need the inner model's forward and its
``logits_to_keep`` argument; everything else keeps the wrapped model's plain path.
"""

from __future__ import annotations

import inspect
from typing import Any

from rlhf_core.models.peft_support import is_peft_model

_TAKES_LOGITS_TO_KEEP: dict[type, bool] = {}
"""Per model class: whether its ``forward`` takes ``logits_to_keep`` (``inspect.signature`` is slow per call)."""


def language_model(model: Any) -> Any:
    """The transformers causal LM inside ``model`` if its forward takes ``logits_to_keep``, else None.

    Unwraps DDP/accelerate, the value-head wrapper and (non prompt-learning) PEFT adapters. Encoder-decoders,
    prompt-learning adapters (virtual tokens shift positions) and models without the argument get None: they
    keep the padded, full-logits path.
    """
    inner = getattr(model, "module", model)  # DDP / accelerate wrapper
    if getattr(inner, "is_encoder_decoder", False):
        return None
    lm = getattr(inner, "pretrained_model", inner)  # value-head wrapper
    if is_peft_model(lm):
        if getattr(lm.active_peft_config, "is_prompt_learning", False):
            return None
        lm = lm.get_base_model()
    if getattr(getattr(lm, "config", None), "is_encoder_decoder", False) or not hasattr(lm, "forward"):
        return None
    key = type(lm)
    if key not in _TAKES_LOGITS_TO_KEEP:
        _TAKES_LOGITS_TO_KEEP[key] = "logits_to_keep" in inspect.signature(lm.forward).parameters
    return lm if _TAKES_LOGITS_TO_KEEP[key] else None
