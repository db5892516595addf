"""``trl.data_utils``: dataset rows between TRL's formats, as TRL's scripts map their datasets.

Conversational rows hold lists of ``{"role", "content"}`` messages; ``apply_chat_template`` renders them to the
standard (string) format with the tokenizer's template. Preference rows with an implicit prompt (``chosen`` and
``rejected`` sharing their start) get an explicit ``prompt`` from ``extract_prompt``; ``unpair_preference_dataset``
turns paired preferences into KTO's unpaired ``prompt`` / ``completion`` / ``label`` rows.
"""

from __future__ import annotations

from typing import Any

# the columns whose value says whether a row is conversational, in the order TRL looks at them
_TEXT_KEYS = ("prompt", "chosen", "rejected", "completion", "messages")


def is_conversational(example: dict[str, Any]) -> bool:
    """Whether the row's first text column holds a list of ``{"role", "content"}`` messages."""
    for key in _TEXT_KEYS:
        if key in example:
            value = example[key]
            return isinstance(value, list) and bool(value) and isinstance(value[0], dict) \
                and "role" in value[0] and "content" in value[0]
    return False


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def apply_chat_template(example: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """The row rendered to strings: ``messages`` -> ``text``; a ``prompt`` with a generation prompt, and each of
    ``chosen`` / ``rejected`` / ``completion`` as what the template adds after that prompt. Other columns (a KTO
    ``label``) are kept."""
    keys = set(example)
    if not keys & set(_TEXT_KEYS):
        raise ValueError(f"apply_chat_template: the row has none of the columns {_TEXT_KEYS} (it has {sorted(keys)})")
    out = {k: v for k, v in example.items() if k not in _TEXT_KEYS}
    if "messages" in example:
        out["text"] = _render(tokenizer, example["messages"])
        return out
    prompt = example.get("prompt")
    if prompt is not None:
        out["prompt"] = _render(tokenizer, prompt, generation_prompt=True)
    for key in ("chosen", "rejected", "completion"):
        if key not in example:
            continue
        if prompt is None:
            out[key] = _render(tokenizer, example[key])
            continue
        whole = _render(tokenizer, prompt + example[key])
        if not whole.startswith(out["prompt"]):
            raise ValueError(f"apply_chat_template: the template renders prompt + {key} with a different start than "
                             "the prompt alone, so the completion cannot be cut from it")
        out[key] = whole[len(out["prompt"]):]
    return out


def maybe_apply_chat_template(example: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """``apply_chat_template`` for a conversational row; a standard row unchanged."""
    return apply_chat_template(example, tokenizer) if is_conversational(example) else example


def extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """An implicit-prompt preference row split into the shared ``prompt`` and the differing ``chosen``/``rejected``
    (messages for a conversational row; for strings, the split falls on the last space before they differ)."""
    chosen, rejected = example["chosen"], example["rejected"]
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    if isinstance(chosen, str):
        cut = chosen.rfind(" ", 0, cut + 1) if " " in chosen[:cut + 1] else 0
    return {**example, "prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def maybe_extract_prompt(example: dict[str, Any]) -> dict[str, Any]:
    """``extract_prompt`` for a preference row whose prompt is implicit: no ``prompt`` column, or (as some datasets
    have) a string ``prompt`` beside conversational ``chosen``/``rejected`` that repeat it. Other rows unchanged."""
    if "chosen" not in example or "rejected" not in example:
        return example
    if "prompt" in example and (is_conversational({"prompt": example["prompt"]})
                                or not is_conversational({"chosen": example["chosen"]})):
        return example
    return extract_prompt(example)


def _unpair_rows(batch: dict[str, list]) -> dict[str, list]:
    n = len(batch["chosen"])
    rows = {"completion": batch["chosen"] + batch["rejected"], "label": [True] * n + [False] * n}
    if "prompt" in batch:
        rows["prompt"] = batch["prompt"] + batch["prompt"]
    return rows


def unpair_preference_dataset(dataset: Any, num_proc: int | None = None) -> Any:
    """Paired preferences -> unpaired rows: each ``chosen`` becomes a completion labelled True, each ``rejected``
    one labelled False (in each mapped batch, the chosen rows first)."""
    missing = {"chosen", "rejected"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"unpair_preference_dataset: the dataset lacks the columns {sorted(missing)}")
    return dataset.map(_unpair_rows, batched=True, remove_columns=["chosen", "rejected"], num_proc=num_proc)


def maybe_unpair_preference_dataset(dataset: Any, num_proc: int | None = None) -> Any:
    """``unpair_preference_dataset`` for paired data (a ``DatasetDict`` split by split); unpaired data unchanged."""
    if hasattr(dataset, "keys") and not hasattr(dataset, "column_names") or isinstance(
            getattr(dataset, "column_names", None), dict):
        return type(dataset)({k: maybe_unpair_preference_dataset(v, num_proc) for k, v in dataset.items()})
    if {"chosen", "rejected"} <= set(dataset.column_names):
        return unpair_preference_dataset(dataset, num_proc)
    return dataset
