"""What GRPO and RLOO share: prompt groups, sampling, rewards, log-prob forwards, buffering and logging.

``OnlineRLTrainer`` is a ``transformers.Trainer`` (so ``TrainingArguments``, callbacks, checkpoints and resume
work as for SFT/DPO here) with the TRL 1.16 data flow: the dataloader yields a *generation batch* of prompts,
each repeated ``num_generations`` times; completions are sampled once per ``steps_per_generation *
num_iterations`` micro-steps through the shared fast path (``generation.generate_batched``: KV cache, EOS cut,
batching), scored, and kept in a typed ``Rollout`` that is split into micro-batches. Subclasses supply the
advantages and the loss (pure functions in ``rlhf_core.losses``).

Where TRL 1.16 is weak, this is not: every log-prob forward passes ``position_ids`` built from the attention
mask (left-padded prompts of different lengths score as if alone), dropout is off in every forward pass
(``disable_dropout``), and the reference model is an in-memory copy (``create_reference_model``), never
re-loaded from ``config._name_or_path``; with ``beta == 0`` none is built at all.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Unpack

import torch
from accelerate.utils import set_seed
from torch.utils.data import Sampler
from transformers import (
    AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel, Trainer,
    TrainerCallback,
)

from rlhf_core.core import MAX_ABS_REWARD
from rlhf_core.models.embedding_grads import sparse_tied_embedding_grad
from rlhf_core.models.fused_kernels import fuse_kernels, fuses_on
from rlhf_core.rewards.contract import RewardCall, call_reward_funcs
from rlhf_core.trainers.base import (
    RlhfTrainerMixin,
    TrackingOptions,
    check_tracking,
    load_model,
    wrap_peft,
)
from rlhf_core.models.padding import ensure_pad_token
from rlhf_core.trainers.experience import ModelBatch, Rollout, build_causal_batch
from rlhf_core.trainers.forward import decide_reference, dropout_off, reference_model, response_forward
from rlhf_core.trainers.generation import generate_batched
from rlhf_core.trainers.online.config import OnlineRLConfig
from rlhf_core.trainers.ref_sync import SyncRefModelCallback, mix_into_reference

RewardFunc = Callable[..., Sequence[float | None]] | PreTrainedModel | str

# ---- data ---------------------------------------------------------------------------------------


def is_conversational(prompt: Any) -> bool:
    """A prompt is conversational when it is a list of ``{"role", "content"}`` messages."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _identity(features: list[dict]) -> list[dict]:
    """The collator: rows stay dicts (prompts are tokenised after the sampler has grouped them)."""
    return features


