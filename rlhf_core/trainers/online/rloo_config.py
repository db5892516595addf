"""``RLOOConfig``: TRL 1.16.0's RLOO arguments (names, defaults, meanings; CPU deviations documented)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.trainers.online.config import OnlineRLConfig


@dataclass
class RLOOConfig(OnlineRLConfig):
    """REINFORCE Leave-One-Out arguments; see ``OnlineRLConfig`` for the shared sampling fields."""

    num_generations: int | None = field(default=2, metadata={"help": "Completions sampled per prompt."})
    """Completions per prompt (k); each one's baseline is the mean reward of the other k - 1 (TRL 1.16: 2)."""
    beta: float = field(default=0.05, metadata={"help": "KL coefficient (in the reward)."})
    """Weight of the sequence-level KL (sum over tokens of logp - ref_logp at sampling time) subtracted from
    each completion's reward before the leave-one-out baseline (TRL 1.16: 0.05). 0.0 loads no reference model."""
    normalize_advantages: bool = field(default=False, metadata={"help": "Whiten advantages over the batch."})
    """Whiten the leave-one-out advantages over the generation batch (mean 0, std 1)."""
    reward_clip_range: tuple[float, float] | None = field(default=None, metadata={"help": "Clip rewards."})
    """Clip the weighted reward into ``(low, high)`` before the KL penalty; None: no clipping."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.reward_clip_range is not None:
            low, high = self.reward_clip_range
            if low > high:
                raise ValueError(
                    f"reward_clip_range must be (low, high) with low <= high, got {self.reward_clip_range}")
