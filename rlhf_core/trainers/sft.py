"""SFTTrainer: supervised fine-tuning of a causal LM on text, a ``transformers.Trainer`` subclass.

The dataset is prepared once at construction: packed into fixed-length blocks (``packing=True``, a
``ConstantLengthDataset``) or tokenised row by row (truncated to ``max_seq_length``, EOS appended).
Loss is the model's own next-token cross-entropy over the labels the collator builds.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Unpack

from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments
from transformers.data.data_collator import default_data_collator
from transformers.integrations.neftune import activate_neftune

from rlhf_core.trainers.base import (
    RlhfTrainerMixin,
    TrackingOptions,
    check_tracking,
    checked_init_kwargs,
    default_training_args,
    load_model,
    keyword_defaults,
    merge_config_fields,
    load_tokenizer_for,
    resolve_processing_class,
    wrap_peft,
    without_eval_strategy,
)
from rlhf_core.trainers.collators import ConstantLengthDataset, DataCollatorForCompletionOnlyLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LENGTH = 512
# SFTTrainer keywords that SFTConfig (TRL 0.11) also carries.
SFT_CONFIG_KEYWORDS = (
    "dataset_text_field", "packing", "max_seq_length", "dataset_num_proc", "dataset_batch_size",
    "model_init_kwargs", "num_of_sequences", "chars_per_token",
)


@dataclass
class SFTConfig(TrainingArguments):
    """``TrainingArguments`` plus the SFT trainer's options (TRL 0.11 names and defaults)."""

    dataset_text_field: str | None = field(default=None, metadata={"help": "Column holding the text."})
    """Column holding the training text (or use ``formatting_func`` on the trainer)."""
    packing: bool = field(default=False, metadata={"help": "Pack texts into fixed-length blocks."})
    """Pack the texts into ``max_seq_length`` blocks with a ``ConstantLengthDataset``."""
    max_seq_length: int | None = field(default=None, metadata={"help": "Block / truncation length (tokens)."})
    """Block length when packing, truncation length otherwise; None: 512 capped by the model's positions."""
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    """Processes for ``datasets.map`` when tokenising (None: in-process)."""
    dataset_batch_size: int = field(default=1000, metadata={"help": "Rows per tokenisation batch."})
    """Rows per batched ``map`` call when tokenising (<= 0: the whole dataset at once)."""
    model_init_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "from_pretrained kwargs."})
    """Keyword arguments of ``from_pretrained`` when the model is given as a name or path."""
    dataset_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "Dataset preparation options."})
    """Dataset preparation options; ``{"skip_prepare_dataset": True}`` hands the datasets over untouched."""
    eval_packing: bool | None = field(default=None, metadata={"help": "Pack the eval set (None: as packing)."})
    """Pack the evaluation dataset too; None follows ``packing``."""
    num_of_sequences: int = field(default=1024, metadata={"help": "Texts buffered per packing round."})
    """Texts buffered per packing round of the ``ConstantLengthDataset``."""
    chars_per_token: float = field(default=3.6, metadata={"help": "Characters per token estimate for packing."})
    """Characters per token, to size the packing buffer."""
    use_liger: bool = field(default=False, metadata={"help": "Liger kernels (not supported)."})
    """Liger kernels: not supported by rlhf_core (True is refused)."""

    def __post_init__(self) -> None:
        if self.use_liger:
            raise ValueError("SFTConfig.use_liger=True: Liger kernels are not supported by rlhf_core")
        super().__post_init__()


def _is_hf_dataset(dataset: Any) -> bool:
    """True for a ``datasets.Dataset`` (has column names and ``map``)."""
    return hasattr(dataset, "column_names") and hasattr(dataset, "map")


def format_batch(
    batch: Mapping[str, list], dataset_text_field: str | None, formatting_func: Callable | None
) -> list[str]:
    """The texts of a batched ``map`` call: a column, or ``formatting_func`` (batched or per example)."""
    if formatting_func is None:
        return list(batch[dataset_text_field])
    n_rows = len(next(iter(batch.values())))
    texts = formatting_func(batch)
    if isinstance(texts, list) and len(texts) == n_rows and all(isinstance(t, str) for t in texts):
        return texts
    rows = [{key: values[i] for key, values in batch.items()} for i in range(n_rows)]
    texts = [formatting_func(row) for row in rows]
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("formatting_func must return a list of str for a batch, or a str for one example")
    return texts


