"""PEFT detection shared by the wrappers and the trainers (peft is optional)."""

from __future__ import annotations

from typing import Any


def is_peft_model(model: Any) -> bool:
    """True for a ``peft.PeftModel``; False for anything else or when peft is not installed."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
