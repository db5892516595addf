"""What the trainers' forward passes share: which model runs as the reference, and dropout off for a block.

``reference_model`` is the one place that knows the two kinds of reference (PPO, DPO, KTO, GRPO and RLOO all
use it): a PEFT policy is its own reference with the adapter disabled (no second copy in memory), anything else
has a separate frozen model. ``dropout_off`` runs a block in eval mode and puts the previous mode back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


@contextlib.contextmanager
def reference_model(accelerator: Any, policy: torch.nn.Module, ref_model: torch.nn.Module | None,
                    adapter_off: bool) -> Iterator[torch.nn.Module]:
    """Yield the model to run as the reference inside the block.

    ``adapter_off``: the reference is ``policy`` (a PEFT model, possibly wrapped by ``accelerator``) with its
    adapter disabled until the block ends; ``policy`` is yielded. Otherwise ``ref_model``, a separate model, is
    yielded as it is (nothing to switch).
    """
    if not adapter_off:
        yield ref_model
        return
    with accelerator.unwrap_model(policy).disable_adapter():
        yield policy


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """``model.eval()`` for the block when ``enabled`` (no dropout; gradients still flow), then the previous
    mode back (also when the block raises)."""
    was_training = model.training
    if enabled:
        model.eval()
    try:
        yield
    finally:
        model.train(was_training)