def chat_formatting_func(dataset: Any, tokenizer: Any) -> Callable | None:
    """TRL 0.11's default formatting, when the tokenizer has a chat template: a conversational dataset (a
    ``messages`` or ``conversations`` column) is rendered by the template; an instruction dataset (exactly the
    columns ``prompt`` and ``completion``) as a user turn and the assistant's answer. Else None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    for column in ("messages", "conversations"):
        if column in dataset.column_names:
            return lambda example: tokenizer.apply_chat_template(example[column], tokenize=False)
    if sorted(dataset.column_names) == ["completion", "prompt"]:
        def render(example: Mapping[str, Any]) -> str | list[str]:  # one row, or a batch of them (columns of lists)
            if isinstance(example["prompt"], list):
                return [render({"prompt": p, "completion": c}) for p, c in zip(example["prompt"], example["completion"])]
            turns = [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": example["completion"]}]
            return tokenizer.apply_chat_template(turns, tokenize=False)

        return render
    return None


def tokenize_texts(texts: list[str], tokenizer: Any, max_seq_length: int) -> dict[str, list[list[int]]]:
    """Token ids with EOS appended (if the tokenizer did not add it), truncated to ``max_seq_length``."""
    ids = tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
    eos = tokenizer.eos_token_id
    rows = [(row + [eos] if eos is not None and (not row or row[-1] != eos) else row)[:max_seq_length] for row in ids]
    return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}


class SFTTrainer(RlhfTrainerMixin, Trainer):
    """Supervised fine-tuning trainer with the classic TRL arguments (``tokenizer=`` accepted)."""

    trainer_name = "sft"
    _tag_names = ["trl", "sft"]

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
        peft_config: Any = None,
        dataset_text_field: str | None = None,
        packing: bool = False,
        formatting_func: Callable | None = None,
        max_seq_length: int | None = None,
        infinite: bool | None = None,
        num_of_sequences: int = 1024,
        chars_per_token: float = 3.6,
        dataset_num_proc: int | None = None,
        dataset_batch_size: int = 1000,
        model_init_kwargs: Mapping[str, Any] | None = None,
        neftune_noise_alpha: float | None = None,
        processing_class: Any = None,
        **tracking: Unpack[TrackingOptions],
    ) -> None:
        tracking = check_tracking(type(self).__name__, tracking)
        args = default_training_args(args, self.trainer_name, SFTConfig)
        keywords = dict(
            dataset_text_field=dataset_text_field, packing=packing, max_seq_length=max_seq_length,
            dataset_num_proc=dataset_num_proc, dataset_batch_size=dataset_batch_size,
            model_init_kwargs=model_init_kwargs, num_of_sequences=num_of_sequences, chars_per_token=chars_per_token,
        )
        options = merge_config_fields(
            args, SFTConfig, keywords, keyword_defaults(SFTTrainer.__init__, SFT_CONFIG_KEYWORDS)
        )
        dataset_text_field, packing, max_seq_length = (options[k] for k in SFT_CONFIG_KEYWORDS[:3])
        dataset_num_proc, dataset_batch_size, model_init_kwargs, num_of_sequences, chars_per_token = (
            options[k] for k in SFT_CONFIG_KEYWORDS[3:]
        )
        model_init_kwargs = checked_init_kwargs(model_init_kwargs, "SFTConfig")
        self._set_neftune_noise_alpha(args, neftune_noise_alpha)
        if infinite is not None:
            warnings.warn(
                "SFTTrainer(infinite=...) is deprecated (as in TRL 0.11): with packing the dataset repeats when "
                "max_steps > 0 and is read once otherwise; set max_steps or num_train_epochs instead",
                FutureWarning, stacklevel=2,
            )
        dataset_kwargs = dict(getattr(args, "dataset_kwargs", None) or {})
        eval_packing = getattr(args, "eval_packing", None)
        tokenizer = load_tokenizer_for(model, resolve_processing_class(tokenizer, processing_class))
        if tokenizer is None:
            raise ValueError(
                "SFTTrainer needs tokenizer= (or processing_class=), or a model name/path to load one from"
            )
        model = wrap_peft(load_model(model, AutoModelForCausalLM, model_init_kwargs), peft_config)
        if packing and isinstance(data_collator, DataCollatorForCompletionOnlyLM):
            raise ValueError("packing=True cannot be combined with DataCollatorForCompletionOnlyLM")
        self.max_seq_length = self._resolve_max_seq_length(max_seq_length, model)
        self.packing = packing
        self.dataset_text_field = dataset_text_field
        prepare = dict(
            tokenizer=tokenizer, packing=packing, dataset_text_field=dataset_text_field,
            formatting_func=formatting_func, infinite=bool(infinite), num_of_sequences=num_of_sequences,
            chars_per_token=chars_per_token, dataset_num_proc=dataset_num_proc, dataset_batch_size=dataset_batch_size,
        )
        if not dataset_kwargs.get("skip_prepare_dataset", False):
            train_dataset = self._prepare_dataset(train_dataset, **prepare)
            eval_prepare = {**prepare, "infinite": False, "packing": packing if eval_packing is None else eval_packing}
            if isinstance(eval_dataset, dict):
                eval_dataset = {k: self._prepare_dataset(v, **eval_prepare) for k, v in eval_dataset.items()}
            else:
                eval_dataset = self._prepare_dataset(eval_dataset, **eval_prepare)
        if data_collator is None:
            data_collator = default_data_collator if packing else DataCollatorForLanguageModeling(tokenizer, mlm=False)
        args, self._eval_strategy_without_data = without_eval_strategy(args, eval_dataset)  # TRL 0.11 accepts it
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer, model_init=model_init,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self._repeat_packed_data_for_max_steps()
        self._tag_model()
        self._setup_tracking(**tracking)

    @staticmethod
    def _set_neftune_noise_alpha(args: TrainingArguments, neftune_noise_alpha: float | None) -> None:
        """The ``neftune_noise_alpha=`` keyword (TRL 0.11) overrides ``args.neftune_noise_alpha``, with a warning
        when the two disagree; transformers' ``Trainer.train`` adds the noise hook for the run."""
        if neftune_noise_alpha is None:
            return
        if args.neftune_noise_alpha is not None and args.neftune_noise_alpha != neftune_noise_alpha:
            warnings.warn(
                f"neftune_noise_alpha={neftune_noise_alpha} passed to the trainer overrides "
                f"{type(args).__name__}.neftune_noise_alpha={args.neftune_noise_alpha}",
                UserWarning, stacklevel=3,
            )
        args.neftune_noise_alpha = neftune_noise_alpha

    def _repeat_packed_data_for_max_steps(self) -> None:
        """A packed train set repeats when training runs for ``max_steps`` > 0 and is read once per epoch
        otherwise (TRL 0.11's rule: the step budget, not the data, ends a ``max_steps`` run)."""
        if isinstance(self.train_dataset, ConstantLengthDataset):
            self.train_dataset.infinite = self.args.max_steps > 0
            if self.train_dataset.infinite:
                logger.info("SFTTrainer: packed data repeats until max_steps=%d", self.args.max_steps)

    def _trl_activate_neftune(self, model: Any) -> Any:
        """Add the NEFTune noise hook (uniform noise of scale ``alpha / sqrt(T * d)`` on the input embeddings,
        in training mode) to ``model`` (a PEFT model's base embeddings) and keep its handle in
        ``self.neftune_hook_handle``; TRL 0.11's name. ``train()`` adds and removes its own hook."""
        if self.neftune_noise_alpha is None:
            raise ValueError("_trl_activate_neftune needs neftune_noise_alpha set (SFTConfig or the trainer keyword)")
        self.neftune_hook_handle = activate_neftune(model, self.neftune_noise_alpha, self.accelerator)
        return model

    @staticmethod
    def _resolve_max_seq_length(max_seq_length: int | None, model: Any) -> int:
        """``max_seq_length``, or 512 capped by the model's position limit."""
        if max_seq_length is not None:
            if max_seq_length < 1:
                raise ValueError(f"max_seq_length must be >= 1, got {max_seq_length}")
            return max_seq_length
        config = getattr(model, "config", None)
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return min(DEFAULT_MAX_SEQ_LENGTH, limit) if limit else DEFAULT_MAX_SEQ_LENGTH

    def _prepare_dataset(
        self,
        dataset: Any,
        tokenizer: Any,
        packing: bool,
        dataset_text_field: str | None,
        formatting_func: Callable | None,
        infinite: bool,
        num_of_sequences: int,
        chars_per_token: float,
        dataset_num_proc: int | None,
        dataset_batch_size: int,
    ) -> Any:
        """Pack or tokenise ``dataset``; ready datasets (tokenised, torch, ConstantLengthDataset) pass through."""
        if dataset is None or isinstance(dataset, ConstantLengthDataset) or not _is_hf_dataset(dataset):
            return dataset
        if "input_ids" in dataset.column_names and dataset_text_field is None and formatting_func is None:
            return dataset
        if dataset_text_field is None and formatting_func is None:
            formatting_func = chat_formatting_func(dataset, tokenizer)
        if dataset_text_field is None and formatting_func is None:
            raise ValueError(
                f"SFTTrainer needs dataset_text_field or formatting_func (dataset columns: {dataset.column_names})"
            )
        if formatting_func is None and dataset_text_field not in dataset.column_names:
            raise ValueError(
                f"dataset_text_field={dataset_text_field!r} is not a column of the dataset: {dataset.column_names}"
            )
        if packing:
            packed = ConstantLengthDataset(
                tokenizer, dataset, dataset_text_field=dataset_text_field, formatting_func=formatting_func,
                infinite=infinite, seq_length=self.max_seq_length, num_of_sequences=num_of_sequences,
                chars_per_token=chars_per_token, eos_token_id=tokenizer.eos_token_id,
            )
            if hasattr(dataset, "__len__") and not packed.fills_a_block():  # TRL 0.11 packs a (sized) dataset up front
                raise ValueError(
                    "Error occurred while packing the dataset. Make sure that your dataset has enough samples to at "
                    f"least yield one packed sequence. ({len(dataset)} rows give fewer than max_seq_length="
                    f"{self.max_seq_length} tokens.)"
                )
            return packed

        def tokenize(batch: Mapping[str, list]) -> dict[str, list[list[int]]]:
            texts = format_batch(batch, dataset_text_field, formatting_func)
            return tokenize_texts(texts, tokenizer, self.max_seq_length)

        return dataset.map(
            tokenize, batched=True,
            batch_size=dataset_batch_size if dataset_batch_size and dataset_batch_size > 0 else None,
            num_proc=dataset_num_proc, remove_columns=dataset.column_names,
        )

    def card_hyperparameters(self) -> dict[str, Any]:
        """Trainer arguments plus SFT's own."""
        return {**super().card_hyperparameters(), "max_seq_length": self.max_seq_length, "packing": self.packing}
