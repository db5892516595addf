"""``GRPOConfig``: TRL 1.16.0's GRPO arguments (names, defaults, meanings; CPU deviations documented)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf_core.losses import GRPO_LOSS_TYPES, SCALE_REWARDS
from rlhf_core.trainers.online.config import OnlineRLConfig


@dataclass
class GRPOConfig(OnlineRLConfig):
    """Group Relative Policy Optimization arguments; see ``OnlineRLConfig`` for the shared sampling fields."""

    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0.0 loads no reference model."})
    """Weight of the k3 KL-to-reference term in the loss. 0.0 (TRL 1.16's default): no reference model is
    built or loaded at all (less memory, faster steps)."""
    delta: float | None = field(default=None, metadata={"help": "Upper cap on the unclipped ratio."})
    """Two-sided GRPO (INTELLECT-2): cap the unclipped importance ratio at ``delta`` (> 1 + epsilon); None: off."""
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO temperature (unused)."})
    """TRL 1.16's ``sapo`` loss temperature for non-positive advantages; unused (``sapo`` is not implemented)."""
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO temperature (unused)."})
    """TRL 1.16's ``sapo`` loss temperature for positive advantages; unused."""
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO k+ (unused)."})
    """TRL 1.16's ``vespo`` exponent for positive advantages; unused (``vespo`` is not implemented)."""
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO lambda+ (unused)."})
    """TRL 1.16's ``vespo`` decay for positive advantages; unused."""
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO k- (unused)."})
    """TRL 1.16's ``vespo`` exponent for negative advantages; unused."""
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO lambda- (unused)."})
    """TRL 1.16's ``vespo`` decay for negative advantages; unused."""
    importance_sampling_level: str = field(default="token", metadata={"help": "'token' or 'sequence' ratios."})
    """``token``: one importance ratio per token; ``sequence`` (GSPO): exp of the mean log-ratio per completion."""
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={"help": "Reward aggregation."})
    """How several reward functions combine. Only ``sum_then_normalize`` (TRL 1.16's default: weighted sum,
    then ``scale_rewards``) is implemented."""
    scale_rewards: str = field(default="group", metadata={"help": "'group', 'batch' or 'none' (True/False)."})
    """Divide advantages by the std of the group (``group``/True), of the whole batch (``batch``), or not at
    all (``none``/False, Dr. GRPO)."""
    loss_type: str = field(default="dapo", metadata={"help": "'grpo', 'bnpo', 'dr_grpo' or 'dapo'."})
    """How token losses aggregate: ``grpo`` mean of per-completion means; ``bnpo`` mean over the micro-batch's
    tokens; ``dr_grpo`` sum / (completions * max_completion_length); ``dapo`` (default) mean over the tokens of
    the whole accumulated batch. TRL 1.16's ``cispo``/``sapo``/``luspo``/``vespo`` are not implemented."""
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "Keep the top-rho entropy tokens."})
    """Keep only the top quantile of tokens by entropy in the loss (TRL 1.16). Only 1.0 (all tokens) is supported."""
    entropy_coef: float = field(default=0.0, metadata={"help": "Entropy bonus weight."})
    """Subtract ``entropy_coef`` times the mean per-token entropy from the loss (an exploration bonus)."""
    use_adaptive_entropy: bool = field(default=False, metadata={"help": "Adaptive entropy bonus (not supported)."})
    """Skywork-OR1's adaptive entropy coefficient (TRL 1.16). Not implemented here: must stay False."""
    entropy_coef_min: float = field(default=0.0, metadata={"help": "Adaptive entropy lower bound (unused)."})
    """Lower bound of the adaptive entropy coefficient; unused without ``use_adaptive_entropy``."""
    entropy_coef_max: float = field(default=1.0, metadata={"help": "Adaptive entropy upper bound (unused)."})
    """Upper bound of the adaptive entropy coefficient; unused without ``use_adaptive_entropy``."""
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "Adaptive entropy step (unused)."})
    """Step of the adaptive entropy coefficient; unused without ``use_adaptive_entropy``."""
    entropy_target: float = field(default=0.2, metadata={"help": "Adaptive entropy target (unused)."})
    """Target entropy of the adaptive controller; unused without ``use_adaptive_entropy``."""
    max_tool_calling_iterations: int | None = field(default=None, metadata={"help": "Tool turns (unused)."})
    """TRL 1.16's limit on tool-calling turns; unused (tools are not supported)."""
    vllm_importance_sampling_correction: bool = field(default=True, metadata={"help": "vLLM IS (unused)."})
    """TRL 1.16's correction for vLLM/trainer log-prob mismatch; unused without vLLM (the sampler is the policy)."""
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": "vLLM IS mode (unused)."})
    """TRL 1.16's vLLM importance-sampling mode; unused without vLLM."""
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "vLLM IS cap (unused)."})
    """TRL 1.16's vLLM importance-ratio cap; unused without vLLM."""
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "vLLM IS floor (unused)."})
    """TRL 1.16's vLLM importance-ratio floor; unused without vLLM."""
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={"help": "Deprecated (unused)."})
    """TRL 1.16's deprecated name of ``vllm_importance_sampling_clip_max``; unused without vLLM."""
    log_completions_hub_repo: str | None = field(default=None, metadata={"help": "Hub upload (not supported)."})
    """Upload logged completions to a Hub dataset (TRL 1.16). Not supported offline: must stay None."""
    use_bias_correction_kl: bool = field(default=True, metadata={"help": "Multiply the KL by the ratio."})
    """Multiply the per-token KL by the importance ratio (DeepSeek-V3.2's unbiased reverse-KL gradient)."""
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "Off-policy masking."})
    """DeepSeek-V3.2 off-policy sequence masking (TRL 1.16). Not implemented here: must stay None."""

    def __post_init__(self) -> None:
        # TRL 1.16 maps the booleans onto the names (True: group, False: none).
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        super().__post_init__()
        if self.scale_rewards not in SCALE_REWARDS:
            raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} or a bool, got {self.scale_rewards!r}")
        if self.loss_type not in GRPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {GRPO_LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got "
                             f"{self.importance_sampling_level!r}")
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(f"multi_objective_aggregation={self.multi_objective_aggregation!r} is not supported; "
                             "use 'sum_then_normalize'")
        if self.top_entropy_quantile != 1.0:
            raise ValueError(f"top_entropy_quantile={self.top_entropy_quantile} is not supported; leave it at 1.0")
        if self.use_adaptive_entropy:
            raise ValueError("use_adaptive_entropy is not supported; use a fixed entropy_coef")
        if self.log_completions_hub_repo is not None:
            raise ValueError("log_completions_hub_repo is not supported (no Hub uploads); leave it at None")
        if self.off_policy_mask_threshold is not None:
            raise ValueError("off_policy_mask_threshold is not supported; leave it at None")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
