"""``DDPOConfig``: every field and default of the classic TRL signature, validated up front."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16")


def _script_name() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "ddpo"
    return name[: -len(".py")] if name.endswith(".py") else name


@dataclass
class DDPOConfig:
    """Configuration of ``DDPOTrainer`` (classic TRL field names and defaults).

    One DDPO epoch samples ``sample_num_batches_per_epoch * sample_batch_size`` images, scores them, and
    then runs ``train_num_inner_epochs`` passes of clipped PPO updates over those trajectories.
    """

    # ---- run, logging and checkpoints -----------------------------------------------------
    exp_name: str = field(default_factory=_script_name)
    """Name of this experiment (defaults to the running script's name)."""
    run_name: Optional[str] = ""
    """Run name for the tracker and the checkpoint folder (``exp_name`` plus a timestamp when empty)."""
    seed: Optional[int] = 42
    """Seed for ``random``, ``numpy``, ``torch`` and the trainer's sampling generator."""
    logdir: Optional[str] = "logs"
    """Top-level directory for checkpoints: ``{logdir}/{run_name}/checkpoints/checkpoint_{epoch}``."""
    log_with: Optional[str] = None
    """Tracker to log to: ``"mlflow"``, ``"tensorboard"``, ``"memory"`` or ``None`` (a ``Tracker`` object also works)."""
    tracker_kwargs: Optional[dict] = field(default_factory=dict)
    """Keyword arguments for the tracker (e.g. ``run_name`` for MLflow)."""
    accelerator_kwargs: Optional[dict] = field(default_factory=dict)
    """Kept for classic scripts: this single-process trainer reads only ``cpu`` (True forces the CPU)."""
    project_kwargs: Optional[dict] = field(default_factory=dict)
    """Kept for classic scripts: ``project_dir`` (replaces ``logdir``) is the only key read."""
    tracker_project_name: Optional[str] = "trl"
    """Project (MLflow experiment / TensorBoard folder) name for the tracker."""
    num_epochs: Optional[int] = 100
    """Number of DDPO epochs ``train()`` runs when called without ``epochs``."""
    save_freq: Optional[int] = 1
    """Save a checkpoint after every ``save_freq`` epochs."""
    num_checkpoint_limit: Optional[int] = 5
    """Keep at most this many checkpoints (oldest removed first); ``None`` keeps all."""
    mixed_precision: Optional[str] = "fp16"
    """``"no"`` (or None), ``"fp16"`` or ``"bf16"`` autocast for the UNet; fp16 needs CUDA and falls back to fp32 on CPU."""
    allow_tf32: Optional[bool] = True
    """Allow TF32 matmuls on Ampere GPUs (no effect on CPU)."""
    resume_from: Optional[str] = ""
    """Checkpoint folder to resume from (or a ``checkpoints`` folder, whose newest checkpoint is used)."""

    # ---- sampling -----------------------------------------------------------------------------
    sample_num_steps: Optional[int] = 50
    """Number of DDIM denoising steps per image."""
    sample_eta: Optional[float] = 1.0
    """DDIM eta in (0, 1]: the noise of each step, which makes the sampler a stochastic policy."""
    sample_guidance_scale: Optional[float] = 5.0
    """Classifier-free guidance scale while sampling (1.0 turns guidance off)."""
    sample_batch_size: Optional[int] = 1
    """Images generated per sampling batch."""
    sample_num_batches_per_epoch: Optional[int] = 2
    """Sampling batches per epoch."""

    # ---- training -----------------------------------------------------------------------------
    train_batch_size: Optional[int] = 1
    """Trajectories per training batch."""
    train_use_8bit_adam: Optional[bool] = False
    """Use bitsandbytes' 8-bit AdamW (needs the ``bitsandbytes`` package)."""
    train_learning_rate: Optional[float] = 3e-4
    """Learning rate of AdamW."""
    train_adam_beta1: Optional[float] = 0.9
    """AdamW beta1."""
    train_adam_beta2: Optional[float] = 0.999
    """AdamW beta2."""
    train_adam_weight_decay: Optional[float] = 1e-4
    """AdamW weight decay."""
    train_adam_epsilon: Optional[float] = 1e-8
    """AdamW epsilon."""
    train_gradient_accumulation_steps: Optional[int] = 1
    """Training batches whose gradients are accumulated (over all trained timesteps) per optimizer step."""
    train_max_grad_norm: Optional[float] = 1.0
    """Clip the gradient's global norm to this before each optimizer step."""
    train_num_inner_epochs: Optional[int] = 1
    """Passes of PPO updates over each epoch's samples."""
    train_cfg: Optional[bool] = True
    """Use classifier-free guidance (with ``sample_guidance_scale``) when recomputing log-probs in training."""
    train_adv_clip_max: Optional[float] = 5
    """Clip advantages to ``[-train_adv_clip_max, train_adv_clip_max]``."""
    train_clip_range: Optional[float] = 1e-4
    """PPO clip range of the probability ratio."""
    train_timestep_fraction: Optional[float] = 1.0
    """Fraction of each trajectory's timesteps (chosen at random) trained on."""

    # ---- rewards ------------------------------------------------------------------------------
    per_prompt_stat_tracking: Optional[bool] = False
    """Normalise rewards per prompt (a buffer of recent rewards per prompt) instead of over the batch."""
    per_prompt_stat_tracking_buffer_size: Optional[int] = 16
    """Rewards kept per prompt by the stat tracker."""
    per_prompt_stat_tracking_min_count: Optional[int] = 16
    """Rewards a prompt needs before its own statistics replace the batch's."""
    async_reward_computation: Optional[bool] = False
    """Compute rewards in a thread pool while the next batch is sampled."""
    max_workers: Optional[int] = 2
    """Threads of the reward thread pool."""
    negative_prompts: Optional[str] = ""
    """Negative prompt used as the unconditional branch of classifier-free guidance."""

    def __post_init__(self) -> None:
        self._check_positive_ints()
        self._check_ranges()
        self._check_batching()
        if self.train_use_8bit_adam and importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                "train_use_8bit_adam=True needs the bitsandbytes package (pip install bitsandbytes); "
                "set train_use_8bit_adam=False to use torch's AdamW"
            )

    def _check_positive_ints(self) -> None:
        names = (
            "num_epochs", "save_freq", "sample_num_steps", "sample_batch_size", "sample_num_batches_per_epoch",
            "train_batch_size", "train_gradient_accumulation_steps", "train_num_inner_epochs",
            "per_prompt_stat_tracking_buffer_size", "per_prompt_stat_tracking_min_count", "max_workers",
        )
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_checkpoint_limit is not None and self.num_checkpoint_limit < 1:
            raise ValueError(f"num_checkpoint_limit must be >= 1 or None, got {self.num_checkpoint_limit}")

    def _check_ranges(self) -> None:
        if self.mixed_precision is None:  # TRL 0.11 scripts and tests pass None for "no autocast"
            self.mixed_precision = "no"
        if self.mixed_precision not in MIXED_PRECISION_CHOICES:
            raise ValueError(f"mixed_precision must be one of {MIXED_PRECISION_CHOICES}, got {self.mixed_precision!r}")
        if not 0 < self.sample_eta <= 1:
            raise ValueError(f"sample_eta must be in (0, 1] (DDPO needs a stochastic sampler), got {self.sample_eta}")
        if self.sample_guidance_scale < 1:
            raise ValueError(f"sample_guidance_scale must be >= 1, got {self.sample_guidance_scale}")
        if not 0 < self.train_timestep_fraction <= 1:
            raise ValueError(f"train_timestep_fraction must be in (0, 1], got {self.train_timestep_fraction}")
        positive = ("train_learning_rate", "train_adam_epsilon", "train_max_grad_norm", "train_clip_range",
                    "train_adv_clip_max")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("train_adam_beta1", "train_adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.train_adam_weight_decay < 0:
            raise ValueError(f"train_adam_weight_decay must be >= 0, got {self.train_adam_weight_decay}")
        if self.per_prompt_stat_tracking_min_count > self.per_prompt_stat_tracking_buffer_size:
            raise ValueError(
                "per_prompt_stat_tracking_min_count must be <= per_prompt_stat_tracking_buffer_size "
                f"({self.per_prompt_stat_tracking_min_count} > {self.per_prompt_stat_tracking_buffer_size}): "
                "a buffer that small never reaches the count"
            )

    def _check_batching(self) -> None:
        total = self.sample_batch_size * self.sample_num_batches_per_epoch
        if total % self.train_batch_size:
            raise ValueError(
                f"train_batch_size ({self.train_batch_size}) must divide the samples per epoch "
                f"(sample_batch_size * sample_num_batches_per_epoch = {total})"
            )
        if (total // self.train_batch_size) % self.train_gradient_accumulation_steps:
            raise ValueError(
                f"train_gradient_accumulation_steps ({self.train_gradient_accumulation_steps}) must divide the "
                f"training batches per epoch ({total // self.train_batch_size})"
            )

    @property
    def num_train_timesteps(self) -> int:
        """Timesteps of each trajectory trained on: ``int(sample_num_steps * train_timestep_fraction)``, >= 1."""
        return max(1, int(self.sample_num_steps * self.train_timestep_fraction))

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for ``log_params``)."""
        return asdict(self)
