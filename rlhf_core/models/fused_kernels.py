"""One kernel where transformers' eager code launches several: GPT-2's tanh GELU and Llama-style RMSNorm.

GPT-2's ``gelu_new`` (``NewGELUActivation``; ``gelu_fast`` the same) is written as eight elementwise operations:
eight kernel launches, eight reads and writes of the (B, T, 4H) activation, in the forward and again in the
backward (the first GPU profile: ~40% of a layer's training time, ~7 of ~23 kernels per decode layer).
``torch.nn.functional.gelu(x, approximate="tanh")`` is the same function in one kernel. Llama / Qwen2 / Mistral's
``RMSNorm`` is five operations around a float32 upcast; ``torch.nn.functional.rms_norm`` on the upcast input is the
same computation in one kernel where the backend has one.

Both agree with the eager code to rounding, not bit for bit (another evaluation order), so ``fuse_kernels`` runs
only where asked: the trainers call it for a model on a CUDA device (``fuses_on``); on the CPU the eager modules stay
and results are byte-identical. ``tests/test_fused_kernels.py`` forces the swap on the CPU and compares.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F

# transformers' activation modules that compute the tanh approximation of GELU
_TANH_GELU = {"NewGELUActivation", "FastGELUActivation"}
# RMSNorm classes whose forward is exactly: upcast to fp32, x * rsqrt(mean(x^2) + eps), cast back, times weight
_LLAMA_RMS_NORM = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm"}


class TanhGELU(torch.nn.Module):
    """GELU with the tanh approximation in one kernel (``NewGELUActivation``'s function)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def _fused_rms_norm(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The Llama-style RMSNorm forward with ``F.rms_norm`` doing the normalisation (in fp32, as the eager one)."""
    normed = F.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(hidden_states.dtype)


def fuses_on(device: torch.device | str) -> bool:
    """Whether the trainers fuse a model's kernels on ``device``: CUDA (the CPU keeps its byte-identical results)."""
    return torch.device(device).type == "cuda"


def fuse_kernels(model: torch.nn.Module | None) -> int:
    """In place: every tanh-GELU activation module of ``model`` becomes ``TanhGELU``, every Llama-style RMSNorm runs
    ``F.rms_norm``. Parameters, state-dict keys and saving are unchanged. Returns how many modules changed (0 for
    None, or for a model with neither)."""
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
    return changed
