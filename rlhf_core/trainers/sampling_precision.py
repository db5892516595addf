"""The precision generation samples in: the policy's training precision.

A policy held in bf16/fp16 (``PPOConfig(bf16_weights=True)``) samples in it as it is. A policy with fp32 weights
trained under bf16/fp16 mixed precision (accelerate's ``mixed_precision``) samples, on CUDA, from a half-precision
copy of its weights, refreshed in place from the fp32 weights at every call: decoding reads every weight once per
token, so half the bytes is twice the speed of a bandwidth-bound step, and the copy (kept per model, at fixed
addresses, so a captured decode step stays valid) costs one read of the weights per call. Under autocast instead,
every token step would cast every weight again. On the CPU (where bf16 matmuls may be emulated) and with fp32
training, the policy samples as it is.

A PEFT model samples under autocast instead of from a copy: its adapters are switched on and off in place (the
reference responses of ``PPOTrainer.generate``), which a copy would not follow.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.models.peft_support import is_peft_model

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Per model: its half-precision sampling copy (gone with the model).
_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Sampler:
    """The module to sample with and the context to sample in."""

    model: Any
    context: contextlib.AbstractContextManager
    copied: bool = False


def sampler_for(model: Any, mixed_precision: str | None) -> Sampler:
    """How ``model`` (a transformers LM, maybe PEFT) samples under accelerate's ``mixed_precision`` setting."""
    dtype = HALF.get(str(mixed_precision))
    weight = next(model.parameters(), None)
    if dtype is None or weight is None or weight.device.type != "cuda" or weight.dtype != torch.float32:
        return Sampler(model, contextlib.nullcontext())
    if is_peft_model(model) or hasattr(model, "_hf_hook"):  # adapters toggled in place / accelerate dispatch hooks
        return Sampler(model, torch.autocast("cuda", dtype=dtype))
    return Sampler(half_copy(model, dtype), contextlib.nullcontext(), copied=True)


@torch.no_grad()
def half_copy(model: Any, dtype: torch.dtype) -> Any:
    """``model``'s copy with ``dtype`` parameters (buffers as they are), its weights refreshed from ``model``'s now."""
    kept = _COPIES.get(model)
    params = list(model.parameters())
    if kept is None or kept[0] != dtype or [p.shape for p in kept[1].parameters()] != [p.shape for p in params]:
        shadow = copy.deepcopy(model)
        shadow.__dict__.pop("forward", None)  # accelerate's autocast wrapper: the copy already is half precision
        for p in shadow.parameters():
            p.requires_grad_(False)
            p.data = p.data.to(dtype)
        kept = (dtype, shadow)
        _COPIES[model] = kept
    shadow = kept[1]
    for mine, source in zip(shadow.parameters(), params):
        mine.copy_(source)
    for mine, source in zip(shadow.modules(), model.modules()):
        mine.training = source.training
    return shadow
