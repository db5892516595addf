"""Conversational problems in the stages: a prompt that is a list of ``{"role", "content"}`` messages is rendered
with the policy's chat template (``apply_chat_template(..., add_generation_prompt=True)``) wherever a stage samples
from it; a text prompt is used as it is. SFT's rows of a conversational file are TRL's conversational
prompt-completion rows (``{"prompt": [messages], "completion": [messages]}``), the loss on the completion (the
assistant's turn) only (:func:`completion_only_rows`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render_query(tokenizer: Any, query: str | list[dict], where: str = "the prompt") -> str:
    """The text the policy continues: ``query`` itself, or its messages through the chat template with the
    assistant's generation prompt. A conversation and a tokenizer without a template: a ValueError naming ``where``."""
    if isinstance(query, str):
        return query
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{where}: a conversational prompt, but the policy's tokenizer has no chat template to render "
                         "it (give sft.model_name a model whose tokenizer has one, or build the model: sft sets a "
                         "plain template when its data is conversational)")
    return tokenizer.apply_chat_template(query, tokenize=False, add_generation_prompt=True)


def render_queries(tokenizer: Any, queries: Sequence[str | list[dict]], where: str) -> list[str]:
    """:func:`render_query` of each (``where``: the file, named with the row in an error)."""
    return [render_query(tokenizer, q, f"{where}: row {i}") for i, q in enumerate(queries, start=1)]


def render_with(model_dir: Any, queries: Sequence[str | list[dict]], where: str) -> list[str]:
    """:func:`render_queries` with the tokenizer saved in ``model_dir`` (the SFT policy's), loaded only when a query
    is a conversation (text prompts stay as they are, without a load)."""
    if all(isinstance(q, str) for q in queries):
        return list(queries)
    from tasks.stages.common.scoring import load_tokenizer  # transformers: only for a conversation

    return render_queries(load_tokenizer(model_dir), queries, where)


def completion_only_rows(tokenizer: Any, rows: Sequence[dict], max_seq_length: int, where: str) -> list[dict]:
    """``{input_ids, attention_mask, labels}`` of conversational prompt-completion rows: the prompt rendered with
    the generation prompt, the completion as the rest of the rendered whole conversation, EOS appended when the
    template does not end with it; labels -100 on the prompt tokens (SFT learns the assistant's turn only). A
    template whose whole conversation does not start with the rendered prompt cannot be split: a ValueError naming
    the row."""
    out = []
    for i, row in enumerate(rows, start=1):
        prompt = render_query(tokenizer, row["prompt"], f"{where}: row {i}")
        whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
        if not whole.startswith(prompt):
            raise ValueError(f"{where}: row {i}: the chat template renders the conversation without its prompt as a "
                             "prefix; the assistant's turn cannot be told from the prompt")
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        completion_ids = tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None and (not completion_ids or completion_ids[-1] != tokenizer.eos_token_id):
            completion_ids = completion_ids + [tokenizer.eos_token_id]
        ids = (prompt_ids + completion_ids)[:max_seq_length]
        labels = ([-100] * len(prompt_ids) + completion_ids)[:max_seq_length]
        out.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return out


__all__ = ["completion_only_rows", "render_queries", "render_query", "render_with"]
