"""Whether a model's attention window is shorter than a sequence: then its mask is not plain causal.

A sliding-window layer (Gemma2/3's ``sliding_attention`` layers, Mistral with ``sliding_window`` set, Qwen2 with
``use_sliding_window``) lets a query see only the last ``sliding_window`` keys; a chunked-attention layer (Llama4's
``chunked_attention``) only the keys of its own chunk. Over a sequence no longer than the window (or the chunk)
both equal full causal attention, so the masks this library builds itself (``forward.explicit_masks``, the static
decode's) are exact there; over a longer one only the model's own mask code is.
"""

from __future__ import annotations

from typing import Any

# layer types whose keys are limited by a window (transformers' ``config.layer_types`` names)
_WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}


def attention_window(config: Any) -> int | None:
    """The shortest key window of any layer of ``config`` (a transformers config, or its text config), or None
    when every layer attends to all earlier keys."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None)
    if layer_types is None:  # Mistral-style configs: every layer uses ``sliding_window`` when it is set
        window = getattr(text, "sliding_window", None)
        if getattr(text, "use_sliding_window", True) is False:
            return None
        return int(window) if window else None
    windows = [getattr(text, _WINDOWED[kind], None) for kind in set(layer_types) if kind in _WINDOWED]
    if any(kind not in _WINDOWED and kind != "full_attention" for kind in layer_types):
        return 0  # a layer kind this library does not know: treat it as limited (its own masks only)
    windows = [int(w) if w else 0 for w in windows]
    return min(windows) if windows else None


def window_binds(config: Any, length: int) -> bool:
    """Whether some layer of ``config`` sees fewer keys than a plain causal mask over ``length`` tokens would."""
    window = attention_window(config)
    return window is not None and window < length
