"""RewardTrainer: pairwise (Bradley-Terry) reward-model training, a ``transformers.Trainer`` subclass.

Each batch is stacked ``[chosen; rejected]`` (2B, T) for one forward pass and split with ``chunk(2)``.
The reward of a sequence is the score head read at its last real token (``core.gather_last_token``),
so left and right padding give the same reward. The loss is ``losses.pairwise_reward_loss``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Unpack

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments

from rlhf_core.data_utils import is_conversational, maybe_apply_chat_template
from rlhf_core.losses import pairwise_reward_loss
from rlhf_core.models.reward_model import sequence_scores
from rlhf_core.trainers.base import (
    RlhfTrainerMixin,
    TrackingOptions,
    check_tracking,
    default_training_args,
    load_model,
    load_tokenizer_for,
    resolve_processing_class,
    wrap_peft,
    without_eval_strategy,
)
from rlhf_core.trainers.collators import RewardDataCollatorWithPadding

logger = logging.getLogger(__name__)

REWARD_COLUMNS = ("input_ids_chosen", "attention_mask_chosen", "input_ids_rejected", "attention_mask_rejected")
TEXT_COLUMNS = ("chosen", "rejected")
DEFAULT_MAX_LENGTH = 512


@dataclass
class RewardConfig(TrainingArguments):
    """``TrainingArguments`` plus the reward trainer's own fields."""

    max_length: int | None = field(default=None, metadata={"help": "Longest chosen/rejected sequence kept (tokens)."})
    """Longest chosen/rejected sequence kept, in tokens; longer pairs are dropped (default 512)."""
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    """Processes for ``datasets.map`` when tokenising text pairs (None: in-process)."""
    center_rewards_coefficient: float | None = field(default=None, metadata={"help": "Weight of mean((r_c + r_r)^2)."})
    """Weight of the reward-centring term ``mean((r_c + r_r)^2)``; None disables it."""


def compute_accuracy(eval_pred: Any) -> dict[str, float]:
    """Fraction of pairs whose chosen reward is strictly above the rejected one: predictions (N, 2)."""
    predictions = np.asarray(eval_pred.predictions if hasattr(eval_pred, "predictions") else eval_pred[0])
    return {"accuracy": float(np.mean(predictions[:, 0] > predictions[:, 1]))}


