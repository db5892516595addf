"""PPO's batch statistics over every process of a launch, so that N processes step as one process does on the
same global batch (tests/test_ddp_equivalence.py).

Classic TRL computes two statistics per process: the advantages are whitened with the mean and variance of the
process's own tokens, and each mini-batch loss is a mean over the process's own tokens, which DDP then averages
over processes. With unequal token counts or different advantage spreads on the ranks, that is not the loss of
the global batch (tests/test_ddp_equivalence.py: two processes left a tiny model's weights up to 0.32 away from
where one process took them; 1e-7 with this). Here, under several processes, the whitening uses the mean and
variance of all processes' tokens (two all-reduces per step), and each mini-batch loss is scaled by ``local tokens x processes / global tokens`` (one all-reduce of a count
per mini-batch, no host read), so DDP's average of the scaled losses' gradients is the gradient of the global
token mean. One process does exactly what it did before (none of this runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""Sum of a tensor over every process (``accelerator.reduce(t, "sum")``)."""


def global_masked_whiten(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce,
                         shift_mean: bool = True) -> torch.Tensor:
    """``core.masked_whiten`` with the mean and unbiased variance of the masked positions of every process.

    values, mask: (B, A) on this process. Two passes, as ``masked_var`` does (no sum-of-squares cancellation)."""
    mask = mask.to(values.dtype)
    total, count = reduce(torch.stack([(values * mask).sum(), mask.sum()])).unbind()  # over all processes
    mean = total / count
    squares = reduce(((values - mean) ** 2 * mask).sum())
    # Bessel's correction over the global count; a single value keeps variance 0 (as masked_var does)
    variance = torch.where(count > 1, squares / (count - 1).clamp(min=1), squares / count)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    return whitened + mean if not shift_mean else whitened


def token_share(mask: torch.Tensor, reduce: Reduce, processes: int) -> torch.Tensor:
    """``local tokens x processes / global tokens`` for a mini-batch's response mask (b, A): the factor that turns
    a per-process token mean, averaged over processes by DDP, into the token mean of the global mini-batch."""
    local = mask.sum().to(torch.float32)
    return local * processes / reduce(local.clone()).clamp(min=1)


__all__ = ["global_masked_whiten", "token_share"]
