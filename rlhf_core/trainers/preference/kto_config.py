"""KTOConfig: TRL 1.16.0's ``KTOConfig`` fields (names, defaults, meanings) on ``transformers.TrainingArguments``.

A TRL 1.16 script that builds ``KTOConfig(...)`` runs unchanged. Three defaults differ from TRL's because
TRL's assume a GPU (each is said in the field's docstring): ``bf16`` (only on a GPU), ``gradient_checkpointing`` (off)
and ``learning_rate`` (5e-5 instead of 1e-6, which barely moves a small model in the few hundred CPU steps
this project trains for). Options that need hardware or code paths this project does not have
(``activation_offloading``, ``sync_ref_model``, a non-zero ``router_aux_loss_coef``) are accepted as fields and
rejected with a clear error when switched on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from rlhf_core.losses import KTO_LOSS_TYPES
from rlhf_core.trainers.base import map_warmup_ratio, resolve_bf16


@dataclass
class KTOConfig(TrainingArguments):
    """Arguments of :class:`~rlhf_core.trainers.preference.kto.KTOTrainer`: TrainingArguments plus KTO's own fields."""

    # ---- TrainingArguments defaults that TRL 1.16 overrides ----------------------------------------
    learning_rate: float = field(default=5e-5, metadata={"help": "Initial AdamW learning rate."})
    """Initial AdamW learning rate. TRL 1.16: 1e-6 (tuned for billion-parameter models on GPUs); here 5e-5,
    transformers' own default, which trains the small CPU models of this project in a few hundred steps."""
    logging_steps: float = field(default=10, metadata={"help": "Log every X update steps (TRL default 10)."})
    """Log every X update steps (or this fraction of the run if < 1); TRL's default 10."""
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "Recompute activations in backward."})
    """Recompute activations in the backward pass to save memory. TRL 1.16: True (a GPU-memory default); here
    None, which is off: on a CPU with small models it only costs time. (None, not False: transformers 5 warns
    that any explicit value of this deprecated alias of ``activation_checkpointing`` is deprecated.)"""
    bf16: bool | None = field(default=None, metadata={"help": "bfloat16 mixed precision; None: only where useful."})
    """bfloat16 mixed precision (autocast; fp32 weights). TRL 1.16: True unless fp16 is set (assumes an Ampere GPU);
    here None: True on a CUDA GPU with bf16 support, fp32 elsewhere (``base.resolve_bf16``: a CPU run is unchanged)."""
    train_sampling_strategy: str = field(
        default="sequential",
        metadata={"help": "Training sampler; KTO's KL term needs 'sequential'.",
                  "choices": ["random", "sequential", "group_by_length", "batch_rebalance"]},
    )
    """Training sampler. ``sequential`` (TRL's default) is required by every loss with a KL term: each row's KL
    completion is precomputed from its neighbour in a fixed-order batch, which another order would break."""

    # ---- the model ---------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={"help": "from_pretrained kwargs."})
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` when ``model`` is a name or path (also used
    for a reference model loaded the same way). Ignored, with a warning, for an instantiated model."""
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models/tokenizers with custom code."})
    """Allow loading models and tokenizers that ship their own Python code (off: never run downloaded code)."""
    warmup_ratio: float | None = field(default=None, metadata={
        "help": "transformers 4's warmup share (TRL 0.11's kto.py passes it): mapped to warmup_steps, with a warning."})
    """transformers 4's option, gone from transformers 5: TRL 0.11's kto.py command line passes it through
    ``HfArgumentParser``, which only knows fields. Copied into ``warmup_steps`` (below 1: a share) with a warning."""
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "MoE load-balancing loss weight."})
    """Weight of a Mixture-of-Experts load-balancing loss. Only None or 0.0 are supported here (no MoE models)."""
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model and reference."})
    """Set every dropout probability of the policy and the reference to 0, so log-probs are deterministic."""

    # ---- data preprocessing ------------------------------------------------------------------------
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for dataset preprocessing."})
    """Number of processes ``datasets.map`` uses to tokenise (None: in this process)."""
    max_length: int | None = field(default=1024, metadata={"help": "Max tokens of prompt + completion."})
    """Maximum tokens of prompt + completion; longer sequences are cut on the right, rows whose prompt alone
    reaches it are dropped. None: no truncation."""
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": "Pad batches to a multiple."})
    """Pad each batch's length to a multiple of this. ``auto``: 128 on AWS Neuron devices, no padding elsewhere
    (so None on this project's CPUs and GPUs)."""
    precompute_ref_log_probs: bool = field(default=False, metadata={"help": "Precompute reference log-probs."})
    """Compute the reference log-probs of every row once before training; no reference model is then kept (the
    policy itself, before its first step, is the reference unless ``ref_model`` is given)."""
    precompute_ref_batch_size: int | None = field(default=None, metadata={"help": "Batch size for precomputing."})
    """Batch size of that precomputation (None: ``per_device_train_batch_size``, or the eval batch size for eval)."""

    # ---- training ----------------------------------------------------------------------------------
    loss_type: str = field(
        default="kto", metadata={"help": "kto or apo_zero_unpaired.", "choices": list(KTO_LOSS_TYPES)}
    )
    """``kto`` (KTO paper, with the KL reference point) or ``apo_zero_unpaired`` (APO-zero, unpaired, no KL term)."""
    beta: float = field(default=0.1, metadata={"help": "Deviation from the reference (higher: less)."})
    """Scale of the implicit reward ``beta * log(pi / pi_ref)``; higher beta keeps the policy nearer the reference."""
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of desirable rows' losses."})
    """Weight of the desirable (label True) rows' losses, to balance unequal numbers of good and bad rows."""
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of undesirable rows' losses."})
    """Weight of the undesirable (label False) rows' losses, to balance unequal numbers of good and bad rows."""
    activation_offloading: bool = field(default=False, metadata={"help": "Offload activations to the CPU."})
    """Offload activations to the CPU (a GPU-memory option; True is rejected here)."""
    sync_ref_model: bool = field(default=False, metadata={"help": "TR-DPO reference syncing (not supported)."})
    """Mix the policy into the reference every ``ref_model_sync_steps`` (TR-DPO); True is rejected here."""
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO mixing weight alpha."})
    """TR-DPO's alpha: ``ref = alpha * policy + (1 - alpha) * ref`` (only with ``sync_ref_model``)."""
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO sync period tau."})
    """TR-DPO's tau: steps between reference syncs (only with ``sync_ref_model``)."""

    def __post_init__(self) -> None:
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.strip().lower()
            self.pad_to_multiple_of = None if text in ("none", "null", "") else int(text)
        resolve_bf16(self)
        map_warmup_ratio(self)
        super().__post_init__()
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = 128 if self.device.type == "neuron" else None
        self._check()

    def _check(self) -> None:
        """Cross-field rules, each with the offending field named."""
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"KTOConfig.loss_type must be one of {KTO_LOSS_TYPES}, got {self.loss_type!r}")
        if self.beta <= 0:
            raise ValueError(f"KTOConfig.beta must be > 0, got {self.beta}")
        for name in ("desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"KTOConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"KTOConfig.max_length must be >= 2 or None, got {self.max_length}")
        if self.pad_to_multiple_of is not None and int(self.pad_to_multiple_of) < 1:
            raise ValueError(f"KTOConfig.pad_to_multiple_of must be >= 1, got {self.pad_to_multiple_of}")
        if self.activation_offloading:
            raise NotImplementedError("KTOConfig.activation_offloading=True is not supported by rlhf_core's KTOTrainer")
        if self.sync_ref_model:
            raise NotImplementedError(
                "KTOConfig.sync_ref_model=True (TR-DPO) is not supported by rlhf_core's KTOTrainer; leave it False"
            )
        if self.router_aux_loss_coef:
            raise NotImplementedError(
                f"KTOConfig.router_aux_loss_coef={self.router_aux_loss_coef}: Mixture-of-Experts losses are not "
                "supported"
            )
        if self.loss_type != "apo_zero_unpaired" and self.train_sampling_strategy != "sequential":
            raise ValueError(
                f"KTOConfig.train_sampling_strategy must be 'sequential' for loss_type={self.loss_type!r} (its KL "
                f"completions pair each row with its neighbour in a fixed-order batch), got "
                f"{self.train_sampling_strategy!r}"
            )
        if self.loss_type != "apo_zero_unpaired" and self.per_device_train_batch_size < 2:
            raise ValueError(
                f"KTOConfig.per_device_train_batch_size must be >= 2 for loss_type={self.loss_type!r}: with one row "
                "the KL estimate is that row's own reward"
            )


__all__ = ["KTOConfig"]