def tokenize_pair(example: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """Text convenience: ``prompt`` (optional) + ``chosen``/``rejected`` -> the four reward columns (EOS appended)."""
    prompt = example.get("prompt") or ""
    out: dict[str, list[int]] = {}
    for side in TEXT_COLUMNS:
        ids = tokenizer(prompt + example[side], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
            ids = ids + [tokenizer.eos_token_id]
        out[f"input_ids_{side}"] = ids
        out[f"attention_mask_{side}"] = [1] * len(ids)
    return out


def prepare_reward_dataset(dataset: Any, tokenizer: Any, max_length: int, num_proc: int | None = None) -> Any:
    """Tokenise text pairs if given, and drop pairs longer than ``max_length``.

    Text data (a ``chosen`` or ``rejected`` column) without both text columns is refused here, naming the
    missing columns. Other data without the four reward columns is passed on with a warning, as TRL 0.11
    does: a custom ``data_collator`` may read it, and the default collator raises a ``ValueError`` naming
    the missing columns when ``train()`` or ``evaluate()`` reaches it.
    """
    if dataset is None or not hasattr(dataset, "column_names"):
        return dataset
    columns = set(dataset.column_names)
    if not set(REWARD_COLUMNS) <= columns and set(TEXT_COLUMNS) <= columns:
        if tokenizer is None:
            raise ValueError("text reward data (chosen/rejected) needs tokenizer= to be tokenised")
        first = next(iter(dataset), None)  # no len() on a streamed (iterable) dataset
        if first is not None and is_conversational({"chosen": first["chosen"]}):
            # as TRL 0.11.4's RewardTrainer: conversational pairs rendered with the chat template first
            dataset = dataset.map(maybe_apply_chat_template, fn_kwargs={"tokenizer": tokenizer}, num_proc=num_proc)
        dataset = dataset.map(lambda ex: tokenize_pair(ex, tokenizer), num_proc=num_proc)
        columns = set(dataset.column_names)
    missing = [c for c in REWARD_COLUMNS if c not in columns]
    if missing and columns & set(TEXT_COLUMNS):
        raise ValueError(
            f"reward dataset is missing the columns {missing}; give {list(REWARD_COLUMNS)} "
            f"(or text columns chosen/rejected with an optional prompt). Found: {sorted(columns)}"
        )
    if missing:
        warnings.warn(
            f"reward dataset has none of the text columns {list(TEXT_COLUMNS)} and lacks the columns {missing} "
            f"(found {sorted(columns)}): the default RewardDataCollatorWithPadding will raise a ValueError on its "
            "first batch; give those columns or a data_collator= that reads yours",
            UserWarning, stacklevel=3,
        )
        return dataset
    before = len(dataset)
    dataset = dataset.filter(
        lambda ex: len(ex["input_ids_chosen"]) <= max_length and len(ex["input_ids_rejected"]) <= max_length,
        num_proc=num_proc,
    )
    if len(dataset) == 0 and before > 0:
        raise ValueError(f"every reward pair is longer than max_length={max_length} tokens; raise max_length")
    if len(dataset) < before:
        logger.warning(
            "RewardTrainer dropped %d of %d pairs longer than max_length=%d", before - len(dataset), before, max_length
        )
    return dataset


class RewardTrainer(RlhfTrainerMixin, Trainer):
    """Trains a one-output sequence classifier so that ``r(chosen) > r(rejected)`` (``tokenizer=`` accepted)."""

    trainer_name = "reward"
    _tag_names = ["trl", "reward-trainer"]

    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        model_init: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        max_length: int | None = None,
        peft_config: Any = None,
        center_rewards_coefficient: float | None = None,
        model_init_kwargs: Mapping[str, Any] | None = None,
        processing_class: Any = None,
        **tracking: Unpack[TrackingOptions],
    ) -> None:
        tracking = check_tracking(type(self).__name__, tracking)
        args = default_training_args(args, self.trainer_name)
        # none given: the one saved beside a model given by name/path (TRL 1.x's RewardTrainer("Qwen/...") does this)
        tokenizer = load_tokenizer_for(model, resolve_processing_class(tokenizer, processing_class))
        if model_init_kwargs is None and isinstance(model, str):
            model_init_kwargs = {"num_labels": 1}
        model = wrap_peft(load_model(model, AutoModelForSequenceClassification, model_init_kwargs), peft_config)
        self._check_one_output(model)
        self.max_length = max_length or getattr(args, "max_length", None) or DEFAULT_MAX_LENGTH
        self.center_rewards_coefficient = (
            center_rewards_coefficient if center_rewards_coefficient is not None
            else getattr(args, "center_rewards_coefficient", None)
        )
        num_proc = getattr(args, "dataset_num_proc", None)
        train_dataset = prepare_reward_dataset(train_dataset, tokenizer, self.max_length, num_proc)
        if isinstance(eval_dataset, dict):
            eval_dataset = {
                k: prepare_reward_dataset(v, tokenizer, self.max_length, num_proc) for k, v in eval_dataset.items()
            }
        else:
            eval_dataset = prepare_reward_dataset(eval_dataset, tokenizer, self.max_length, num_proc)
        if data_collator is None:
            if tokenizer is None:
                raise ValueError("RewardTrainer needs tokenizer= (or processing_class=) for its default collator")
            data_collator = RewardDataCollatorWithPadding(tokenizer, max_length=self.max_length)
        args, self._eval_strategy_without_data = without_eval_strategy(args, eval_dataset)  # TRL 0.11 accepts it
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer, model_init=model_init,
            compute_metrics=compute_metrics or compute_accuracy, callbacks=callbacks, optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.model_accepts_loss_kwargs = False  # our loss is a per-pair mean: scale by gradient accumulation
        self._tag_model()
        self._setup_tracking(**tracking)

    @staticmethod
    def _check_one_output(model: Any) -> None:
        """A reward model has one output; more (e.g. ``num_labels=2``, transformers' default) are all trained
        as rewards, as TRL 0.11 does, with a warning: it is usually a forgotten ``num_labels=1``."""
        num_labels = getattr(getattr(model, "config", None), "num_labels", 1)
        if num_labels != 1:
            warnings.warn(
                f"the reward model has num_labels={num_labels}: each output is trained as a reward and "
                "evaluation reports their mean; load it with num_labels=1 for one reward per sequence",
                UserWarning, stacklevel=3,
            )

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the reward columns (the model's forward signature does not name them)."""
        if self._signature_columns is None:
            self._signature_columns = [*REWARD_COLUMNS, "margin"]

    def pair_rewards(self, model: nn.Module, inputs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards of chosen and rejected from one stacked forward pass of (2B, T): (B,) each for one output,
        (B, K) each for a model with K > 1 outputs (TRL 0.11 trains every output as a reward)."""
        input_ids = torch.cat([inputs["input_ids_chosen"], inputs["input_ids_rejected"]], dim=0)  # (2B, T)
        mask = torch.cat([inputs["attention_mask_chosen"], inputs["attention_mask_rejected"]], dim=0)  # (2B, T)
        scores = sequence_scores(model, input_ids, mask)  # (2B, K)
        rewards = scores[:, 0] if scores.shape[1] == 1 else scores  # (2B,) or (2B, K)
        rewards_chosen, rewards_rejected = rewards.chunk(2)  # (B,) or (B, K) each
        return rewards_chosen, rewards_rejected

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``-log sigmoid(r_c - r_r - margin)`` averaged over pairs (and outputs), + optional centring;
        outputs are the two reward tensors."""
        rewards_chosen, rewards_rejected = self.pair_rewards(model, inputs)
        margin = inputs.get("margin")
        if margin is not None and rewards_chosen.dim() == 2:  # one margin per pair, for each of the K outputs
            margin = margin.reshape(-1, 1).expand_as(rewards_chosen)  # (B, K)
        loss = pairwise_reward_loss(
            rewards_chosen, rewards_rejected, margin=margin,
            center_rewards_coefficient=self.center_rewards_coefficient,
        )
        if return_outputs:
            return loss, {"rewards_chosen": rewards_chosen, "rewards_rejected": rewards_rejected}
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Loss, rewards stacked as (B, 2) [chosen, rejected], and dummy labels (B,) for ``compute_accuracy``."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        chosen, rejected = outputs["rewards_chosen"], outputs["rewards_rejected"]
        if chosen.dim() == 2:  # K outputs: their mean per sequence (as TRL 0.11 reports them)
            chosen, rejected = chosen.mean(dim=1), rejected.mean(dim=1)  # (B,), (B,)
        logits = torch.stack([chosen, rejected], dim=1).detach()  # (B, 2)
        labels = torch.zeros(logits.shape[0], device=logits.device)  # (B,)
        return loss, logits, labels

    def card_hyperparameters(self) -> dict[str, Any]:
        """Trainer arguments plus the reward trainer's own."""
        extra = {"max_length": self.max_length, "center_rewards_coefficient": self.center_rewards_coefficient}
        return {**super().card_hyperparameters(), **{k: v for k, v in extra.items() if v is not None}}
