"""``PPOConfig``: every field and default of the classic TRL signature, validated up front."""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from rlhf_core.losses import KL_PENALTIES

# The spec's default mini-batch size. When it is left as is and a script asks for a smaller
# ``batch_size`` (the README example uses ``PPOConfig(batch_size=1)``), it is lowered to fit.
DEFAULT_MINI_BATCH_SIZE = 128


def _script_name() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "rlhf_core"
    return name[: -len(".py")] if name.endswith(".py") else name


@dataclass
class PPOConfig:
    """Configuration of ``PPOTrainer`` (classic TRL field names and defaults)."""

    exp_name: str = field(default_factory=_script_name)
    """Name of this experiment (defaults to the running script's name)."""
    seed: int = 0
    """Seed for ``random``, ``numpy`` and ``torch``."""
    log_with: Optional[Literal["wandb", "tensorboard", "mlflow"]] = None
    """Tracker to log to: ``"mlflow"``, ``"tensorboard"`` or ``None`` (a ``Tracker`` object also works)."""
    task_name: Optional[str] = None
    """Name of the task, used for logging."""
    model_name: Optional[str] = "gpt2"
    """Name of the model, used for logging and model cards."""
    query_dataset: Optional[str] = "imdb"
    """Name of the query dataset, used for logging."""
    reward_model: Optional[str] = "sentiment-analysis:lvwerra/distilbert-imdb"
    """Reward model, used for logging."""
    remove_unused_columns: bool = True
    """Drop dataset columns the model does not take (only for ``datasets.Dataset``)."""
    tracker_kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the tracker (e.g. ``run_name`` for MLflow)."""
    accelerator_kwargs: dict = field(default_factory=dict)
    """Keyword arguments for ``accelerate.Accelerator``."""
    project_kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the accelerator's project configuration (e.g. ``logging_dir``)."""
    tracker_project_name: str = "trl"
    """Project (MLflow experiment / TensorBoard folder) name for the tracker."""
    push_to_hub_if_best_kwargs: dict = field(default_factory=dict)
    """Kept for compatibility: pushing to a hub is never done automatically here."""
    steps: int = 20000
    """Number of training samples planned (used to derive ``total_ppo_epochs``)."""
    learning_rate: float = 1.41e-5
    """Learning rate of the default Adam optimizer."""
    adap_kl_ctrl: bool = True
    """Use the adaptive KL controller (else a fixed coefficient)."""
    init_kl_coef: Optional[float] = 0.2
    """Initial KL penalty coefficient."""
    kl_penalty: Literal["kl", "abs", "mse", "full"] = "kl"
    """Per-token KL estimate: ``kl`` (logp - ref), ``abs``, ``mse`` (half square) or ``full`` (exact KL)."""
    target: Optional[float] = 6
    """Target KL for the adaptive controller."""
    horizon: Optional[float] = 10000
    """Horizon of the adaptive controller."""
    gamma: float = 1
    """Discount factor of GAE."""
    lam: float = 0.95
    """Lambda of GAE."""
    cliprange: float = 0.2
    """Clip range of the policy ratio."""
    cliprange_value: float = 0.2
    """Clip range of the value prediction around the old value."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    batch_size: int = 128
    """Number of samples per ``step`` (per process)."""
    forward_batch_size: Optional[int] = None
    """Deprecated alias of ``mini_batch_size``."""
    mini_batch_size: int = DEFAULT_MINI_BATCH_SIZE
    """Samples per forward/backward pass; also the chunk size of the no-grad forward passes."""
    gradient_accumulation_steps: int = 1
    """Mini-batches accumulated before each optimizer step."""
    world_size: Optional[int] = None
    """Number of processes (derived from the launcher's environment)."""
    ppo_epochs: int = 4
    """Optimisation epochs over each batch."""
    max_grad_norm: Optional[float] = None
    """Clip the global gradient norm to this value (``None``: no clipping)."""
    optimize_cuda_cache: Optional[bool] = None
    """Deprecated alias of ``optimize_device_cache``."""
    optimize_device_cache: Optional[bool] = False
    """Free the accelerator's memory cache between the phases of a step."""
    early_stopping: bool = False
    """Stop the epochs of a step early when the policy KL exceeds ``1.5 * target_kl``."""
    target_kl: float = 1
    """KL threshold for early stopping."""
    compare_steps: int = 1
    """Compare the current reward with the best every ``compare_steps`` steps (hub pushing only)."""
    ratio_threshold: float = 10.0
    """Skip the mini-batch (zero loss) when the mean probability ratio exceeds this value."""
    use_score_scaling: bool = False
    """Divide scores by their running standard deviation."""
    use_score_norm: bool = False
    """With score scaling, also subtract the running mean."""
    score_clip: Optional[float] = None
    """Clip scores to ``[-score_clip, score_clip]`` after scaling."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (without shifting the mean) before GAE."""
    max_nonfinite_updates: int = 3
    """Stop with an error after this many updates in a row skipped for a non-finite loss or gradient."""
    gradient_checkpointing: bool = False
    """Enable gradient checkpointing on the policy."""
    torch_compile: bool = False
    """Opt-in: run the policy's and reference's transformer under ``torch.compile`` (inductor, dynamic shapes).

    Fewer operator launches per forward and backward, which can pay only where a step is overhead-bound (small
    models); on the bench's tiny model on CPU four runs measured step times of -10%, -1%, +16% and -25% against
    eager, so no reliable gain there. Not exact: fused kernels sum in another order (bench/analysis.md "(a)
    step" gives the measured error after one step and the speed). The first steps compile (minutes on CPU; a
    C++ compiler is needed).
    """
    prepacked_generation: bool = False
    """Opt-in: ``generate`` on a list of queries, on the CPU, multiplies with weights packed once per call for oneDNN.

    Decoding multiplies a few rows by every weight matrix per token, and the default CPU matmul repacks each
    weight on every call; packed once, a GPT-2-small decoding step at batch 4 runs faster (bench/analysis.md
    (b)). Not exact: the products are summed in another order (~1e-6 relative in the logits), so a sampled
    token can differ where two candidates are that close; it holds a packed copy of the weights meanwhile.
    """
    bf16_weights: Optional[bool] = None
    """Hold the policy and the reference in bf16; the optimizer updates fp32 master copies of the trainable weights.

    Instead of autocast's per-forward casts of fp32 weights: every matmul reads bf16 weights as stored, and the
    gradients are added into fp32 master gradients after each backward, then clipped, stepped and rounded back
    (``rlhf_core.trainers.master_weights``). Not exact against fp32 (bf16 arithmetic, 8 bits of mantissa).
    ``save_state`` checkpoints the masters; ``save_pretrained`` writes the bf16 weights. Not with fp16 mixed
    precision, DeepSpeed or FSDP (they keep their own master weights). ``None`` (the default): True when the
    trainer's device is a CUDA GPU with bf16 support, the trainable weights are fp32, the optimizer is fresh and
    none of those three is in use; False otherwise (every CPU run: its results do not change). The trainer writes
    the value it chose back here (so it is logged and in the model card). ``False`` keeps fp32 on a GPU.
    """
    dataset_num_proc: Optional[int] = None
    """Processes a script uses to map its dataset (TRL 0.11's field; the trainer itself reads no dataset with it)."""
    is_encoder_decoder: Optional[bool] = None
    """Set by the trainer from the model: whether the policy is an encoder-decoder."""
    is_peft_model: Optional[bool] = None
    """Set by the trainer from the model: whether the policy is a PEFT model."""
    backward_batch_size: Optional[int] = None
    """Derived: ``mini_batch_size * gradient_accumulation_steps`` (samples per optimizer step)."""
    global_backward_batch_size: Optional[int] = None
    """Derived: ``backward_batch_size * world_size``."""
    global_batch_size: Optional[int] = None
    """Derived: ``batch_size * world_size``."""
    total_ppo_epochs: Optional[int] = None
    """Derived: ``ceil(steps / batch_size)``, the number of ``step`` calls the plan implies."""

    def __post_init__(self) -> None:
        self._resolve_deprecated()
        self._check_positive()
        self._fit_mini_batch_to_batch()
        self._check_batch_division()
        self._check_kl()
        self._check_scores()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if self.world_size is None else self.world_size
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        self.global_backward_batch_size = self.backward_batch_size * self.world_size
        self.global_batch_size = self.batch_size * self.world_size
        self.total_ppo_epochs = int(math.ceil(self.steps / self.batch_size))

    def _resolve_deprecated(self) -> None:
        if self.forward_batch_size is not None:
            warnings.warn("`forward_batch_size` is deprecated; use `mini_batch_size`.", FutureWarning, stacklevel=3)
            self.mini_batch_size = self.forward_batch_size
        if self.optimize_cuda_cache is not None:
            warnings.warn("`optimize_cuda_cache` is deprecated; use `optimize_device_cache`.", FutureWarning, stacklevel=3)
            self.optimize_device_cache = self.optimize_cuda_cache

    def _check_positive(self) -> None:
        for name in ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "steps",
                     "max_nonfinite_updates"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PPOConfig.{name} must be a positive integer, got {value!r}")
        for name in ("cliprange", "cliprange_value", "ratio_threshold", "target_kl"):
            if not getattr(self, name) > 0:
                raise ValueError(f"PPOConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.vf_coef < 0:
            raise ValueError(f"PPOConfig.vf_coef must be >= 0, got {self.vf_coef!r}")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ValueError(f"PPOConfig.gamma and PPOConfig.lam must be in [0, 1], got {self.gamma!r} and {self.lam!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"PPOConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")

    def _fit_mini_batch_to_batch(self) -> None:
        # The spec's README builds PPOConfig(batch_size=1) while the newest default mini_batch_size is 128.
        # A user who never chose a mini-batch size expects that to work: use one mini-batch per batch.
        too_big = self.mini_batch_size * self.gradient_accumulation_steps > self.batch_size
        if self.mini_batch_size == DEFAULT_MINI_BATCH_SIZE and self.forward_batch_size is None and too_big:
            if self.batch_size % self.gradient_accumulation_steps == 0:
                self.mini_batch_size = self.batch_size // self.gradient_accumulation_steps
                warnings.warn(
                    f"PPOConfig: mini_batch_size left at its default ({DEFAULT_MINI_BATCH_SIZE}) exceeds "
                    f"batch_size={self.batch_size}; using mini_batch_size={self.mini_batch_size}.",
                    stacklevel=4,
                )

    def _check_batch_division(self) -> None:
        backward = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % backward != 0:
            raise ValueError(
                f"PPOConfig.batch_size ({self.batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size}) x gradient_accumulation_steps ({self.gradient_accumulation_steps}) "
                f"= {backward}"
            )

    def _check_kl(self) -> None:
        if self.kl_penalty not in KL_PENALTIES:
            raise ValueError(f"PPOConfig.kl_penalty must be one of {KL_PENALTIES}, got {self.kl_penalty!r}")
        if self.init_kl_coef is None or self.init_kl_coef < 0:
            raise ValueError(f"PPOConfig.init_kl_coef must be a number >= 0, got {self.init_kl_coef!r}")
        if self.adap_kl_ctrl:
            for name in ("target", "horizon"):
                value = getattr(self, name)
                if value is None or not value > 0:
                    raise ValueError(f"PPOConfig.{name} must be > 0 when adap_kl_ctrl=True, got {value!r}")

    def _check_scores(self) -> None:
        if self.score_clip is not None and not self.score_clip > 0:
            raise ValueError(f"PPOConfig.score_clip must be > 0 or None, got {self.score_clip!r}")
        if self.use_score_norm and not self.use_score_scaling:
            warnings.warn("PPOConfig.use_score_norm only acts together with use_score_scaling=True.", stacklevel=4)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (for logging and model cards)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
