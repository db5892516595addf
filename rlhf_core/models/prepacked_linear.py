"""Linear layers with their weights reordered once for oneDNN, for CPU generation (opt-in).

Why: a decoding step multiplies a few rows (one per sequence) by every weight matrix of the model. torch's
CPU matmul reorders ("packs") the weight into its blocked layout on every call, so at batch 4 the weights of
GPT-2 small pass through the matmul at about a fifth of what a plain read of them reaches (bench/analysis.md
(b)). Inside ``prepacked_linears`` every fp32 ``nn.Linear`` and transformers ``Conv1D`` of the model multiplies
with a copy of its weight packed once, on entry, by oneDNN (``torch.ops.mkldnn``): the same products summed
in another order (differences of ~1e-6 relative in the logits), so sampled tokens can differ where two
candidates are that close. That is why it is an opt-in (``PPOConfig.prepacked_generation``), and why it
costs one packed copy of the weights while the block runs.

Only where gradients are off: a packed weight has no autograd, so a call with gradients enabled runs the
module's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def prepacking_available(model: nn.Module) -> bool:
    """oneDNN is built in and the model's weights are fp32 on the CPU."""
    weight = next(model.parameters(), None)
    return (weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


@contextlib.contextmanager
def prepacked_linears(model: nn.Module, batch_size: int) -> Iterator[int]:
    """Inside the block, the fp32 CPU linear layers of ``model`` multiply with weights packed on entry.

    ``batch_size``: the rows of a decoding step (oneDNN's layout hint; other row counts work too). Yields the
    number of layers switched (0 when ``prepacking_available`` is false). Weights must not change inside the
    block: the packed copies would not follow.
    """
    switched: list[tuple[nn.Module, Any]] = []
    packed: dict[int, torch.Tensor] = {}  # one packed copy per weight tensor (tied heads share it)
    try:
        if prepacking_available(model):
            for module in model.modules():
                weight = _linear_layout_weight(module)
                if weight is None:
                    continue
                key = id(module.weight)
                if key not in packed:
                    packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight, batch_size)
                switched.append((module, module.__dict__.get("forward")))
                module.forward = _packed_forward(module, packed[key])
        yield len(switched)
    finally:
        for module, previous in switched:
            if previous is None:
                del module.forward
            else:
                module.forward = previous


def _linear_layout_weight(module: nn.Module) -> torch.Tensor | None:
    """The (out, in) fp32 CPU weight of an ``nn.Linear`` or a transformers ``Conv1D`` (which stores (in, out))."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    if type(module) is nn.Linear:
        return weight.detach()
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return weight.detach().t().contiguous()
    return None


def _packed_forward(module: nn.Module, packed: torch.Tensor):
    own_forward = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32:
            return own_forward(x)
        bias = module.bias.detach() if module.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward
