"""Frozen reference models for the KL penalty, optionally sharing their first layers with the policy.

``create_reference_model(model, num_shared_layers=N)`` shares the parameters that come before layer ``N``
(embeddings and layers ``0..N-1``): they are the very same tensor objects in policy and reference, frozen in
both, so they cost no extra memory and the two models agree on them by construction. Everything from layer
``N`` on (later layers, final norm, untied LM head, value head) is an independent frozen copy.
A PEFT policy needs no copy at all: its reference is the same model with the adapter disabled.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

# Where the transformer blocks live, per architecture family; ``{layer}`` is the block index.
LAYER_PATTERNS = (
    "transformer.h.{layer}",  # gpt2, gpt-j, bloom, falcon
    "model.decoder.layers.{layer}",  # opt
    "gpt_neox.layers.{layer}",  # pythia / gpt-neox
    "model.layers.{layer}",  # llama, mistral, qwen, gemma
    "encoder.block.{layer}",  # t5 (encoder blocks come first in parameter order)
)


def _name_has(name: str, key: str) -> bool:
    """True if dotted parameter ``name`` contains the dotted path ``key`` as whole components."""
    return f".{key}." in f".{name}."  # "transformer.h.1" must not match "transformer.h.10"


def _layer_template(names: Sequence[str], pattern: str | None) -> str:
    """The layer pattern (with ``{layer}``) that this model's parameter names follow."""
    if pattern is not None:
        if "{layer}" not in pattern:
            raise ValueError(f"pattern must contain '{{layer}}', got {pattern!r}")
        if not any(_name_has(n, pattern.format(layer=0)) for n in names):
            raise ValueError(f"pattern {pattern!r} matches no parameter of the model")
        return pattern
    for candidate in LAYER_PATTERNS:
        if any(_name_has(n, candidate.format(layer=0)) for n in names):
            return candidate
    raise ValueError(f"unknown architecture: no parameter matches {LAYER_PATTERNS}; pass pattern=")


def _count_layers(names: Sequence[str], template: str) -> int:
    """Number of consecutive layers 0, 1, ... whose names match ``template``."""
    count = 0
    while any(_name_has(n, template.format(layer=count)) for n in names):
        count += 1
    return count


def shared_parameters(model: nn.Module, num_shared_layers: int, pattern: str | None = None) -> list[nn.Parameter]:
    """Parameters registered before layer ``num_shared_layers`` (embeddings + layers 0..N-1), in order."""
    named = list(model.named_parameters())
    names = [name for name, _ in named]
    template = _layer_template(names, pattern)
    num_layers = _count_layers(names, template)
    if not 0 <= num_shared_layers < num_layers:
        raise ValueError(
            f"num_shared_layers must be in [0, {num_layers}) for this model ({num_layers} layers matching "
            f"{template!r}), got {num_shared_layers}"
        )
    cut = template.format(layer=num_shared_layers)
    first_unshared = next(i for i, name in enumerate(names) if _name_has(name, cut))
    return [param for _, param in named[:first_unshared]]


def _is_peft(model: nn.Module) -> bool:
    """True for a PeftModel, a wrapper around one, or a transformers model with loaded adapters."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        PeftModel = ()  # noqa: N806
    return (
        isinstance(model, PeftModel)
        or bool(getattr(model, "is_peft_model", False))
        or bool(getattr(model, "_hf_peft_config_loaded", False))
    )


def create_reference_model(
    model: nn.Module, num_shared_layers: int | None = None, pattern: str | None = None
) -> nn.Module:
    """A frozen eval-mode copy of ``model``; with ``num_shared_layers`` its first layers are shared, not copied."""
    if _is_peft(model):
        raise ValueError(
            "create_reference_model does not copy PEFT models: the reference of a PEFT policy is the same model "
            "with its adapter disabled (model.disable_adapter()), which needs no extra memory"
        )
    if num_shared_layers is None and pattern is not None:
        raise ValueError("pattern is only used together with num_shared_layers")
    shared = [] if num_shared_layers is None else shared_parameters(model, num_shared_layers, pattern)
    for param in shared:
        param.requires_grad_(False)  # frozen in the policy too: a shared tensor must not drift
    # deepcopy returns memo entries as they are, so shared parameters stay the same objects.
    reference = copy.deepcopy(model, memo={id(p): p for p in shared})
    shared_ids = {id(p) for p in shared}
    for param in reference.parameters():
        param.requires_grad_(False)
        if id(param) not in shared_ids:
            param.grad = None  # a copied policy gradient means nothing for the reference
    return reference.eval()
