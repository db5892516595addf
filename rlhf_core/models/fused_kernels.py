"""Fewer kernels where transformers' eager code launches several: GPT-2's tanh GELU, Llama-style RMSNorm, rotary.

GPT-2's ``gelu_new`` (``NewGELUActivation``; ``gelu_fast`` the same) is written as eight elementwise operations:
eight kernel launches, eight reads and writes of the (B, T, 4H) activation, in the forward and again in the
backward (the first GPU profile: ~40% of a layer's training time, ~7 of ~23 kernels per decode layer).
``torch.nn.functional.gelu(x, approximate="tanh")`` is the same function in one kernel. Llama / Qwen2 / Mistral's
``RMSNorm`` is five operations around a float32 upcast; ``torch.nn.functional.rms_norm`` on the upcast input is the
same computation in one kernel where the backend has one. Their rotary embedding (``apply_rotary_pos_emb``, the
same function in Llama, Qwen2/3, Mistral and Gemma 1-3) is ten kernels per layer: for each of q and k,
``rotate_half``'s neg and cat, two multiplies and an add. ``fused_rotary`` moves ``rotate_half``'s sign onto ``sin``
once for both (neg, cat), swaps the halves with one ``flip`` and does the rest with one multiply and one ``addcmul``:
eight kernels, a fifth fewer (bench/rotary_kernels.py counts them), reading and writing q or k seven times instead
of ten.

All three agree with the eager code to rounding, not bit for bit (another evaluation order), so ``fuse_kernels`` runs
only where asked: the trainers call it for a model on a CUDA device (``fuses_on``); on the CPU the eager modules stay
and results are byte-identical. ``tests/test_fused_kernels.py`` forces the swap on the CPU and compares.
"""

from __future__ import annotations

from types import FunctionType, MethodType
from typing import Any

import torch
import torch.nn.functional as F

# transformers' activation modules that compute the tanh approximation of GELU
_TANH_GELU = {"NewGELUActivation", "FastGELUActivation"}
# RMSNorm classes whose forward is exactly: upcast to fp32, x * rsqrt(mean(x^2) + eps), cast back, times weight
_LLAMA_RMS_NORM = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}
# Attention classes whose forward calls their module's ``apply_rotary_pos_emb(q, k, cos, sin)``; it is replaced only
# where that function (and its ``rotate_half``) is Llama's code (``_standard_rotary``): Phi3's partial one is not.
_ROTARY_ATTENTION = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention", "GemmaAttention",
                     "Gemma2Attention", "Gemma3Attention"}


class TanhGELU(torch.nn.Module):
    """GELU with the tanh approximation in one kernel (``NewGELUActivation``'s function)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def _fused_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The Llama-style RMSNorm forward with ``F.rms_norm`` doing the normalisation (in fp32, as the eager one)."""
    normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(hidden_states.dtype)


def fused_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` in eight kernels instead of ten: ``x * cos + rotate_half(x) * sin``
    with ``rotate_half(x) = (-x2, x1)`` is ``x * cos + (x2, x1) * (-sin1, sin2)``; the signed ``sin`` is made once
    for q and k, the swap is one ``flip`` and the product and sum one ``addcmul``. Shapes as transformers' (q, k:
    (b, heads, T, D); cos, sin: (b, T, D), the same in both halves)."""
    if cos.shape[-1] != q.shape[-1] or q.shape[-1] % 2:  # not the full-width rotary this formulation assumes
        raise ValueError(f"fused_rotary: cos has {cos.shape[-1]} features, q has {q.shape[-1]} (must be equal, even)")
    half = q.shape[-1] // 2
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return _rotate(q, cos, signed_sin, half), _rotate(k, cos, signed_sin, half)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    swapped = x.unflatten(-1, (2, half)).flip(-2).flatten(-2)  # (x2, x1): one copy, no neg and no cat
    return torch.addcmul(x * cos, swapped, signed_sin)


def _same_code(a: Any, b: Any) -> bool:
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    return code_a is not None and code_b is not None and \
        (code_a.co_code, code_a.co_names) == (code_b.co_code, code_b.co_names)


def _standard_rotary(forward: Any) -> bool:
    """``forward`` calls a global ``apply_rotary_pos_emb`` that is Llama's (the same bytecode, the same
    ``rotate_half``): the function ``fused_rotary`` reproduces. False for anything else (a wrapped forward, a partial
    or interleaved rotary)."""
    from transformers.models.llama import modeling_llama as llama

    scope = getattr(forward, "__globals__", {})
    return "apply_rotary_pos_emb" in getattr(getattr(forward, "__code__", None), "co_names", ()) and \
        all(_same_code(scope.get(name), getattr(llama, name)) for name in ("apply_rotary_pos_emb", "rotate_half"))


def _with_fused_rotary(forward: Any) -> FunctionType:
    """A copy of an attention class's ``forward`` that calls ``fused_rotary`` where it called its module's
    ``apply_rotary_pos_emb``: the same code over a copy of the module's globals with that one name changed, so only
    the modules it is bound to change (transformers' module, and every other model of the class, keep the eager
    function). The copy snapshots the globals: a later patch of transformers' module does not reach it."""
    scope = dict(forward.__globals__, apply_rotary_pos_emb=fused_rotary)
    copy = FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = forward.__qualname__, forward.__doc__, forward.__module__
    return copy


def fuses_on(device: torch.device | str) -> bool:
    """Whether the trainers fuse a model's kernels on ``device``: CUDA (the CPU keeps its byte-identical results)."""
    return torch.device(device).type == "cuda"


def fuse_kernels(model: torch.nn.Module | None) -> int:
    """In place: every tanh-GELU activation module of ``model`` becomes ``TanhGELU``, every Llama-style RMSNorm runs
    ``F.rms_norm``, every attention module with Llama's rotary embedding runs ``fused_rotary``. Parameters,
    state-dict keys and saving are unchanged. Returns how many modules changed (0 for None, or for a model with
    none of them)."""
    if model is None:
        return 0
    changed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in _TANH_GELU:
                setattr(parent, name, TanhGELU())
                changed += 1
    for module in model.modules():
        if type(module).__name__ in _LLAMA_RMS_NORM and "forward" not in module.__dict__ \
                and hasattr(module, "variance_epsilon"):
            module.forward = MethodType(_fused_rms_norm, module)
            changed += 1
    changed += _fuse_rotary(model)
    return changed


def _fuse_rotary(model: torch.nn.Module) -> int:
    """Bind ``_with_fused_rotary``'s copy of the class's forward to each rotary attention module (one copy per class
    per call); how many modules changed."""
    copies: dict[type, FunctionType | None] = {}
    changed = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__ not in _ROTARY_ATTENTION or "forward" in module.__dict__:
            continue
        if cls not in copies:
            copies[cls] = _with_fused_rotary(cls.forward) if _standard_rotary(cls.forward) else None
        if copies[cls] is not None:
            module.forward = MethodType(copies[cls], module)
            changed += 1
    return changed
