"""``prepare.source: pairs:<file>``: a user's own preference pairs (``rlhf_core.user_pairs``: JSONL, CSV or Parquet
of ``prompt`` / ``chosen`` / ``rejected``, plain or conversational) as the sentiment task's data.

The prompts are split (seeded by ``prepare.seed``, ``prepare.eval_fraction`` held out; a prompt with several pairs
stays on one side). Of the training part: ``preferences`` = the pairs (reward model, DPO), ``ratings`` = their
unpaired halves (chosen: desirable, rejected: not; KTO), ``sft_train`` = prompt + chosen, ``prompts_train`` = the
distinct prompts (PPO, GRPO, RLOO); of the held-out part: ``prompts_eval`` and ``heldout`` (prompt + chosen).

A conversational pair is rendered with the chat template the SFT policy will have (:func:`chat_renderer`): that of
the tokenizer of a ``sft.model_name`` which has one, else the plain ``SIMPLE_CHAT_TEMPLATE`` (``User: ...`` turns,
then ``Assistant:``), which ``sft`` sets on a tokenizer without a template. The prompt is the conversation with the
generation prompt, an answer the rest of the whole conversation after it; every stage but ``sft`` then sees text.
``sft_train`` of a file with any conversation keeps the messages (TRL's conversational prompt-completion rows,
a text prompt a user turn and a text answer an assistant turn), so that SFT renders them with the same template
and learns the assistant's turn only (``tasks.stages.common.chat_prompts.completion_only_rows``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment  # what transformers renders chat templates with

from rlhf_core.models.chat_format import SIMPLE_CHAT_TEMPLATE
from tasks.stages.common.problems import as_messages
from tasks.stages.common.source import PAIRS_PREFIX

Render = Callable[[list[dict], bool], str]
"""``render(messages, add_generation_prompt) -> text``: a chat template applied."""


def is_pairs_source(source: str) -> bool:
    """Whether ``prepare.source`` names a file of preference pairs (``pairs:my_pairs.jsonl``)."""
    return source.startswith(PAIRS_PREFIX)


def plain_render(messages: list[dict], add_generation_prompt: bool) -> str:
    """``SIMPLE_CHAT_TEMPLATE`` applied (no tokenizer needed)."""
    return ImmutableSandboxedEnvironment().from_string(SIMPLE_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def is_conversational(pair: dict) -> bool:
    """Whether any of the pair's columns is a list of messages."""
    return not all(isinstance(pair[c], str) for c in ("prompt", "chosen", "rejected"))


def chat_renderer(model_name: str, pairs: list[dict]) -> Render:
    """How the pairs' conversations are rendered: with the chat template of ``sft.model_name``'s tokenizer (a local
    folder, or a hub name with a network) where it has one, else :func:`plain_render`. The tokenizer is loaded only
    when a pair is conversational; one that cannot be loaded is an error naming ``sft.model_name``."""
    if not model_name or not any(is_conversational(p) for p in pairs):
        return plain_render
    from transformers import AutoTokenizer  # transformers: only for a conversational file and a named model

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        raise ValueError(f"sft.model_name: {model_name!r}: its tokenizer, whose chat template renders the "
                         f"conversational pairs of prepare.source, cannot be loaded ({error})") from None
    if not getattr(tokenizer, "chat_template", None):
        return plain_render
    return lambda messages, add_generation_prompt: tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def as_text(pair: dict, render: Render = plain_render) -> dict:
    """``{"prompt", "chosen", "rejected"}`` as texts: a plain pair as it is, a conversational one rendered (see the
    module docstring; a text prompt is a user turn, a text answer an assistant turn)."""
    if not is_conversational(pair):
        return {c: pair[c] for c in ("prompt", "chosen", "rejected")}
    prompt = as_messages(pair["prompt"], "user")
    prompt_text = render(prompt, True)
    base = render(prompt, False)
    generation_prompt = prompt_text[len(base):]  # "Assistant:", "<|im_start|>assistant\n"

    def answer(value: Any) -> str:
        rest = render(prompt + as_messages(value, "assistant"), False)[len(base):].rstrip()  # "Assistant: ..."
        return rest[len(generation_prompt):] if rest.startswith(generation_prompt) else " " + rest

    return {"prompt": prompt_text, "chosen": answer(pair["chosen"]), "rejected": answer(pair["rejected"])}


def sft_row(pair: dict) -> dict:
    """The pair's prompt and chosen answer as a conversational prompt-completion row (SFT's data of a file with
    conversations)."""
    return {"prompt": as_messages(pair["prompt"], "user"), "completion": as_messages(pair["chosen"], "assistant")}


def pair_datasets(pairs: list[dict], eval_fraction: float, seed: int,
                  render: Render = plain_render) -> dict[str, list[dict]]:
    """The six datasets from checked pairs (``tasks.stages.common.source.load_pairs``; see the module docstring),
    conversations rendered by ``render`` (:func:`chat_renderer`)."""
    rows = [as_text(p, render) for p in pairs]
    chat = any(is_conversational(p) for p in pairs)
    prompts = list(dict.fromkeys(r["prompt"] for r in rows))
    random.Random(seed).shuffle(prompts)
    held = max(1, round(eval_fraction * len(prompts)))
    if held >= len(prompts):
        raise ValueError(f"prepare.source: {len(prompts)} distinct prompts leave none to train on with "
                         f"prepare.eval_fraction={eval_fraction}")
    held_out = set(prompts[:held])
    train = [r for r in rows if r["prompt"] not in held_out]
    evaluation = [r for r in rows if r["prompt"] in held_out]
    ratings: dict[tuple[str, str], dict] = {}  # one rating per answer; one both chosen and rejected: its first role
    for r in train:
        for side in ("chosen", "rejected"):
            ratings.setdefault((r["prompt"], r[side]), {"prompt": r["prompt"], "completion": r[side],
                                                         "label": side == "chosen"})
    sft_train = ([sft_row(p) for p, r in zip(pairs, rows) if r["prompt"] not in held_out] if chat
                 else [{"text": r["prompt"] + r["chosen"]} for r in train])
    return {"sft_train": sft_train,
            "heldout": [{"text": r["prompt"] + r["chosen"]} for r in evaluation],
            "prompts_train": [{"query": q} for q in dict.fromkeys(r["prompt"] for r in train)],
            "prompts_eval": [{"query": q} for q in dict.fromkeys(r["prompt"] for r in evaluation)],
            "preferences": train, "ratings": list(ratings.values())}


__all__ = ["Render", "as_text", "chat_renderer", "is_conversational", "is_pairs_source", "pair_datasets",
           "plain_render", "sft_row"]
