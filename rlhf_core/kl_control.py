"""KL-coefficient controllers and running score moments (classic TRL semantics)."""

from __future__ import annotations

import numpy as np
import torch


class AdaptiveKLController:
    """Adaptive KL coefficient from Ziegler et al. (2019), section 2.2.

    After each step the coefficient is multiplied by ``1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``:
    it grows while the measured KL is above ``target`` and shrinks while it is below.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        """Move the coefficient towards the value that keeps the KL at ``target``."""
        proportional_error = np.clip(current / self.target - 1, -0.2, 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        """The controller's state, for checkpoints."""
        return {"value": float(self.value), "target": float(self.target), "horizon": float(self.horizon)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the state written by ``state_dict``."""
        self.value, self.target, self.horizon = state["value"], state["target"], state["horizon"]


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current: float, n_steps: int) -> None:
        """A fixed coefficient does not change."""

    def state_dict(self) -> dict[str, float]:
        """The controller's state, for checkpoints."""
        return {"value": float(self.value)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the state written by ``state_dict``."""
        self.value = state["value"]


class RunningMoments:
    """Running mean and standard deviation of every score seen so far (parallel-variance update).

    ``update`` merges a new batch with the running totals and returns the batch's own mean and
    (unbiased) standard deviation. With an accelerator in a distributed run, the batch statistics
    are gathered over all processes first.
    """

    def __init__(self, accelerator=None):
        self.mean = 0.0
        self.std = 1.0
        self.var = 1.0
        self.count = 1e-24
        self.accelerator = accelerator

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Fold ``xs`` into the running moments; return the batch mean and unbiased std."""
        xs_mean, xs_var, xs_count = self._batch_moments(xs)
        delta = xs_mean - self.mean
        total = self.count + xs_count
        # Sum of squared deviations of both parts around the new mean.
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / total
        self.mean = float(self.mean + delta * xs_count / total)
        self.var = float((old_sum + xs_var * xs_count) / total)
        with np.errstate(divide="ignore", invalid="ignore"):  # a first update of one value: Bessel divides by 0
            self.std = float(np.sqrt(np.float64(self.var * total) / np.float64(total - 1)))  # inf there, as TRL
        self.count = float(total)
        batch_std = float(np.sqrt(xs_var * xs_count / (xs_count - 1))) if xs_count > 1 else 0.0
        return float(xs_mean), batch_std

    def _batch_moments(self, xs: torch.Tensor) -> tuple[float, float, int]:
        xs = xs.float()
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            total = self.accelerator.reduce(torch.stack([xs.sum(), torch.tensor(float(xs.numel()), device=xs.device)]))
            mean = total[0] / total[1]
            sq = self.accelerator.reduce(((xs - mean) ** 2).sum())
            return float(mean), float(sq / total[1]), int(total[1])
        var, mean = torch.var_mean(xs, unbiased=False)
        return float(mean), float(var), xs.numel()

    def state_dict(self) -> dict[str, float]:
        """The running totals, for checkpoints."""
        return {"mean": self.mean, "std": self.std, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the totals written by ``state_dict``."""
        self.mean, self.std, self.var, self.count = state["mean"], state["std"], state["var"], state["count"]
