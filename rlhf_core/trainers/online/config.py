"""Fields GRPOConfig and RLOOConfig share: TRL 1.16's names and meanings, with CPU-sensible defaults.

Every field keeps TRL 1.16.0's name. Where our default differs from TRL's, the field's docstring says so and
why. Options TRL 1.16 has that this implementation does not (vLLM, tool calling, ...) are accepted at their
TRL default and rejected with a clear ``ValueError`` when changed, so a script never silently does less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from rlhf_core.trainers.base import resolve_bf16


@dataclass
class OnlineRLConfig(TrainingArguments):
    """Arguments of the critic-free online trainers (GRPO, RLOO): ``TrainingArguments`` plus sampling and loss."""

    # ---- TrainingArguments fields whose defaults TRL 1.16 (and we) override
    learning_rate: float = field(default=5e-5, metadata={"help": "AdamW learning rate."})
    """AdamW learning rate. TRL 1.16: 1e-6 (tuned for billion-parameter models on GPUs; a small model barely
    moves in a run at that rate); ours: 5e-5, transformers' own default, which learns on small models."""
    logging_steps: float = field(default=10, metadata={"help": "Log every N optimizer steps (TRL: 10)."})
    """Optimizer steps between two logs (TRL 1.16's 10, not transformers' 500)."""
    gradient_checkpointing: bool | None = field(default=None, metadata={"help": "Recompute activations in backward."})
    """Trade compute for memory. TRL 1.16: True (GPU memory); ours: None, off (on a CPU it only costs ~20% time)."""
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; None: only where useful."})
    """bf16 mixed precision (autocast; the weights, and so the optimizer's masters, stay fp32). TRL 1.16: None
    means True unless fp16; ours: None means True only on a CUDA GPU with bf16 support (``base.resolve_bf16``;
    fp32 on a CPU, where bf16 autocast is slow and changes results)."""
    remove_unused_columns: bool | None = field(default=False, metadata={"help": "Keep only the prompt column."})
    """Keep only the ``prompt`` column. False (TRL 1.16) keeps every column for the reward functions' kwargs."""

    # ---- model and reference model
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={"help": "from_pretrained kwargs."})
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` when ``model`` is a name or path."""
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the hub."})
    """Allow models and tokenizers that ship their own Python code (policy and reward models). Off by default."""
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "MoE load-balancing loss weight."})
    """MoE load-balancing loss weight (TRL 1.16). Not implemented here: must stay None."""
    disable_dropout: bool = field(default=True, metadata={"help": "No dropout in any forward pass."})
    """Run every forward pass (sampling, old/ref log-probs, the loss) without dropout (``model.eval()``
    semantics, as PPO here). TRL 1.16: False (dropout on while sampling and training, so the first iteration's
    importance ratio is not 1 and the KL to the reference is noisy); ours: True. False restores TRL's behaviour."""
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "fp32 LM head (ScaleRL)."})
    """Cast the LM head to fp32 (TRL 1.16). Not implemented here: must stay False."""

    # ---- data and sampling
    num_generations: int | None = field(default=8, metadata={"help": "Completions sampled per prompt."})
    """Completions sampled per prompt (a group). The global generation batch must be a multiple of it."""
    num_generations_eval: int | None = field(default=None, metadata={"help": "Completions per prompt in eval."})
    """Completions per prompt during evaluation; None: ``num_generations``."""
    max_completion_length: int | None = field(default=128, metadata={"help": "Most tokens in a completion."})
    """Most tokens sampled per completion. TRL 1.16: 512; ours: 128, since a CPU samples token by token
    (completions still end at EOS). ``dr_grpo`` divides by this constant."""
    shuffle_dataset: bool | None = field(default=True, metadata={"help": "Shuffle the prompts."})
    """Shuffle the training prompts (seeded by ``seed``)."""
    pad_to_multiple_of: int | str | None = field(default="auto", metadata={"help": "Pad ids to a multiple."})
    """TRL 1.16 pads ids to a multiple of this (``auto``: only on Neuron). Accepted as ``auto``/None only."""
    generation_batch_size: int | None = field(default=None, metadata={"help": "Completions per generation."})
    """Completions sampled together, across processes. None: ``per_device_train_batch_size * world_size *
    steps_per_generation``. Exclusive with ``steps_per_generation``."""
    steps_per_generation: int | None = field(default=None, metadata={"help": "Micro-steps per generation."})
    """Micro-batches (of ``per_device_train_batch_size``) trained from one generation; None:
    ``gradient_accumulation_steps`` (one generation per optimizer step)."""
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    """Sampling temperature (> 0)."""
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass."})
    """Nucleus sampling: keep the smallest token set with this probability mass; 1.0 keeps all."""
    top_k: int = field(default=0, metadata={"help": "Top-k filtering; 0 disables."})
    """Sample from the ``top_k`` most likely tokens; 0 disables the filter."""
    min_p: float | None = field(default=None, metadata={"help": "Min-p filtering."})
    """Drop tokens below ``min_p`` times the most likely token's probability; None disables."""
    generation_kwargs: dict | str | None = field(default=None, metadata={"help": "Extra generate() kwargs."})
    """More keyword arguments for ``generate`` (they override the sampling fields above)."""
    chat_template_kwargs: dict | str | None = field(default=None, metadata={"help": "apply_chat_template kwargs."})
    """More keyword arguments for ``apply_chat_template`` on conversational prompts."""
    repetition_penalty: float = field(default=1.0, metadata={"help": "Repetition penalty."})
    """Penalise tokens already in the prompt or completion (> 1) or favour them (< 1); 1.0 is off."""
    cache_implementation: str | None = field(default=None, metadata={"help": "KV cache implementation."})
    """``generate``'s ``cache_implementation``; None: the model's default KV cache."""
    use_vllm: bool = field(default=False, metadata={"help": "Sample with vLLM (not supported here)."})
    """Sample with vLLM (TRL 1.16). Not supported here (CPU-first): must stay False; sampling uses the KV cache."""

    # ---- TRL 1.16 acceleration options, accepted so its scripts run: without vLLM (as in TRL with
    # use_vllm=False) the vllm_* fields are never read; the others must keep their default.
    ds3_gather_for_generation: bool = field(default=True, metadata={"help": "DeepSpeed ZeRO-3 gather (unused)."})
    """Gather ZeRO-3 weights for sampling (TRL 1.16). Never read here: rlhf_core does not run DeepSpeed ZeRO-3."""
    vllm_mode: str = field(default="colocate", metadata={"help": "vLLM mode (unused without vLLM)."})
    """TRL 1.16's vLLM placement (``colocate``/``server``); unused, as ``use_vllm`` is always False here."""
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM model implementation (unused)."})
    """TRL 1.16's vLLM model implementation; unused without vLLM."""
    vllm_enable_sleep_mode: bool = field(default=False, metadata={"help": "vLLM sleep mode (unused)."})
    """TRL 1.16's vLLM sleep mode; unused without vLLM."""
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={"help": "vLLM regex (unused)."})
    """TRL 1.16's vLLM structured-output regex; unused without vLLM."""
    vllm_server_base_url: str | None = field(default=None, metadata={"help": "vLLM server URL (unused)."})
    """TRL 1.16's vLLM server URL; unused without vLLM."""
    vllm_server_host: str = field(default="127.0.0.1", metadata={"help": "vLLM server host (unused)."})
    """TRL 1.16's vLLM server host; unused without vLLM. TRL 1.16 defaults to all interfaces; ours is loopback,
    the project's rule for any address it names."""
    vllm_server_port: int = field(default=8000, metadata={"help": "vLLM server port (unused)."})
    """TRL 1.16's vLLM server port; unused without vLLM."""
    vllm_server_timeout: float = field(default=240.0, metadata={"help": "vLLM server timeout (unused)."})
    """TRL 1.16's wait for the vLLM server; unused without vLLM."""
    vllm_group_port: int = field(default=51216, metadata={"help": "vLLM weight-sync port (unused)."})
    """TRL 1.16's vLLM weight-update port; unused without vLLM."""
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "vLLM GPU memory share (unused)."})
    """TRL 1.16's vLLM GPU memory share; unused without vLLM."""
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "vLLM context length (unused)."})
    """TRL 1.16's vLLM context window; unused without vLLM."""
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM tensor parallelism (unused)."})
    """TRL 1.16's vLLM tensor-parallel size; unused without vLLM."""
    use_transformers_continuous_batching: bool = field(default=False, metadata={"help": "Not supported."})
    """TRL 1.16's continuous-batching sampler. Not supported: must stay False (sampling uses the KV cache)."""
    transformers_continuous_batching_config: dict | str | None = field(default=None, metadata={"help": "Unused."})
    """Settings of the continuous-batching sampler; must stay None."""
    use_transformers_paged: bool = field(default=False, metadata={"help": "Deprecated in TRL 1.16; not supported."})
    """TRL 1.16's deprecated name of ``use_transformers_continuous_batching``; must stay False."""

    # ---- optimisation
    num_iterations: int = field(default=1, metadata={"help": "Updates per generation (mu)."})
    """Passes over each generation (mu). With more than one, importance ratios are taken against the log-probs
    at sampling time; the first pass's ratio is exactly 1."""
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range."})
    """Clip range: the ratio is clipped below at ``1 - epsilon``."""
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip range; None: epsilon."})
    """Upper clip range: the ratio is clipped above at ``1 + epsilon_high`` (DAPO: 0.28); None: ``epsilon``."""
    reward_weights: list[float] | None = field(default=None, metadata={"help": "Weight per reward function."})
    """One weight per reward function (summed, weighted); None: all 1.0."""
    reward_timeout: float | None = field(default=None, metadata={"help": "Seconds a reward function may take."})
    """rlhf_core's addition (not in TRL 1.16): seconds a reward function may take on a batch. Past it, or when
    it raises, it is called on each sample alone and only the samples it still fails are lost (NaN, counted in
    ``rewards/<name>/failures``), never the run (``rlhf_core.rewards.contract``). None: no time limit, and plain
    functions run on the trainer's thread as in TRL (a raising one still costs only its samples)."""
    dynamic_sampling: bool = field(default=False, metadata={"help": "Leave all-equal groups out of the loss."})
    """rlhf_core's addition (DAPO's dynamic sampling, not in TRL 1.16): groups whose rewards are all equal (no
    learning signal: every advantage is 0) are left out of the loss, so they do not dilute the token mean; the
    count is logged as ``dynamic_sampling/dropped_groups``. DAPO then samples more prompts to refill the batch;
    here the batch is smaller instead (the next generation batch is not drawn early)."""
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Drop truncated completions."})
    """Leave completions that hit ``max_completion_length`` without EOS out of the loss (DAPO)."""
    sync_ref_model: bool = field(default=False, metadata={"help": "Mix the policy into the reference (TR-DPO)."})
    """Every ``ref_model_sync_steps`` steps set ref = alpha * policy + (1 - alpha) * ref (TR-DPO)."""
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO alpha."})
    """TR-DPO's alpha, the policy's share when ``sync_ref_model`` mixes it into the reference."""
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO tau."})
    """TR-DPO's tau: optimizer steps between two reference syncs."""

    # ---- logging
    log_completions: bool = field(default=False, metadata={"help": "Log sample completions."})
    """Print a sample of (prompt, completion, reward) every ``logging_steps`` steps."""
    num_completions_to_print: int | None = field(default=None, metadata={"help": "Completions printed."})
    """How many completions ``log_completions`` prints; None: all of the last generation."""
    log_multimodal: bool = field(default=True, metadata={"help": "Log images with completions (unused)."})
    """TRL 1.16 logs images with completions; prompts here are text only, so it is never read."""
    log_unique_prompts: bool = field(default=False, metadata={"help": "Print each prompt once."})
    """Print each distinct prompt once (not once per completion of its group) when ``log_completions``."""

    def __post_init__(self) -> None:
        resolve_bf16(self)
        super().__post_init__()
        self._reject_unsupported()
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported: a generation batch must hold whole prompt groups")
        self._resolve_generation_batch()
        self._check_ranges()

    def _reject_unsupported(self) -> None:
        """TRL 1.16 options this implementation does not have: an error, never a silent no-op."""
        unsupported = {"use_vllm": False, "router_aux_loss_coef": None, "cast_lm_head_to_fp32": False,
                       "use_transformers_continuous_batching": False, "transformers_continuous_batching_config": None,
                       "use_transformers_paged": False}
        for name, default in unsupported.items():
            if getattr(self, name) != default:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by rlhf_core; leave it at {default!r}")
        if self.pad_to_multiple_of not in ("auto", None):
            raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r} is not supported; use 'auto' or None")

    def _resolve_generation_batch(self) -> None:
        """Fill ``generation_batch_size``/``steps_per_generation`` from each other, as TRL 1.16 does."""
        per_step = self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError("generation_batch_size and steps_per_generation cannot both be set")
        if self.generation_batch_size is None:
            self.steps_per_generation = self.steps_per_generation or self.gradient_accumulation_steps
            self.generation_batch_size = per_step * self.steps_per_generation
        elif self.generation_batch_size % per_step:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch size "
                f"per_device_train_batch_size * world_size ({per_step})"
            )
        else:
            self.steps_per_generation = self.generation_batch_size // per_step
        if self.generation_batch_size % self.num_generations:
            raise ValueError(
                f"generation_batch_size ({self.generation_batch_size}) must be divisible by num_generations "
                f"({self.num_generations}): every prompt's group is sampled together"
            )

    def _check_ranges(self) -> None:
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(f"num_generations must be >= 2 (a group to compare against), got {self.num_generations}")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")
        if not 0.0 <= self.ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"ref_model_mixup_alpha must be in [0, 1], got {self.ref_model_mixup_alpha}")
        eval_generations = self.num_generations_eval or self.num_generations
        if self.eval_strategy != "no" and (self.per_device_eval_batch_size * self.world_size) % eval_generations:
            raise ValueError(
                f"the global eval batch (per_device_eval_batch_size {self.per_device_eval_batch_size} * world_size "
                f"{self.world_size}) must be divisible by the generations per eval prompt ({eval_generations})")
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise ValueError(f"reward_timeout must be > 0 seconds or None, got {self.reward_timeout}")
        if self.reward_weights is not None and any(not isinstance(w, (int, float)) for w in self.reward_weights):
            raise ValueError(f"reward_weights must be numbers, got {self.reward_weights!r}")
