"""``PPOTrainer``: the classic TRL PPO loop (Ziegler et al. 2019), built on ``accelerate``.

``step`` reads like the algorithm: validate -> score processing -> forward passes -> rewards
(per-token KL + score on the last real token) -> GAE -> minibatch epochs -> stats -> KL update.
The math lives in ``rlhf_core.losses`` and ``rlhf_core.core``; this module orchestrates it. Its package
(``rlhf_core.trainers.ppo``): ``validation`` (step/generate input checks), ``state`` (exact resume), ``loop``
(the run loop: generate -> score -> step over the dataloader), ``setup`` (accelerator config, tracker, optimizer,
collator), ``stats`` (the step's stats and their logging), ``hub`` (pushing to the Hub). Shared with the other
trainers: ``generation`` (sampling), ``experience`` (the typed batches), ``forward`` (the reference model) and
``timing`` (the phase timer).

As in classic TRL, every forward pass of ``step`` runs with dropout disabled (``model.eval()``), so
the first mini-batch's probability ratio is exactly 1 and rollout and learning see the same model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.utils.data import DataLoader

from rlhf_core.core import (
    WANDB_PADDING,
    convert_to_scalar,
    logprobs_from_logits,
    masked_whiten,
    set_seed,
    stack_dicts,
)
from rlhf_core.losses import gae_advantages, kl_penalty, per_token_rewards, ppo_losses
from rlhf_core.models.embedding_grads import sparse_tied_embedding_grad
from rlhf_core.models.fused_kernels import fuse_kernels, fuses_on
from rlhf_core.models.value_head import PreTrainedModelWrapper
from rlhf_core import checkpointing as ckpt
from rlhf_core.cpu_allocator import keep_freed_cpu_memory
from rlhf_core.tracking import Tracker, make_tracker
from rlhf_core.trainers.ppo import hub as ppo_hub, setup as ppo_setup, state as ppo_state, stats as ppo_stats
from rlhf_core.trainers.ppo.global_batch import global_masked_whiten, token_share
from rlhf_core.trainers.ppo.guards import UpdateGuard
from rlhf_core.trainers.generation import (
    DEFAULT_GENERATION_BATCH_SIZE,
    generate_batched,
    generate_single,
)
from rlhf_core.models.padding import pad_id_of
from rlhf_core.trainers.experience import (
    Experience,
    FirstMinibatch,
    ModelBatch,
    RolloutForward,
    build_causal_batch,
    build_seq2seq_batch,
    to_device,
)
from rlhf_core.trainers.forward import ResponseForward, decide_reference, eval_mode, reference_model, response_forward
from rlhf_core.trainers.master_weights import MasterWeights, bf16_by_default
from rlhf_core.kl_control import RunningMoments
from rlhf_core.trainers.ppo.config import PPOConfig
from rlhf_core.trainers.timing import phase_timer
from rlhf_core import transformers_compat
from rlhf_core.trainers.ppo.validation import (
    check_generate_queries,
    check_generation_lengths,
    check_movable,
    check_sequence_lengths,
    check_step_inputs,
    position_limit,
)

transformers_compat.install()  # TRL 0.11 PPO clients: sentiment pipelines with return_all_scores


# Where every process holds whole, already-synchronised gradients, so a local norm is the global one.
_PLAIN_GRADIENTS = (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)


class PPOTrainer:
    """Optimise a value-head language model with PPO from (query, response, score) triples."""

    # classic TRL's names for the push-if-best state, which ``push_if_best`` (a ``ppo_hub.PushIfBest``) owns
    push_to_hub_kwargs = ppo_hub.ClassicName()
    compare_step = ppo_hub.ClassicName()
    highest_reward = ppo_hub.ClassicName()

    def __init__(
        self,
        config: PPOConfig | None = None,
        model: PreTrainedModelWrapper | None = None,
        ref_model: PreTrainedModelWrapper | None = None,
        tokenizer=None,
        dataset=None,
        optimizer: torch.optim.Optimizer | None = None,
        data_collator: Callable | None = None,
        num_shared_layers: int | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        training_data_collator: Callable | None = None,
        tracker: Tracker | None = None,
    ):
        config = PPOConfig() if config is None else config
        self._check_init_arguments(config, model, ref_model, tokenizer)
        self.config = config
        set_seed(config.seed)
        self.accelerator = Accelerator(
            gradient_accumulation_steps=config.gradient_accumulation_steps,
            project_config=ppo_setup.project_configuration(config.project_kwargs), **config.accelerator_kwargs,
        )
        if self.accelerator.device.type == "cpu":
            keep_freed_cpu_memory()  # speed: fewer page faults for the step's large temporaries (exact)
        self.tokenizer = tokenizer
        self.is_encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
        self.is_peft_model = bool(getattr(model, "is_peft_model", False))
        config.is_encoder_decoder, config.is_peft_model = self.is_encoder_decoder, self.is_peft_model  # as classic TRL
        self.ref_model = self._resolve_reference(model, ref_model, num_shared_layers)
        self.model = model
        self.data_collator = data_collator
        self.training_data_collator = training_data_collator  # pads the model inputs (causal LMs), as in classic TRL
        if dataset is None:
            warnings.warn("No dataset is provided. Make sure to set config.batch_size to the correct value before "
                          "training.", UserWarning, stacklevel=2)
        self.dataset = dataset
        self.dataloader = None if dataset is None else self.prepare_dataloader(dataset, data_collator)
        if optimizer is None:
            optimizer = ppo_setup.default_adam([p for p in model.parameters() if p.requires_grad], config.learning_rate)
        self._master = self._bf16_weights(model, optimizer)
        self._norm_params: list[torch.Tensor] | None = None  # ``_gradient_norm``'s tensors, listed once
        self.kl_ctl = ppo_setup.kl_controller(config)
        self._prepare(model, optimizer, lr_scheduler)
        self.running = RunningMoments(self.accelerator)
        self.tracker = self._setup_tracker(tracker)
        self.push_if_best = ppo_hub.PushIfBest(config)
        self.current_step = 0
        self.guard = UpdateGuard(config.max_nonfinite_updates, config.ratio_threshold)  # skipped updates, ratio limit

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _check_init_arguments(config, model, ref_model, tokenizer) -> None:
        if not isinstance(config, PPOConfig):
            raise ValueError(f"config must be a PPOConfig, got {type(config).__name__}")
        if not isinstance(model, PreTrainedModelWrapper):
            raise ValueError(
                "model must be a value-head model (AutoModelForCausalLMWithValueHead or "
                f"AutoModelForSeq2SeqLMWithValueHead), got {type(model).__name__}"
            )
        if ref_model is not None and not isinstance(ref_model, PreTrainedModelWrapper):
            raise ValueError(f"ref_model must be a value-head model or None, got {type(ref_model).__name__}")
        if ref_model is not None and ref_model is model:
            raise ValueError("ref_model must not be the same object as model; pass None to build a frozen copy")
        if tokenizer is None or not hasattr(tokenizer, "pad"):
            raise ValueError("tokenizer must be a transformers tokenizer (PreTrainedTokenizerBase)")
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
            raise ValueError("tokenizer needs a pad_token or an eos_token to pad batches")

    def _bf16_weights(self, model, optimizer) -> MasterWeights | None:
        """``bf16_weights``: cast policy and reference to bf16, fp32 masters into the optimizer (before
        ``accelerate`` wraps the model, so DDP buckets the bf16 gradients). ``None`` is decided here
        (``master_weights.bf16_by_default``) and the decision written back into the config."""
        if self.config.bf16_weights is None:
            self.config.bf16_weights = self.accelerator.distributed_type in _PLAIN_GRADIENTS and bf16_by_default(
                self.accelerator.device, self.accelerator.mixed_precision, optimizer)
        if not self.config.bf16_weights:
            return None
        if self.accelerator.mixed_precision == "fp16":
            raise ValueError("PPOConfig.bf16_weights cannot be combined with mixed_precision='fp16'")
        if self.accelerator.distributed_type not in _PLAIN_GRADIENTS:
            raise ValueError(f"PPOConfig.bf16_weights is not supported with {self.accelerator.distributed_type}, "
                             "which keeps its own master weights; use its mixed-precision setting instead")
        master = MasterWeights(model, optimizer, torch.bfloat16)
        if self.ref_model is not None:
            self.ref_model.to(torch.bfloat16)
        return master

    def _prepare(self, model, optimizer, lr_scheduler) -> None:
        """Hand model, optimizer, scheduler and dataloader to accelerate; put the reference model on the device."""
        if self.config.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable()
        if fuses_on(self.accelerator.device):  # fused GELU / RMSNorm / rotary on CUDA (the CPU stays byte-identical)
            fuse_kernels(model)
            fuse_kernels(self.ref_model)
        self.model, self.optimizer, self.lr_scheduler = self.accelerator.prepare(model, optimizer, lr_scheduler)
        if self.dataloader is not None:
            self.dataloader = ppo_state.track_data_position(
                self.accelerator.prepare(self.dataloader), self.config.batch_size * self.accelerator.num_processes)
        if self.ref_model is not None:
            self.ref_model = self.ref_model.to(self.accelerator.device)
        if self._master is not None:
            self._master.to(self.accelerator.device)
        if self.config.torch_compile:
            ppo_setup.compile_transformers(self.accelerator.unwrap_model(self.model), self.ref_model)

    def _setup_tracker(self, tracker: Tracker | None) -> Tracker:
        """``tracker=`` (a ready Tracker), else the one ``config.log_with`` names; a no-op one off the main
        process. The main process logs the config as the run's parameters."""
        if not self.accelerator.is_main_process:
            return make_tracker(None)
        if tracker is None:
            tracker = ppo_setup.build_tracker(self.config)
        tracker.log_params(self.config.to_dict())
        return tracker

    def _resolve_reference(self, model, ref_model, num_shared_layers):
        if ref_model is not None and num_shared_layers is not None:
            warnings.warn("num_shared_layers is ignored because a ref_model was passed", stacklevel=3)
        reference = decide_reference(model, ref_model, num_shared_layers=num_shared_layers)
        return reference.model.eval() if ref_model is not None else reference.model

    def prepare_dataloader(self, dataset, data_collator: Callable | None = None) -> DataLoader:
        """A shuffled dataloader of ``batch_size`` rows (last partial batch dropped).

        The shuffle is a ``ResumableRandomSampler`` (epoch-seeded by ``config.seed``): its position is part
        of ``save_state``, so a resumed run sees the same batches as a straight one.
        """
        import datasets

        if isinstance(dataset, datasets.Dataset) and self.config.remove_unused_columns:
            dataset = self._remove_unused_columns(dataset)
        return DataLoader(
            dataset, batch_size=self.config.batch_size, collate_fn=data_collator or ppo_setup.list_collator,
            sampler=ckpt.ResumableRandomSampler(len(dataset), seed=self.config.seed), drop_last=True,
            generator=torch.Generator().manual_seed(self.config.seed),  # iterators never draw from the global RNG
        )

    def _remove_unused_columns(self, dataset):
        """Keep the columns the model's forward takes, plus ``label``, ``query`` and ``response``."""
        signature = list(inspect.signature(self.accelerator.unwrap_model(self.model).forward).parameters)
        keep = set(signature) | {"input_ids", "attention_mask", "label", "query", "response"}
        unused = [name for name in dataset.column_names if name not in keep]
        return dataset.remove_columns(unused) if unused else dataset

    # ------------------------------------------------------------------ generation

    @torch.no_grad()
    def generate(
        self,
        query_tensor: torch.Tensor | list[torch.Tensor],
        length_sampler: Callable[[], int] | None = None,
        batch_size: int = DEFAULT_GENERATION_BATCH_SIZE,
        return_prompt: bool = True,
        generate_ref_response: bool = False,
        **generation_kwargs,
    ):
        """Generate responses for one query (1-d tensor) or a list of queries.

        A list is generated in left-padded batches of ``batch_size`` (default 64; classic TRL used 4,
        which leaves most of a CPU or GPU idle per decoding step); each response is cut after its
        first EOS (kept) and never contains padding. A 1-d tensor returns the raw (1, L) output.
        """
        check_generate_queries(query_tensor)
        if isinstance(query_tensor, (list, tuple)):
            run = lambda model: generate_batched(  # noqa: E731
                self.accelerator.unwrap_model(model), self.tokenizer, list(query_tensor), device=self.accelerator.device,
                batch_size=batch_size, length_sampler=length_sampler, return_prompt=return_prompt,
                is_encoder_decoder=self.is_encoder_decoder, prepack_weights=self.config.prepacked_generation,
                mixed_precision=self.accelerator.mixed_precision, **generation_kwargs)
        else:
            if query_tensor.dim() != 1:
                raise ValueError(
                    f"query_tensor must be a 1-d tensor (seq_len,) or a list of them, got shape {tuple(query_tensor.shape)}"
                )
            if length_sampler is not None:
                generation_kwargs["max_new_tokens"] = length_sampler()
            run = lambda model: generate_single(  # noqa: E731
                self.accelerator.unwrap_model(model), self.tokenizer, query_tensor, device=self.accelerator.device,
                return_prompt=return_prompt, is_encoder_decoder=self.is_encoder_decoder, **generation_kwargs)
        self._check_generation_lengths(query_tensor, generation_kwargs)
        response = run(self.model)
        if not generate_ref_response:
            return response
        with self._reference() as ref_model:
            return response, run(ref_model)

    def _check_generation_lengths(self, query_tensor, generation_kwargs) -> None:
        """Refuse queries that cannot fit ``max_new_tokens`` more tokens in the model's positions (as ``step`` does).

        Without ``max_new_tokens`` (a per-chunk ``length_sampler``, or ``max_length``) the queries alone must fit."""
        queries = list(query_tensor) if isinstance(query_tensor, (list, tuple)) else [query_tensor]
        check_movable(queries, "query_tensor", self.accelerator.device)
        check_generation_lengths(queries, generation_kwargs.get("max_new_tokens"), self._position_limit(),
                                 self.is_encoder_decoder)

    def _reference(self):
        """Context yielding the reference: the policy with its adapter disabled (PEFT), else ``ref_model``."""
        return reference_model(self.accelerator, self.model, self.ref_model, adapter_off=self.is_peft_model)

    # ------------------------------------------------------------------ the PPO step

    def step(
        self,
        queries: list[torch.LongTensor],
        responses: list[torch.LongTensor],
        scores: list[torch.FloatTensor],
        response_masks: list[torch.LongTensor] | None = None,
    ) -> dict[str, Any]:
        """Run one PPO optimisation step on a batch of queries, responses and scalar scores."""
        timing: dict[str, float] = {}
        with phase_timer(timing, "total"):
            queries, responses, scores, response_masks = self._step_safety_checker(
                self.config.batch_size, queries, responses, scores, response_masks)
            self._check_sequence_lengths(queries, responses)
            scores = self._process_scores(scores)  # (B,)
            self.push_if_best.update(scores, self.push_to_hub)  # the method: subclasses and tests may replace it
            self._dropout_off()
            batch = self.prepare_model_inputs(queries, responses, response_masks)
            first = self._first_minibatch() if self._reuses_rollout_forward() else None
            with phase_timer(timing, "forward_pass"):
                old = self._rollout_forward(batch, first)
            with phase_timer(timing, "compute_rewards"):
                rewards, non_score, kls = self.compute_rewards(
                    scores, old.logprobs, old.ref_logprobs, batch.response_mask, old.full_logprobs,
                    old.ref_full_logprobs)
            with phase_timer(timing, "compute_advantages"):
                values, advantages, returns = self.compute_advantages(old.values, rewards, batch.response_mask)
            experience = Experience(
                logprobs=old.logprobs, ref_logprobs=old.ref_logprobs, values=values, rewards=rewards,
                non_score_rewards=non_score, kls=kls, advantages=advantages, returns=returns)
            with phase_timer(timing, "optimize_step"):
                train_stats = self._optimise(batch, experience, first)
                skipped = self.guard.finish_step()  # the loop's guard flags, read once
            with phase_timer(timing, "calc_stats"):
                stats = self._step_stats(batch, experience, scores, queries, responses, train_stats, skipped)
            self.kl_ctl.update(stats["objective/kl"], self.config.batch_size * self.accelerator.num_processes)
            self._advance_schedule()
        stats.update(timing)
        if self.config.optimize_device_cache:
            ppo_setup.empty_device_cache()
        return convert_to_scalar(stats)

    def _dropout_off(self) -> None:
        """The policy and the reference in eval mode for the step (``forward.eval_mode``; the step's forwards only
        re-check the top-level flag, ``_forward_batch``)."""
        eval_mode(self.model, self.ref_model)

    def _step_stats(self, batch: ModelBatch, experience: Experience, scores, queries, responses, train_stats,
                    skipped: int):
        """The step's stats as numpy: ``record_step_stats`` gathered over processes, plus lr and ``skipped``."""
        stats = self.record_step_stats(
            kl_coef=self.kl_ctl.value, scores=scores, logprobs=experience.logprobs,
            ref_logprobs=experience.ref_logprobs, non_score_reward=experience.non_score_rewards,
            train_stats=train_stats, masks=batch.response_mask, queries=queries, responses=responses,
            kls=experience.kls)
        stats = self.gather_stats(ppo_stats.with_sequence_logprobs(stats, batch, experience))
        return ppo_stats.finish_step_stats(stats, self.optimizer.param_groups[0]["lr"], skipped)

    def _advance_schedule(self) -> None:
        """After a step: the lr scheduler steps once and the step counter moves on."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.current_step += 1

    # ------------------------------------------------------------------ input checks (rlhf_core.trainers.ppo.validation)

    def _step_safety_checker(self, batch_size, queries, responses, scores, response_masks=None):
        """Check the step inputs and move them to the device; raise ``ValueError`` on bad input."""
        return check_step_inputs(batch_size, queries, responses, scores, response_masks, vocab=self._vocab_size(),
                                 device=self.accelerator.device, is_encoder_decoder=self.is_encoder_decoder)

    def _vocab_size(self) -> int:
        # Looked up once per step: unwrap_model probes installed packages on every call (~1 ms each,
        # 7% of a tiny-model step when done per tensor; bench/profile_step.py).
        return self.accelerator.unwrap_model(self.model).pretrained_model.get_input_embeddings().num_embeddings

    def _check_sequence_lengths(self, queries, responses) -> None:
        """Raise ``ValueError`` when a query + response exceeds the model's position limit."""
        check_sequence_lengths(queries, responses, self._position_limit(), self.is_encoder_decoder)

    def _position_limit(self) -> int | None:
        return position_limit(self.accelerator.unwrap_model(self.model).pretrained_model)

    # ------------------------------------------------------------------ score processing, model inputs

    def _process_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Optional running-moment scaling/normalisation, then optional clipping."""
        if self.config.use_score_scaling:
            self.running.update(scores)
            scale = self.running.std + torch.finfo(scores.dtype).eps
            scores = (scores - self.running.mean) / scale if self.config.use_score_norm else scores / scale
        if self.config.score_clip is not None:
            scores = scores.clamp(-self.config.score_clip, self.config.score_clip)
        return scores

    def prepare_model_inputs(self, queries, responses, response_masks=None) -> ModelBatch:
        """Pad the pairs into model inputs: the tokenizer's padding side, or ``training_data_collator`` if given."""
        left = self.tokenizer.padding_side == "left"
        if self.is_encoder_decoder:
            return build_seq2seq_batch(queries, responses, pad_id_of(self.tokenizer), left, response_masks)
        return build_causal_batch(queries, responses, pad_id_of(self.tokenizer), left, response_masks,
                                  collate=self.training_data_collator)

    # ------------------------------------------------------------------ forward passes

    def _reuses_rollout_forward(self) -> bool:
        """Whether the first PPO mini-batch reuses the rollout's policy forward (speed; same values).

        Its weights are the rollout's, so a forward with gradients during the rollout gives the old log-probs
        of those rows and the first update's graph at once: one policy forward per step fewer. One process
        only: under DDP the forward must run inside the accumulation context of its backward.
        """
        return self.accelerator.distributed_type == DistributedType.NO

    def _first_minibatch(self) -> FirstMinibatch:
        """The first epoch's row order, drawn before the rollout (the same numpy draw ``_optimise`` would make)."""
        order = torch.from_numpy(np.random.permutation(self.config.batch_size))
        return FirstMinibatch(order=order, rows=order[: self.config.mini_batch_size])

    def _policy_rollout(self, batch: ModelBatch, full: bool, first: FirstMinibatch | None) -> ResponseForward:
        """The policy's (B, A) log-probs and values (and (B, A, V) logits when ``full``), without gradients.

        With ``first``: its rows are forwarded with gradients and their outputs kept in ``first.forward``
        for the first mini-batch update; the other rows are forwarded without, as before.
        """
        if first is None:
            with torch.no_grad():
                return self._forward_batch(self.model, batch, logits=full)
        rows = first.rows.numpy()
        rest = np.setdiff1d(np.arange(len(batch)), rows)
        with self._embedding_grad_context():
            first.forward = self._forward_batch(self.model, batch.rows(rows), entropy=True, logits=full)
        with torch.no_grad():
            others = self._forward_batch(self.model, batch.rows(rest), logits=full) if len(rest) else None
        device = self.accelerator.device
        kept_rows, rest_rows = to_device(rows, device), to_device(rest, device)
        merged = {}
        for name in ("logprobs", "values", "logits") if full else ("logprobs", "values"):
            kept = getattr(first.forward, name)
            out = kept.new_empty((len(batch), *kept.shape[1:]))
            out[kept_rows] = kept.detach()
            if others is not None:
                out[rest_rows] = getattr(others, name)
            merged[name] = out
        return ResponseForward(**merged)

    def _rollout_forward(self, batch: ModelBatch, first: FirstMinibatch | None = None) -> RolloutForward:
        """Old log-probs and values from the policy, reference log-probs from the reference (no gradients,
        except the first mini-batch's policy forward when ``first`` is given: ``_policy_rollout``)."""
        full = self.config.kl_penalty == "full"
        policy = self._policy_rollout(batch, full, first)
        with torch.no_grad(), self._reference() as ref_model:
            ref = self._forward_batch(ref_model, batch, logits=full)
        if not full:
            return RolloutForward(logprobs=policy.logprobs, values=policy.values, ref_logprobs=ref.logprobs)
        return RolloutForward(logprobs=policy.logprobs, values=policy.values, ref_logprobs=ref.logprobs,
                              full_logprobs=logprobs_from_logits(policy.logits, None, gather=False),  # (B, A, V)
                              ref_full_logprobs=logprobs_from_logits(ref.logits, None, gather=False))  # (B, A, V)

    def batched_forward_pass(self, model, queries, responses, model_inputs=None, return_logits: bool = False,
                             response_masks=None):
        """Classic TRL's forward pass: ``(logprobs, logits, values, masks)`` in the padded layout.

        logprobs, values and masks are (B, T-1) and logits (B, T-1, V) (``None`` unless ``return_logits``),
        where column t scores token t+1 of the padded sequence (the decoder sequence for encoder-decoders);
        masks is 1 on the (unmasked) response tokens. ``model_inputs`` is accepted for the classic signature
        (a ``ModelBatch`` from ``prepare_model_inputs`` is used as is; anything else is rebuilt from
        ``queries``/``responses`` so inputs and tokens always agree). Runs in ``mini_batch_size`` chunks;
        gradients flow unless called under ``torch.no_grad()``, as in classic TRL.
        """
        batch = model_inputs if isinstance(model_inputs, ModelBatch) else \
            self.prepare_model_inputs(list(queries), list(responses), response_masks)
        eval_mode(model)  # classic TRL semantics: no dropout in PPO forward passes
        forward = self._forward_batch(model, batch, logits=return_logits)
        width = batch.model_inputs[batch.token_ids_key].shape[1] - 1  # T-1
        scatter = batch.scatter_to_sequence
        padded_logits = scatter(forward.logits, width) if return_logits else None
        return (scatter(forward.logprobs, width), padded_logits, scatter(forward.values, width),
                scatter(batch.response_mask, width))

    def _forward_batch(self, model, batch: ModelBatch, *, entropy: bool = False, logits: bool = False
                       ) -> ResponseForward:
        """Log-probs and values (B, A), and the entropy (B, A) and logits (B, A, V) when asked, in
        ``mini_batch_size`` chunks of rows (``forward.response_forward``; the LM head from the first scored
        position on, ``positions="suffix"``: the rows PPO has always used, so its results stay byte-identical)."""
        chunk = self.config.mini_batch_size
        if model.training:  # put in eval mode by the caller (``_dropout_off``); a train() since is undone
            model.eval()
        parts = [response_forward(model, batch.rows(np.arange(i, min(i + chunk, len(batch)))).trimmed(),
                                  positions="suffix", entropy=entropy, logits=logits)
                 for i in range(0, len(batch), chunk)]
        if len(parts) == 1:  # a PPO mini-batch: no copy
            return parts[0]
        return ResponseForward(**{name: None if getattr(parts[0], name) is None else
                                  torch.cat([getattr(p, name) for p in parts])
                                  for name in ("logprobs", "values", "entropy", "logits")})

    # ------------------------------------------------------------------ rewards and advantages

    def _kl_penalty(self, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        """Per-token KL estimate of the configured ``kl_penalty`` (classic TRL's private name).

        ``kl``/``abs``/``mse``: gathered log-probs (B, A) -> (B, A); ``full``: log-softmax (B, A, V) -> (B, A).
        """
        return kl_penalty(logprob, ref_logprob, self.config.kl_penalty)

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks, full_logprobs=None, ref_full_logprobs=None):
        """Per-token rewards, the KL part alone, and the per-token KL: all (B, A)."""
        if self.config.kl_penalty == "full":
            kls = self._kl_penalty(full_logprobs, ref_full_logprobs)
        else:
            kls = self._kl_penalty(logprobs, ref_logprobs)
        rewards, non_score = per_token_rewards(scores, kls, masks, self.kl_ctl.value)
        return rewards, non_score, kls

    def compute_advantages(self, values, rewards, mask):
        """GAE advantages (whitened), returns and masked values: all (B, A). Under several processes the
        whitening's mean and variance are those of every process's tokens (``ppo.global_batch``)."""
        whiten = masked_whiten
        if self.accelerator.num_processes > 1:
            whiten = functools.partial(global_masked_whiten, reduce=self._sum_over_processes)
        return gae_advantages(values, rewards, mask, self.config.gamma, self.config.lam, self.config.whiten_rewards,
                              whiten=whiten)

    def _sum_over_processes(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, "sum")

    # ------------------------------------------------------------------ minibatch epochs

    def _optimise(self, batch: ModelBatch, experience: Experience,
                  first: FirstMinibatch | None = None) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` passes of shuffled mini-batches; returns the stacked mini-batch stats.

        ``first`` (``_first_minibatch``): the first epoch's row order, and the first mini-batch's forward kept
        from the rollout. Nothing in the loop reads a tensor on the host (the guards are device flags,
        ``ppo.guards``), except ``early_stopping``'s KL check once per epoch.
        """
        all_stats: list[dict[str, torch.Tensor]] = []
        cfg = self.config
        for epoch in range(cfg.ppo_epochs):
            order = first.order.numpy() if first is not None and epoch == 0 else np.random.permutation(cfg.batch_size)
            for start in range(0, cfg.batch_size, cfg.mini_batch_size):
                rows = order[start:start + cfg.mini_batch_size]
                kept = first.take_forward() if first is not None and epoch == 0 and start == 0 else None
                all_stats.append(self._minibatch_update(batch.rows(rows), experience.rows(rows), kept))
            if cfg.early_stopping and self._early_stop(all_stats[-1]["policy/policykl"]):
                break
        stacked = stack_dicts(all_stats)
        for key in ("policy/advantages", "policy/ratio"):  # keep every value, do not average
            stacked[key] = torch.nan_to_num(torch.flatten(stacked[key]).unsqueeze(0), WANDB_PADDING)
        return stacked

    def _minibatch_update(self, batch: ModelBatch, old: Experience, forward: ResponseForward | None = None
                          ) -> dict[str, torch.Tensor]:
        """Forward the mini-batch with gradients (unless ``forward`` holds it already), then ``train_minibatch``
        (inside gradient accumulation)."""
        with self.accelerator.accumulate(self.model):
            if forward is None:
                with self._embedding_grad_context():
                    forward = self._forward_batch(self.model, batch, entropy=True)
            # the (b, A) entropy stands where classic TRL passes the (b, A, V) logits (only the entropy stat reads them)
            stats = self.train_minibatch(old.logprobs, old.values, forward.logprobs, forward.entropy, forward.values,
                                         batch.response_mask, old.advantages, old.returns)
        for key in ("policy/advantages", "policy/ratio"):  # per-token stats in classic TRL's (b, T-1) layout
            stats[key] = batch.scatter_to_sequence(stats[key])
        return stats

    def _embedding_grad_context(self):
        """The sparse tied-embedding gradient (speed, exact) in eager mode only: inductor fails to trace the
        sparse lookup gradient (an internal assert in torch 2.13), so compiled models keep the dense one."""
        if self.config.torch_compile:
            return contextlib.nullcontext()
        return sparse_tied_embedding_grad(self.model)

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns):
        """Loss, backward and (at accumulation boundaries) an optimizer step for one mini-batch (classic signature).

        ``logprobs``/``vpreds`` come from a forward pass with gradients; every argument shares one layout,
        (b, A) here or classic TRL's (b, T-1); ``logits`` is that forward's (b, A, V) logits or, as this trainer
        passes it, its (b, A) entropy (only the entropy stat reads it). A non-finite loss or gradient norm skips
        the optimizer step (weights and optimizer state as if it never ran; the stats' NaNs become 0) and is
        counted; ``max_nonfinite_updates`` skips in a row stop the run with an error when the step ends. The
        checks are device flags read once per step (``ppo.guards``).
        """
        loss_p, loss_v, stats = self.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)
        loss = loss_p + loss_v
        bad_loss = self.guard.observe_loss(loss)
        self.accelerator.backward(loss)
        if self._master is not None:
            self._master.grads_to_masters()  # fp32 accumulation; the norm, clipping and update act on the masters
        if self.accelerator.sync_gradients:
            skip = self.guard.at_optimizer_step(self._gradient_norm())
            self.guard.step_optimizer(self.optimizer, skip, self.accelerator.scaler)
            if self._master is not None:
                self._master.masters_to_params()  # a skipped step left the masters as they were
            bad_loss = bad_loss | skip
        self.optimizer.zero_grad()  # the accelerator only really zeroes at accumulation boundaries
        return {key: torch.where(bad_loss, torch.nan_to_num(value), value) for key, value in stats.items()}

    def _gradient_norm(self):
        """The total gradient norm (the non-finite guard reads it), clipped to ``max_grad_norm`` when set.

        Without ``max_grad_norm`` the norm is only measured: ``clip_grad_norm_`` with an infinite bound would
        also multiply every gradient by 1.0 (3% of a GPT-2-small step, bench/profile_step.py). Sharded
        engines (DeepSpeed, FSDP) keep their own norm computation.
        """
        if self._norm_params is None:  # parameters() walks every module: list them once, not per update
            self._norm_params = self._master.masters if self._master is not None else list(self.model.parameters())
        params = self._norm_params
        if self.config.max_grad_norm is not None or self.accelerator.distributed_type not in _PLAIN_GRADIENTS:
            max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else float("inf")
            return self.accelerator.clip_grad_norm_(params, max_norm)
        self.accelerator.unscale_gradients()  # fp16 loss scaling: measure the true gradients
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns):
        """Clipped policy loss and ``vf_coef`` x clipped value loss; zeroed past ``ratio_threshold``.

        ``logits``: the (b, A, V) logits or the (b, A) entropy (the entropy stat's input, ``ppo_losses``). The
        threshold is applied on the device (a 0/1 factor) and warned about when the step ends (``ppo.guards``).
        """
        # logits feed only the entropy stat there: detached, it is computed without a graph (same values)
        pg_loss, vf_loss, stats = ppo_losses(
            old_logprobs, values, logits.detach(), vpreds, logprobs, mask, advantages, returns,
            self.config.cliprange, self.config.cliprange_value,
        )
        keep = self.guard.ratio_keep(stats.pop("policy/ratio_mean"))
        pg_loss, vf_loss = pg_loss * keep, vf_loss * keep
        loss_v = self.config.vf_coef * vf_loss
        stats.update({"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), "loss/total": (pg_loss + loss_v).detach()})
        if self.accelerator.num_processes > 1:  # the global mini-batch's token mean, once DDP averages (global_batch)
            share = token_share(mask, self._sum_over_processes, self.accelerator.num_processes).to(pg_loss.dtype)
            pg_loss, loss_v = pg_loss * share, loss_v * share
        return pg_loss, loss_v, stats

    def _early_stop(self, policykl: torch.Tensor) -> bool:
        """True when the policy KL of the last mini-batch exceeds 1.5 x ``target_kl`` (on any process): one host
        read per epoch, the only one of the loop (leaving it early needs the answer on the host)."""
        exceeded = (policykl > 1.5 * self.config.target_kl).to(self.accelerator.device, torch.float32)
        if self.accelerator.num_processes > 1:
            exceeded = self.accelerator.reduce(exceeded, "max")
        if bool(exceeded):
            self.optimizer.zero_grad()
            return True
        return False

    # ------------------------------------------------------------------ stats and logging

    def record_step_stats(self, kl_coef: float, **data) -> dict[str, Any]:
        """The classic stats dict: objective/*, ppo/*, tokens/* (tensors and arrays); see ``ppo.stats``."""
        return ppo_stats.record_step_stats(kl_coef, **data)

    def gather_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """Average tensor stats over all processes (identity in a single process)."""
        return ppo_stats.gather_stats(stats, self.accelerator)

    def log_stats(self, stats: dict, batch: dict, rewards, columns_to_log: Sequence[str] = ("query", "response")) -> None:
        """Log scalar stats, reward mean/std and a table of the batch's texts with their rewards."""
        rewards = ppo_stats.gather_rewards(rewards, self.accelerator)  # (B * processes,)
        ppo_stats.check_columns(batch, columns_to_log)
        if not self.accelerator.is_main_process:
            return
        self.tracker.log(ppo_stats.reward_logs(stats, rewards), step=self.current_step)
        self.tracker.log_table("game_log", [*columns_to_log, "reward"],
                               ppo_stats.game_log_rows(batch, columns_to_log, rewards), step=self.current_step)

    # ------------------------------------------------------------------ pushing to the Hub (rlhf_core.trainers.ppo.hub)

    def push_to_hub(self, repo_id: str, **kwargs) -> Any:
        """Push the policy (value head included) and tokenizer to the Hub repo ``repo_id`` (needs a network)."""
        return ppo_hub.push_to_hub(self, repo_id, **kwargs)

    # ------------------------------------------------------------------ saving

    def create_model_card(self, path: str, model_name: str | None = "TRL Model") -> None:
        """Write a model card (README.md) describing the PPO run into ``path``."""
        from rlhf_core.model_card import write_model_card

        write_model_card(
            path, model_name=model_name or "TRL Model", trainer_name="PPO",
            base_model=self.config.model_name, hyperparameters=self.config.to_dict(),
            notes="Trained with rlhf_core.PPOTrainer (classic TRL PPO: per-token KL penalty, GAE, clipped losses).",
        )

    def save_pretrained(self, save_directory: str) -> None:
        """Save the policy (safetensors, value head included), the tokenizer and a model card."""
        if not self.accelerator.is_main_process:
            return
        self.accelerator.unwrap_model(self.model).save_pretrained(save_directory)
        self.tokenizer.save_pretrained(save_directory)
        self.create_model_card(save_directory)

    def _save_pretrained(self, save_directory: str) -> None:
        """Alias kept for classic-TRL compatibility."""
        self.save_pretrained(save_directory)

    # ------------------------------------------------------------------ exact resume (rlhf_core.trainers.ppo.state)

    def save_state(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Write everything a run needs to continue exactly, atomically, into the directory ``path``.

        Policy + value head (``model.safetensors``), optimizer and scheduler (``torch.save``, read back with
        ``weights_only=True``), RNG states, KL-controller value, running score moments, step counter,
        dataloader position and ``extra`` (JSON-able state of the caller's loop) in ``trainer_state.json``.
        """
        ppo_state.save_state(self, path, extra)

    def load_state(self, path: str) -> dict[str, Any]:
        """Restore a ``save_state`` checkpoint into this trainer (built with the same arguments); returns ``extra``."""
        return ppo_state.load_state(self, path)
