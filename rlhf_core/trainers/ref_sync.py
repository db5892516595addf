"""TR-DPO's reference update (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment",
arXiv 2404.09656): every ``sync_steps`` optimizer steps the reference becomes ``alpha * policy + (1 - alpha) *
reference``, parameter by parameter (TRL 0.11.4's ``SyncRefModelCallback``; alpha = 1 is the "hard" update).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback


@torch.no_grad()
def mix_into_reference(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """In place: ``ref <- ref * (1 - alpha) + policy * alpha`` for every parameter, matched by name.

    The two models must have the same parameter names and shapes (a copy of one architecture); anything else is
    a ``ValueError`` before any weight changes. TRL 0.11.4's arithmetic (``mul_(1 - alpha).add_(p, alpha=alpha)``).
    """
    ref_params, policy_params = dict(reference.named_parameters()), dict(policy.named_parameters())
    if ref_params.keys() != policy_params.keys():
        only = sorted(ref_params.keys() ^ policy_params.keys())[:3]
        raise ValueError(f"the reference and the policy have different parameters (e.g. {only}): cannot mix them")
    for name, ref_param in ref_params.items():
        if ref_param.shape != policy_params[name].shape:
            raise ValueError(f"parameter {name}: reference {tuple(ref_param.shape)} vs policy "
                             f"{tuple(policy_params[name].shape)}")
    for name, ref_param in ref_params.items():
        ref_param.mul_(1.0 - alpha).add_(policy_params[name].to(ref_param.dtype), alpha=alpha)


class SyncRefModelCallback(TrainerCallback):
    """After every ``sync_steps``-th optimizer step, mix the (unwrapped) policy into ``ref_model`` with ``alpha``."""

    def __init__(self, ref_model: nn.Module, alpha: float, sync_steps: int, accelerator: Any = None) -> None:
        self.ref_model, self.alpha, self.sync_steps, self.accelerator = ref_model, alpha, sync_steps, accelerator

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.sync_steps != 0:
            return
        policy = self.accelerator.unwrap_model(model) if self.accelerator is not None else model
        mix_into_reference(self.ref_model, policy, self.alpha)
