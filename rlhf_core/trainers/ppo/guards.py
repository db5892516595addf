"""The PPO step's numerical guards, decided on the device and read on the host once per step.

Two guards act on every mini-batch update: ``ratio_threshold`` zeroes the loss of a mini-batch whose mean
probability ratio is too high, and a non-finite loss or gradient norm skips the optimizer step (weights and
optimizer state as if it never ran); ``max_nonfinite_updates`` skips in a row stop the run. Reading either value
on the host inside the loop over mini-batches would make the host wait for every queued kernel, once per
mini-batch. Here both are tensors: the ratio guard multiplies the loss by 0 or 1, the skip is handed to the
optimizer as its ``found_inf`` (torch's fused Adam/AdamW skip a step whose flag is set, on the device, as they
do for mixed-precision loss scaling), and ``finish_step`` reads every flag of the step at once, then warns,
counts and raises as each update would have.

An optimizer without that support (a user's, non-fused one), or fp16 loss scaling (whose scaler sets the flag
itself), reads the skip flag on the host once per optimizer step instead. With gradient accumulation a skip
drops the whole accumulated optimizer step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch


@dataclass
class _Update:
    """One optimizer step's flags, on the device."""

    loss: torch.Tensor
    """() the first non-finite loss accumulated into the step, else the last one (detached)."""
    grad_norm: torch.Tensor | None
    """() the gradient norm (None where the engine measures none)."""
    skipped: torch.Tensor
    """() bool: this optimizer step was skipped."""


class UpdateGuard:
    """Collects a step's guard flags; ``finish_step`` reads them once and acts (warn, count, stop)."""

    def __init__(self, max_in_a_row: int, ratio_threshold: float):
        self.max_in_a_row = max_in_a_row
        self.ratio_threshold = ratio_threshold
        self.in_a_row = 0
        """Skipped updates in a row so far (over steps: part of ``save_state``)."""
        self._updates: list[_Update] = []
        self._ratio_means: list[torch.Tensor] = []
        self._window_loss: torch.Tensor | None = None  # the first non-finite loss since the last optimizer step

    def ratio_keep(self, ratio_mean: torch.Tensor) -> torch.Tensor:
        """() 0.0 when the mini-batch's mean ratio exceeds ``ratio_threshold`` (its loss is then zeroed), else 1.0."""
        self._ratio_means.append(ratio_mean.detach())
        return (~(ratio_mean > self.ratio_threshold)).to(ratio_mean.dtype)

    def observe_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """() bool: ``loss`` is not finite. Kept (the first non-finite one) until the next optimizer step."""
        loss = loss.detach()
        if self._window_loss is not None:
            loss = torch.where(torch.isfinite(self._window_loss), loss, self._window_loss)
        self._window_loss = loss
        return ~torch.isfinite(loss)

    def at_optimizer_step(self, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
        """() bool: skip this optimizer step (a loss since the last one, or ``grad_norm``, is not finite)."""
        loss, self._window_loss = self._window_loss, None
        norm = None if grad_norm is None else torch.as_tensor(grad_norm, device=loss.device)
        skip = ~torch.isfinite(loss) if norm is None else ~torch.isfinite(loss) | ~torch.isfinite(norm)
        self._updates.append(_Update(loss=loss, grad_norm=norm, skipped=skip))
        return skip

    @staticmethod
    def step_optimizer(optimizer: torch.optim.Optimizer, skip: torch.Tensor, scaler=None) -> None:
        """``optimizer.step()`` unless ``skip``: on the device where the optimizer supports it, else one host read.

        ``optimizer`` may be accelerate's wrapper (its ``optimizer`` attribute is torch's)."""
        inner = getattr(optimizer, "optimizer", optimizer)
        if getattr(inner, "_step_supports_amp_scaling", False) and scaler is None:
            inner.found_inf = skip.to(torch.float32)  # fused Adam/AdamW: skip the update, restore the step count
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        elif not bool(skip):
            optimizer.step()

    def finish_step(self) -> int:
        """Read the step's flags (one device read); warn about each skipped or zeroed update, in order; raise
        after ``max_in_a_row`` skips in a row. Returns the number of skipped updates of the step."""
        updates, ratios = self._updates, self._ratio_means
        self._updates, self._ratio_means, self._window_loss = [], [], None
        for ratio in torch.stack(ratios).tolist() if ratios else []:
            if ratio > self.ratio_threshold:
                warnings.warn(f"The average ratio of the batch ({ratio:.2f}) exceeds ratio_threshold "
                              f"({self.ratio_threshold:.2f}); skipping this mini-batch (loss set to 0).", stacklevel=3)
        if not updates:
            return 0
        nan = torch.full((), float("nan"), device=updates[0].loss.device)
        rows = torch.stack([torch.stack([u.loss.float(), (u.grad_norm if u.grad_norm is not None else nan).float(),
                                         u.skipped.float()]) for u in updates]).tolist()  # (U, 3) on the host
        skipped = 0
        for loss, grad_norm, was_skipped in rows:
            if not was_skipped:
                self.in_a_row = 0
                continue
            skipped += 1
            self.in_a_row += 1
            reason = (f"non-finite loss ({loss})" if not _finite(loss) else
                      f"non-finite gradient norm ({grad_norm})")
            warnings.warn(f"PPO update skipped: {reason}", stacklevel=3)
            if self.in_a_row >= self.max_in_a_row:
                raise RuntimeError(
                    f"{self.in_a_row} PPO updates in a row were skipped ({reason}); stopping. Check the scores, the "
                    "learning rate and the model's numerics (max_nonfinite_updates sets this limit).")
        return skipped


def _finite(value: float) -> bool:
    return value == value and abs(value) != float("inf")