class GroupRepeatSampler(Sampler[int]):
    """Indices for generation batches: each prompt ``num_generations`` times in a row, each batch repeated.

    A generation batch holds ``prompts_per_batch`` distinct prompts (``generation_batch_size /
    num_generations``), each repeated ``num_generations`` times; the whole batch is yielded ``repeat_count``
    (= ``num_iterations * steps_per_generation``) times, so the Trainer counts one micro-step per repeat while
    the trainer samples only on the first. A trailing partial batch is dropped. The order depends on ``seed``
    only, so every process (and a resumed run) sees the same groups.
    """

    def __init__(self, size: int, num_generations: int, prompts_per_batch: int = 1, repeat_count: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        self.size, self.num_generations = size, num_generations
        self.prompts_per_batch, self.repeat_count = prompts_per_batch, repeat_count
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.size, generator=self.generator).tolist() if self.shuffle else list(range(self.size))
        for start in range(0, self.size - self.prompts_per_batch + 1, self.prompts_per_batch):
            chunk = order[start:start + self.prompts_per_batch]
            for _ in range(self.repeat_count):
                for index in chunk:
                    yield from [index] * self.num_generations

    def __len__(self) -> int:
        return (self.size // self.prompts_per_batch) * self.prompts_per_batch * self.num_generations * self.repeat_count


# ---- the forward ------------------------------------------------------------------------------


def token_logprobs_and_entropy(model: Any, batch: ModelBatch, with_entropy: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (B, A) of every response token under ``model``, and (optionally) the entropy there (B, A).

    The shared ``forward.response_forward`` with the LM head on the span of scored positions: the forward gets
    ``batch.model_inputs``, position ids included, so left padding changes nothing; the rows are packed into one
    sequence where that saves FLOPs (padding slots then hold 0).
    """
    forward = response_forward(model, batch, positions="span", entropy=with_entropy)
    return forward.logprobs, forward.entropy


# ---- the trainer -----------------------------------------------------------------------------


class OnlineRLTrainer(RlhfTrainerMixin, Trainer):
    """Base of ``GRPOTrainer`` and ``RLOOTrainer``; subclasses implement ``_advantages`` and ``_policy_loss``.

    Beyond TRL 1.16's arguments, keyword-only ``log_with`` (``"mlflow"``, ``"tensorboard"``, ``"memory"``
    or a ``rlhf_core.tracking.Tracker``), ``tracker_project_name`` and ``tracker_kwargs`` send every log
    to this project's tracker, as for the other trainers here.
    """

    trainer_name = "online"
    config_class: type[OnlineRLConfig] = OnlineRLConfig

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: OnlineRLConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        **tracking: Unpack[TrackingOptions],
    ) -> None:
        tracking = check_tracking(type(self).__name__, tracking)
        if args is None:  # TRL 1.16's default: <model name>-GRPO / -RLOO
            args = self.config_class(output_dir=f"{self._model_id(model)}-{self.trainer_name.upper()}")
        if not isinstance(args, OnlineRLConfig):
            raise ValueError(f"args must be a {self.config_class.__name__}, got {type(args).__name__}")
        if quantization_config is not None:
            raise ValueError("quantization_config (bitsandbytes, GPU only) is not supported by rlhf_core; pass None")
        init_kwargs = dict(args.model_init_kwargs or {})
        if isinstance(model, str) and args.trust_remote_code:
            init_kwargs.setdefault("trust_remote_code", True)
        model = load_model(model, AutoModelForCausalLM, init_kwargs)
        processing_class = self._policy_tokenizer(model, processing_class, args)
        model = wrap_peft(model, peft_config)
        self.beta = float(getattr(args, "beta", 0.0))
        # beta == 0: no reference at all. A PEFT policy's reference is the same model with its adapter off.
        self.ref_model = decide_reference(model, needed=self.beta != 0.0).model
        self.reward_funcs, self.reward_processing_classes = self._load_reward_funcs(
            reward_funcs, reward_processing_classes, args)
        self.reward_func_names = [self._reward_name(f) for f in self.reward_funcs]
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights has {len(weights)} entries for {len(self.reward_funcs)} reward functions")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self._check_dataset(train_dataset, "train_dataset")
        super().__init__(model=model, args=args, data_collator=_identity, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        # One seed per process: a prompt group split across processes must not sample identical completions.
        set_seed(self.args.seed, device_specific=True)
        self.loss_is_scaled_for_ga = True  # compute_loss scales for gradient accumulation itself
        self.model_accepts_loss_kwargs = False
        self.num_generations = args.num_generations
        self.num_generations_eval = args.num_generations_eval or args.num_generations
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._buffered: list[Rollout] | None = None
        self._step = 0
        self._step_time = 0.0  # seconds of the micro-steps of the current optimizer step (TRL's step_time)
        self._last_samples: list[tuple[str, str, float, dict[str, str]]] = []
        self._last_extras: dict[str, list[str]] = {}  # log_extra's columns for the last generation batch
        if self.ref_model is not None:
            self.ref_model.to(self.args.device)
        if fuses_on(self.args.device):  # fused GELU / RMSNorm / rotary on CUDA (the CPU stays byte-identical)
            fuse_kernels(self.model)
            fuse_kernels(self.ref_model)
        for reward_model in self.reward_funcs:
            if isinstance(reward_model, torch.nn.Module):
                reward_model.to(self.args.device).eval()
        if args.sync_ref_model:
            if self.ref_model is None:
                raise ValueError("sync_ref_model needs a reference model: set beta > 0 (and no peft_config)")
            self.add_callback(SyncRefModelCallback(self.ref_model, args.ref_model_mixup_alpha,
                                                   args.ref_model_sync_steps, self.accelerator))
        self._setup_tracking(**tracking)

    # ---- setup helpers

    @staticmethod
    def _model_id(model: Any) -> str:
        config = getattr(model, "config", None)
        name = model if isinstance(model, str) else getattr(config, "_name_or_path", "") or "model"
        return str(name).rstrip("/").split("/")[-1]

    @staticmethod
    def _policy_tokenizer(model: Any, processing_class: Any, args: OnlineRLConfig) -> Any:
        """The given tokenizer, else the one saved with the model; a pad token (EOS if none), left padding."""
        if processing_class is None:
            name = getattr(model.config, "_name_or_path", None)
            if not name:
                raise ValueError("processing_class is required when the model has no name or path to load one from")
            processing_class = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        ensure_pad_token(processing_class)
        processing_class.padding_side = "left"
        return processing_class

    @staticmethod
    def _load_reward_funcs(reward_funcs: Any, processing_classes: Any, args: OnlineRLConfig) -> tuple[list, list]:
        """Reward callables pass through; paths become sequence classifiers (one logit) with their tokenizers."""
        if reward_funcs is None:
            raise ValueError("reward_funcs is required: a callable, a reward model (or its path), or a list of them")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs:
            raise ValueError("reward_funcs is empty")
        if processing_classes is None:
            processing_classes = [None] * len(funcs)
        elif not isinstance(processing_classes, (list, tuple)):
            processing_classes = [processing_classes]
        if len(processing_classes) != len(funcs):
            raise ValueError(f"reward_processing_classes has {len(processing_classes)} entries for {len(funcs)} "
                             "reward functions")
        loaded, tokenizers = [], []
        for i, (func, tok) in enumerate(zip(funcs, processing_classes)):
            if isinstance(func, str):
                func = AutoModelForSequenceClassification.from_pretrained(
                    func, num_labels=1, trust_remote_code=args.trust_remote_code)
            if isinstance(func, torch.nn.Module):
                if tok is None:
                    name = getattr(func.config, "_name_or_path", None)
                    if not name:
                        raise ValueError(f"reward_funcs[{i}] is a model without a path: pass its tokenizer in "
                                         "reward_processing_classes")
                    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
                ensure_pad_token(tok)
                func.config.pad_token_id = tok.pad_token_id
            elif not callable(func):
                raise ValueError(f"reward_funcs[{i}] must be a callable, a model or a path, got {type(func).__name__}")
            loaded.append(func)
            tokenizers.append(tok)
        return loaded, tokenizers

    @staticmethod
    def _reward_name(func: Any) -> str:
        if isinstance(func, torch.nn.Module):
            return str(getattr(func.config, "_name_or_path", "") or type(func).__name__).rstrip("/").split("/")[-1]
        return getattr(func, "__name__", type(func).__name__)

    @staticmethod
    def _check_dataset(dataset: Any, name: str) -> None:
        columns = getattr(dataset, "column_names", None)
        if columns is not None and "prompt" not in columns:
            raise ValueError(f"{name} needs a 'prompt' column (plain text or a list of messages); found {columns}")

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            self._signature_columns = ["prompt"]

    # ---- data loading: generation batches of whole prompt groups

    def get_train_dataloader(self):
        """Batches of ``per_device_train_batch_size * steps_per_generation`` rows: one generation's share."""
        if self.train_dataset is None:
            raise ValueError("training requires a train_dataset")
        return self._get_dataloader(dataset=self.train_dataset, description="Training",
                                    batch_size=self._train_batch_size * self.args.steps_per_generation,
                                    sampler_fn=self._get_train_sampler, is_training=True)

    def _get_train_sampler(self, dataset: Any = None) -> Sampler:
        dataset = self.train_dataset if dataset is None else dataset
        return GroupRepeatSampler(len(dataset), self.num_generations,
                                  self.args.generation_batch_size // self.num_generations,
                                  self.args.num_iterations * self.args.steps_per_generation,
                                  shuffle=bool(self.args.shuffle_dataset), seed=self.args.seed)

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler:
        return GroupRepeatSampler(len(eval_dataset), self.num_generations_eval, shuffle=False)

    # ---- the micro-step: sample when due, else the next slice of the buffered rollout

    def training_step(self, model, inputs, num_items_in_batch=None):
        start = time.perf_counter()
        output = super().training_step(model, inputs, num_items_in_batch)
        self._step += 1
        self._step_time += time.perf_counter() - start
        if self._step % self.current_gradient_accumulation_steps == 0:  # as TRL 1.16: wall time per optimizer step
            self._metrics["train"]["step_time"].append(self._step_time)
            self._step_time = 0.0
        return output

    def _prepare_inputs(self, generation_batch: list[dict]) -> Rollout:
        if not self.model.training:
            return self._generate_and_score(generation_batch, "eval")
        if self._buffered is None:  # first step, or the first after a resume
            self._step = self.state.global_step * self.args.gradient_accumulation_steps
        generate_every = self.args.steps_per_generation * self.args.num_iterations
        if self._buffered is None or self._step % generate_every == 0:
            rollout = self._generate_and_score(generation_batch, "train")
            order = torch.randperm(len(rollout))  # mixes groups across micro-batches (global RNG: resumable)
            self._buffered = [rollout.rows(chunk) for chunk in order.chunk(self.args.steps_per_generation)]
        return self._buffered[self._step % self.args.steps_per_generation]

    # ---- sampling and scoring

    def _prompt_texts(self, prompts: list[Any]) -> list[str]:
        """Plain prompts as they are; conversations through the tokenizer's chat template (generation prompt on)."""
        if not is_conversational(prompts[0]):
            return [str(p) for p in prompts]
        if getattr(self.processing_class, "chat_template", None) is None:
            raise ValueError("train_dataset has conversational prompts (lists of messages) but the tokenizer has no "
                             "chat_template: set processing_class.chat_template or use plain-text prompts")
        kwargs = dict(self.args.chat_template_kwargs or {})
        return [self.processing_class.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **kwargs)
                for p in prompts]

    def _generation_kwargs(self) -> dict[str, Any]:
        args = self.args
        kwargs = {"do_sample": True, "max_new_tokens": args.max_completion_length, "temperature": args.temperature,
                  "top_p": args.top_p, "top_k": args.top_k, "repetition_penalty": args.repetition_penalty}
        if args.min_p is not None:
            kwargs["min_p"] = args.min_p
        if args.cache_implementation is not None:
            kwargs["cache_implementation"] = args.cache_implementation
        kwargs.update(args.generation_kwargs or {})
        return kwargs

    def _sample(self, prompt_texts: list[str], conversational: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Token ids of each prompt and of its sampled completion (cut after EOS, no padding)."""
        tokenizer = self.processing_class
        encoded = tokenizer(prompt_texts, add_special_tokens=not conversational)["input_ids"]
        queries = [torch.tensor(ids, dtype=torch.long, device=self.args.device) for ids in encoded]
        if any(len(q) == 0 for q in queries):
            raise ValueError("a prompt tokenised to zero tokens; every prompt needs at least one token")
        policy = self.accelerator.unwrap_model(self.model)
        with dropout_off(policy, self.args.disable_dropout):
            responses = generate_batched(policy, tokenizer, queries, device=self.args.device,
                                         batch_size=len(queries), return_prompt=False,
                                         mixed_precision=self.accelerator.mixed_precision, **self._generation_kwargs())
        eos = tokenizer.eos_token_id
        # A completion can come back empty only if generation stopped at once; give it one EOS to score.
        responses = [r if len(r) else torch.tensor([eos], device=self.args.device) for r in responses]
        return queries, responses

    @torch.no_grad()
    def _logprobs(self, model: Any, batch: ModelBatch) -> torch.Tensor:
        with dropout_off(model, self.args.disable_dropout or model is self.ref_model):
            return token_logprobs_and_entropy(model, batch)[0]

    @torch.no_grad()
    def _reference_logprobs(self, batch: ModelBatch) -> torch.Tensor | None:
        if self.beta == 0.0:
            return None
        adapter_off = self.ref_model is None  # beta > 0 without a reference model: the PEFT policy's base
        with reference_model(self.accelerator, self.model, self.ref_model, adapter_off) as reference:
            return self._logprobs(reference, batch)

    def _needs_old_logprobs(self) -> bool:
        """Old log-probs are needed when a sample is trained on after the policy has moved."""
        return self.args.num_iterations > 1 or self.args.steps_per_generation > self.args.gradient_accumulation_steps

    def _generate_and_score(self, rows: list[dict], mode: str) -> Rollout:
        """Sample a completion for every row, score it with every reward function, and compute advantages."""
        prompts = [row["prompt"] for row in rows]
        conversational = is_conversational(prompts[0])
        queries, responses = self._sample(self._prompt_texts(prompts), conversational)
        tokenizer = self.processing_class
        truncated = torch.tensor([int(r[-1]) != tokenizer.eos_token_id for r in responses], device=self.args.device)
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        per_func = self._rewards(rows, prompts, completions, [r.tolist() for r in responses], mode)  # (B, F)
        batch = build_causal_batch(queries, responses, tokenizer.pad_token_id, left_pad=True)
        if self.args.mask_truncated_completions:
            batch = replace(batch, response_mask=batch.response_mask * (~truncated)[:, None].float())
        if self.args.dynamic_sampling and mode == "train":
            batch = self._drop_uniform_groups(per_func, batch, mode)
        ref = self._reference_logprobs(batch)
        forward, old = None, None
        if self._needs_old_logprobs() or self._needs_sampling_logprobs():
            if mode == "train" and self._can_reuse_loss_forward():
                # The loss forward on these parameters, run now: its values are the sampling-time log-probs.
                with self.compute_loss_context_manager():  # as training_step runs compute_loss
                    forward = self._loss_forward(self.model_wrapped, batch)
                old = forward[0].detach()
            else:
                old = self._logprobs(self.model, batch)
        advantages, scores = self._advantages_for(per_func, batch, old, ref, mode)
        num_items = self.accelerator.gather(batch.response_mask.sum().reshape(1)).sum()
        lengths = torch.tensor([float(len(r)) for r in responses], device=self.args.device)  # (B,)
        prompt_tokens = torch.tensor([float(len(q)) for q in queries], device=self.args.device).sum()
        self._log_rollout_stats(mode, per_func, scores, lengths, truncated, prompt_tokens)
        extras = [{k: v[i] for k, v in self._last_extras.items() if i < len(v)} for i in range(len(prompts))]
        self._last_samples = [(str(p), str(c), float(s), e)
                              for p, c, s, e in zip(prompts, completions, scores.tolist(), extras)]
        return Rollout(batch=batch, advantages=advantages, old_logprobs=old, ref_logprobs=ref, num_items=num_items,
                       policy_forward=forward)

    def _needs_sampling_logprobs(self) -> bool:
        """Subclasses that use the policy's log-probs at sampling time in the reward (RLOO's KL) say so."""
        return False

    def _can_reuse_loss_forward(self) -> bool:
        """Whether the sampling-time log-probs can be the detached values of the loss forward itself.

        They are when the whole generation batch is one micro-batch trained on once (the parameters do not
        move between sampling and the loss forward) and no dropout draws a different mask per pass: the
        forward with grad then runs at sampling time and ``compute_loss`` reuses it, one forward fewer
        (TRL 1.16's GRPO takes the same shortcut, ``old_per_token_logps = per_token_logps.detach()``).
        """
        args = self.args
        return (args.steps_per_generation == 1 and not self._needs_old_logprobs() and args.disable_dropout
                and torch.is_grad_enabled())

    def _rewards(self, rows: list[dict], prompts: list, completions: list, completion_ids: list, mode: str = "train"
                 ) -> torch.Tensor:
        """(B, F) rewards, one column per reward function, TRL 1.16's call (``rlhf_core.rewards.contract``): NaN
        where a function returned None (not applicable), an infinity, or failed on that sample (raised, or
        passed ``args.reward_timeout``; counted as ``rewards/<name>/failures``)."""
        out = torch.full((len(prompts), len(self.reward_funcs)), math.nan, device=self.args.device)
        self._last_extras = {}
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion",
                                                                                     "completion_ids")}
        callables = [i for i, func in enumerate(self.reward_funcs) if not isinstance(func, torch.nn.Module)]
        for i, (func, tok) in enumerate(zip(self.reward_funcs, self.reward_processing_classes)):
            if i not in callables:
                out[:, i] = self._reward_model_scores(func, tok, prompts, completions)
        if callables:
            kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                          trainer_state=self.state, log_extra=self._log_extra,
                          log_metric=lambda name, value: self._metrics[mode][name].append(float(value)), **columns)
            call = call_reward_funcs([self.reward_funcs[i] for i in callables],
                                     [self.reward_func_names[i] for i in callables], kwargs, len(prompts),
                                     self.args.reward_timeout)
            for column, values in zip(callables, call.values):
                out[:, column] = torch.tensor(values, dtype=torch.float32, device=out.device)
            self._count_failures(call, [self.reward_func_names[i] for i in callables], prompts, mode)
        return self._mask_infinite(out, prompts)

    def _mask_infinite(self, out: torch.Tensor, prompts: list) -> torch.Tensor:
        """An infinite reward is masked like a None one (unscorable: out of its group's statistics), and named."""
        infinite = torch.isinf(out)  # (B, F); one check per generation batch, the rewards are on the host anyway
        if bool(infinite.any()):
            for row, col in infinite.nonzero().tolist():
                warnings.warn(f"reward function {self.reward_func_names[col]!r} returned {float(out[row, col])} for "
                              f"sample {row} (prompt {str(prompts[row])[:80]!r}): masked as unscorable (NaN), as a "
                              "None reward is", RuntimeWarning, stacklevel=3)
            out = out.masked_fill(infinite, math.nan)
        self._check_reward_bound(out, prompts)
        return out

    def _log_extra(self, name: str, values: list) -> None:
        """TRL 1.16's ``log_extra``: a reward function adds a column (one value per completion) to the samples."""
        self._last_extras[name] = [str(v) for v in values]

    def _count_failures(self, call: RewardCall, names: list[str], prompts: list, mode: str) -> None:
        """Log each function's lost samples (all processes) and warn with its first error; if every function
        failed on every sample there is no reward at all: that is a broken setup, not a flaky verifier."""
        failures = self.accelerator.gather(torch.tensor(call.failures, dtype=torch.float32,
                                                        device=self.args.device).reshape(1, -1)).sum(0)  # (F,)
        for name, count, error in zip(names, failures.tolist(), call.errors):
            self._metrics[mode][f"rewards/{name}/failures"].append(count)
            if error is not None:
                warnings.warn(f"reward function {name!r} failed on {int(count)} sample(s) (their reward is NaN, "
                              f"unscorable); first error: {error}", RuntimeWarning, stacklevel=3)
        if len(self.reward_funcs) == len(names) and all(f == len(prompts) for f in call.failures):
            raise RuntimeError(f"every reward function failed on every sample of the batch; first error: "
                               f"{call.errors[0]}")

    def _drop_uniform_groups(self, per_func: torch.Tensor, batch: ModelBatch, mode: str) -> ModelBatch:
        """DAPO's dynamic sampling: the rows of groups whose weighted rewards are all equal (gathered over the
        processes, NaN ignored) leave the loss (response mask 0); the count is logged."""
        weights = self.reward_weights.to(per_func.device)
        unscorable = torch.isnan(per_func).all(dim=1)  # (B,)
        scores = (per_func * weights).nansum(dim=1).masked_fill(unscorable, math.nan)  # (B,)
        groups = self.accelerator.gather(scores).view(-1, self._group_size(mode))  # (N / G, G)
        high = torch.where(torch.isnan(groups), -math.inf, groups).max(dim=1).values
        low = torch.where(torch.isnan(groups), math.inf, groups).min(dim=1).values
        uniform = ~(high > low)  # (N / G,); a group with fewer than two scorable rewards counts as uniform
        self._metrics[mode]["dynamic_sampling/dropped_groups"].append(float(uniform.sum()))
        self._metrics[mode]["dynamic_sampling/frac_dropped"].append(float(uniform.float().mean()))
        keep = (~uniform).repeat_interleave(self._group_size(mode))  # (N,)
        start = self.accelerator.process_index * len(scores)
        keep = keep[start:start + len(scores)].to(batch.response_mask.dtype)  # (B,)
        return replace(batch, response_mask=batch.response_mask * keep[:, None])
    def _check_reward_bound(self, rewards: torch.Tensor, prompts: list) -> None:
        """A finite reward beyond ``MAX_ABS_REWARD`` (PPO's bound) is an error naming its function, sample and value,
        before any update: a reward of 3e38 once overflowed the group statistics, every update was skipped as
        non-finite, and the run ended without naming the reward. ``rewards``: (B, F), NaN where unscorable."""
        beyond = rewards.abs() > MAX_ABS_REWARD  # (B, F); NaN compares False
        if bool(beyond.any()):
            row, col = beyond.nonzero()[0].tolist()
            raise ValueError(f"reward function {self.reward_func_names[col]!r} returned {float(rewards[row, col]):.6g} "
                             f"for sample {row} (prompt {str(prompts[row])[:80]!r}), beyond the bound |reward| <= "
                             f"{MAX_ABS_REWARD:.0e} (the advantages square it and would overflow float32): rescale "
                             f"the reward ({int(beyond.sum())} such rewards in this batch)")

    @torch.no_grad()
    def _reward_model_scores(self, model: Any, tokenizer: Any, prompts: list, completions: list) -> torch.Tensor:
        """A sequence classifier's first logit for each prompt + completion (chat template for conversations)."""
        if is_conversational(prompts[0]):
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(f"reward model {self._reward_name(model)!r}: conversational prompts need a "
                                 "tokenizer with a chat_template")
            texts = [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right",
                           add_special_tokens=False).to(self.args.device)
        return model(**inputs).logits[:, 0].float()

    def _advantages_for(self, per_func: torch.Tensor, batch: ModelBatch, old: torch.Tensor | None,
                        ref: torch.Tensor | None, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the rewards of all processes (groups may span them), compute advantages, keep this process's.

        Returns ``(advantages (B,), weighted scores (B,))``.
        """
        weights = self.reward_weights.to(per_func.device)
        unscorable = torch.isnan(per_func).all(dim=1)  # (B,)
        scores = (per_func * weights).nansum(dim=1).masked_fill(unscorable, math.nan)  # (B,)
        extra = self._reward_extras(batch, old, ref)  # (B, k) per-completion data the advantages need
        gathered = self.accelerator.gather(torch.cat([scores[:, None], extra], dim=1))  # (N, 1 + k)
        advantages = self._advantages(gathered[:, 0], gathered[:, 1:], mode)  # (N,)
        n = len(scores)
        start = self.accelerator.process_index * n
        return advantages[start:start + n], scores

    def _reward_extras(self, batch: ModelBatch, old: torch.Tensor | None, ref: torch.Tensor | None) -> torch.Tensor:
        """(B, 0) by default; RLOO adds each completion's sequence KL."""
        return batch.response_mask.new_zeros(len(batch), 0)

    def _advantages(self, scores: torch.Tensor, extras: torch.Tensor, mode: str) -> torch.Tensor:
        raise NotImplementedError

    def _policy_loss(self, logprobs: torch.Tensor, entropy: torch.Tensor, rollout: Rollout, mode: str
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's loss, already scaled for gradient accumulation, and detached stats."""
        raise NotImplementedError

    # ---- loss

    def compute_loss(self, model, inputs: Rollout, return_outputs: bool = False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        logprobs, entropy = inputs.policy_forward or self._loss_forward(model, inputs.batch)
        loss, stats = self._policy_loss(logprobs, entropy, inputs, mode)
        mask = inputs.batch.response_mask
        stats["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
        self._log_loss_stats(mode, stats, mask.sum())
        return (loss, None) if return_outputs else loss

    def _loss_forward(self, model: Any, batch: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The policy's (B, A) log-probs, with grad, and entropy: the forward whose loss is backpropagated."""
        with dropout_off(model, self.args.disable_dropout):
            with sparse_tied_embedding_grad(model):
                return token_logprobs_and_entropy(model, batch.trimmed(), with_entropy=True)

    def token_mean_stats(self) -> tuple[str, ...]:
        """Loss stats that are means over the micro-batch's completion tokens (subclasses add theirs)."""
        return ("entropy",)

    def _log_loss_stats(self, mode: str, stats: dict[str, torch.Tensor], tokens: torch.Tensor) -> None:
        """Reduce one micro-batch's stats over all processes as TRL 1.16 does.

        Keys ending in ``_min``/``_max`` hold one value per sequence (B,): the min/max over every process's
        sequences (NaN ignored). Keys in ``token_mean_stats`` are token means: weighted by each process's token
        count (``tokens``), so the result is the mean over all processes' tokens. The rest: plain mean over
        processes.
        """
        gather, token_means = self.accelerator.gather, self.token_mean_stats()
        for key, value in stats.items():
            value = value.detach().float()
            if key.endswith(("_min", "_max")):
                values = gather(value.reshape(-1))
                values = values[~torch.isnan(values)]
                reduced = math.nan if not len(values) else float(values.min() if key.endswith("_min") else values.max())
            elif key in token_means:
                weight = tokens.detach().float().reshape(1)
                weighted = torch.where(weight > 0, value.reshape(1) * weight, 0.0)  # no tokens: adds nothing
                totals = gather(torch.cat([weighted, weight]).reshape(1, 2)).sum(0)  # (2,)
                reduced = float(totals[0] / totals[1].clamp(min=1.0))
            else:
                reduced = float(gather(value.reshape(1)).nanmean())
            self._metrics[mode][key].append(reduced)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def grad_accumulation(self, mode: str) -> int:
        """Micro-batches per optimizer step (1 in evaluation)."""
        return self.current_gradient_accumulation_steps if mode == "train" else 1

    # ---- reference sync, logging

    card_fields = ("beta", "num_generations", "max_completion_length", "temperature", "num_iterations", "epsilon",
                   "epsilon_high", "loss_type", "scale_rewards", "normalize_advantages")

    def card_hyperparameters(self) -> dict[str, Any]:
        """The Trainer's hyper-parameters plus the sampling and loss fields of this method."""
        values = super().card_hyperparameters()
        values.update({name: getattr(self.args, name) for name in self.card_fields if hasattr(self.args, name)})
        values["reward_funcs"] = ", ".join(self.reward_func_names)
        return values

    @torch.no_grad()
    def sync_reference(self, alpha: float) -> None:
        """ref <- alpha * policy + (1 - alpha) * ref, parameter by parameter (TR-DPO's update)."""
        mix_into_reference(self.ref_model, self.accelerator.unwrap_model(self.model), alpha)

    def _log_rollout_stats(self, mode: str, per_func: torch.Tensor, scores: torch.Tensor, lengths: torch.Tensor,
                           truncated: torch.Tensor, prompt_tokens: torch.Tensor) -> None:
        """Reward and completion-length statistics of one generation batch (all processes), TRL 1.16's names.

        per_func (B, F), scores (B,), lengths (B,) completion tokens (EOS included), truncated (B,) no EOS,
        prompt_tokens () this process's prompt tokens. ``num_tokens``: prompt + completion tokens seen in training
        so far (``state.num_input_tokens_seen``, so it survives a resume).
        """
        metrics = self._metrics[mode]
        gather = self.accelerator.gather
        all_funcs, all_scores = gather(per_func), gather(scores)
        for i, name in enumerate(self.reward_func_names):
            metrics[f"rewards/{name}/mean"].append(float(torch.nanmean(all_funcs[:, i])))
            metrics[f"rewards/{name}/std"].append(float(_nan_std(all_funcs[:, i])))
        metrics["reward"].append(float(torch.nanmean(all_scores)))
        metrics["reward_std"].append(float(_nan_std(all_scores)))
        grouped_std = torch.stack([_nan_std(g) for g in all_scores.view(-1, self._group_size(mode))])
        zero_std = torch.isclose(grouped_std, torch.zeros_like(grouped_std)).float()
        metrics["frac_reward_zero_std"].append(float(zero_std.mean()))
        lengths, truncated = gather(lengths), gather(truncated.float())
        if mode == "train":
            self.state.num_input_tokens_seen += int(gather(prompt_tokens.reshape(1)).sum() + lengths.sum())
        metrics["num_tokens"] = [float(self.state.num_input_tokens_seen)]  # a running total: the latest value
        metrics["completions/mean_length"].append(float(lengths.mean()))
        metrics["completions/min_length"].append(float(lengths.min()))
        metrics["completions/max_length"].append(float(lengths.max()))
        terminated = lengths[truncated == 0]
        if not len(terminated):  # no completion ended with EOS: TRL 1.16 logs 0 for the three
            terminated = lengths.new_zeros(1)
        metrics["completions/mean_terminated_length"].append(float(terminated.mean()))
        metrics["completions/min_terminated_length"].append(float(terminated.min()))
        metrics["completions/max_terminated_length"].append(float(terminated.max()))
        metrics["completions/clipped_ratio"].append(float(truncated.mean()))

    def _group_size(self, mode: str) -> int:
        return self.num_generations if mode == "train" else self.num_generations_eval

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add the averages of this trainer's metrics since the last log (``eval_`` prefix in evaluation)."""
        mode = "train" if self.model.training else "eval"
        prefix = "eval_" if mode == "eval" else ""
        for key, values in self._metrics[mode].items():
            finite = [v for v in values if not math.isnan(v)]
            if finite:
                logs[prefix + key] = sum(finite) / len(finite)
        self._metrics[mode].clear()
        if self.args.log_completions and self._last_samples and self.is_world_process_zero():
            samples = self._last_samples
            if self.args.log_unique_prompts:
                samples = list({sample[0]: sample for sample in reversed(samples)}.values())[::-1]
            shown = samples[: self.args.num_completions_to_print or len(samples)]
            for prompt, completion, score, extras in shown:
                step = self.state.global_step
                extra = "".join(f" | {name}={value!r}" for name, value in extras.items())  # log_extra's columns
                print(f"[{self.trainer_name} step {step}] {score:+.3f} | {prompt!r} -> {completion!r}{extra}")
        super().log(logs, *args, **kwargs)


def _nan_std(values: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of the finite values (0 with fewer than two)."""
    finite = values[~torch.isnan(values)]
    return finite.std() if finite.numel() > 1 else values.new_zeros(())


__all__ = ["GroupRepeatSampler", "OnlineRLTrainer", "is_conversational", "token_logprobs_and_entropy"]
