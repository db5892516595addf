"""``prepare.source: pairs:<file>``: a user's own preference pairs (``rlhf_core.user_pairs``: JSONL, CSV or Parquet
of ``prompt`` / ``chosen`` / ``rejected``, plain or conversational) as the sentiment task's data.

The prompts are split (seeded by ``prepare.seed``, ``prepare.eval_fraction`` held out; a prompt with several pairs
stays on one side). Of the training part: ``preferences`` = the pairs (reward model, DPO), ``ratings`` = their
unpaired halves (chosen: desirable, rejected: not; KTO), ``sft_train`` = prompt + chosen, ``prompts_train`` = the
distinct prompts (PPO, GRPO, RLOO); of the held-out part: ``prompts_eval`` and ``heldout`` (prompt + chosen).

A conversational pair is written as text, rendered with the plain chat template ``SIMPLE_CHAT_TEMPLATE``
(``User: ...`` turns, then ``Assistant:``): the answer is the rest of the whole conversation after the prompt
with its generation prompt. The sentiment stages then see text throughout (a model's own template is not known
before ``sft``).
"""

from __future__ import annotations

import random
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment  # what transformers renders chat templates with

from rlhf_core.models.chat_format import SIMPLE_CHAT_TEMPLATE
from tasks.stages.common.source import PAIRS_PREFIX


def is_pairs_source(source: str) -> bool:
    """Whether ``prepare.source`` names a file of preference pairs (``pairs:my_pairs.jsonl``)."""
    return source.startswith(PAIRS_PREFIX)


def _render(messages: list[dict], add_generation_prompt: bool) -> str:
    return ImmutableSandboxedEnvironment().from_string(SIMPLE_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def as_text(pair: dict) -> dict:
    """``{"prompt", "chosen", "rejected"}`` as texts: a plain pair as it is, a conversational one rendered (see the
    module docstring; a text prompt is a user turn, a text answer an assistant turn)."""
    if all(isinstance(pair[c], str) for c in ("prompt", "chosen", "rejected")):
        return {c: pair[c] for c in ("prompt", "chosen", "rejected")}
    prompt = pair["prompt"] if isinstance(pair["prompt"], list) else [{"role": "user", "content": pair["prompt"]}]
    prompt_text = _render(prompt, add_generation_prompt=True)

    base = _render(prompt, add_generation_prompt=False)
    generation_prompt = prompt_text[len(base):]  # "Assistant:"

    def answer(value: Any) -> str:
        turns = value if isinstance(value, list) else [{"role": "assistant", "content": value}]
        rest = _render(prompt + turns, add_generation_prompt=False)[len(base):].rstrip()  # "Assistant: ..."
        return rest[len(generation_prompt):] if rest.startswith(generation_prompt) else " " + rest

    return {"prompt": prompt_text, "chosen": answer(pair["chosen"]), "rejected": answer(pair["rejected"])}


def pair_datasets(pairs: list[dict], eval_fraction: float, seed: int) -> dict[str, list[dict]]:
    """The six datasets from checked pairs (``tasks.stages.common.source.load_pairs``; see the module docstring)."""
    rows = [as_text(p) for p in pairs]
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
    return {"sft_train": [{"text": r["prompt"] + r["chosen"]} for r in train],
            "heldout": [{"text": r["prompt"] + r["chosen"]} for r in evaluation],
            "prompts_train": [{"query": q} for q in dict.fromkeys(r["prompt"] for r in train)],
            "prompts_eval": [{"query": q} for q in dict.fromkeys(r["prompt"] for r in evaluation)],
            "preferences": train, "ratings": list(ratings.values())}


__all__ = ["as_text", "is_pairs_source", "pair_datasets"]
