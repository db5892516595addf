"""``trl.extras.dataset_formatting`` of TRL 0.11: formatting functions that render chat datasets to text with the
tokenizer's chat template, for ``SFTTrainer(formatting_func=...)`` and TRL 0.11's reward-modelling script.

Each returned function takes a row (one text back) or a batch of rows (a list of texts back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _render(tokenizer: Any, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False)


def conversations_formatting_function(tokenizer: Any, messages_field: str = "messages") -> Callable:
    """Render the ``messages_field`` column (a list of ``{"role", "content"}`` messages)."""
    def format_dataset(examples: dict) -> str | list[str]:
        value = examples[messages_field]
        if value and isinstance(value[0], list):  # a batch: one conversation per row
            return [_render(tokenizer, messages) for messages in value]
        return _render(tokenizer, value)

    return format_dataset


def instructions_formatting_function(tokenizer: Any) -> Callable:
    """Render ``prompt`` / ``completion`` string columns as a user turn and an assistant turn."""
    def turns(prompt: str, completion: str) -> list[dict]:
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]

    def format_dataset(examples: dict) -> str | list[str]:
        if isinstance(examples["prompt"], list):  # a batch
            return [_render(tokenizer, turns(p, c)) for p, c in zip(examples["prompt"], examples["completion"])]
        return _render(tokenizer, turns(examples["prompt"], examples["completion"]))

    return format_dataset


def get_formatting_func_from_dataset(dataset: Any, tokenizer: Any) -> Callable | None:
    """The formatting function the dataset's columns call for: ``messages`` / ``conversations`` (chat) or
    ``prompt`` + ``completion`` strings (instructions); None for any other layout."""
    columns = set(getattr(dataset, "column_names", None) or [])
    for field in ("messages", "conversations"):
        if field in columns:
            return conversations_formatting_function(tokenizer, field)
    if columns == {"prompt", "completion"}:
        return instructions_formatting_function(tokenizer)
    return None
