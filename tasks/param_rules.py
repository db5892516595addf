"""Value rules for ``params.yaml``: every bad value fails in the loader, before any stage runs, naming its key.

The loader (``tasks/params.py``) checks keys and types; this module checks values: sizes that must be positive,
finite learning rates and betas, the closed vocabularies (``ppo.kl_penalty``, ``sft.arch``), lengths that must
fit the built model's positions, and output paths that must stay out of ``.git``/``.dvc``. It also turns YAML
syntax errors into one line naming ``file:line:column``.

``check`` reads the raw mapping (after the loader's type checks), so it does not depend on the dataclasses.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePath
from typing import Any

import yaml

from rlhf_core.data import PROMPT_BYTES_PER_WORD, prompt_token_budget


class ParamsError(ValueError):
    """params.yaml is wrong: an unknown, missing or mistyped key, a bad value, or a YAML syntax error (the message
    names the file and the dotted key)."""


# The keys of the paths section that name directories the stages write to (or, for incoming, read and track).
PATH_KEYS = ("data", "models", "metrics", "plots", "incoming")

POSITIVE_INTS = {
    "prepare": ("max_words", "prompt_min_words", "prompt_max_words", "pairs_per_review"),
    "sft": ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_positions", "max_seq_length",
            "per_device_train_batch_size"),
    "reward_model": ("max_length", "per_device_train_batch_size"),
    "ppo": ("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "total_steps",
            "max_new_tokens", "sample_prompts"),
    "dpo": ("per_device_train_batch_size", "max_length", "max_prompt_length", "sample_prompts"),
    "evaluate": ("num_prompts", "max_new_tokens", "batch_size"),
    "kto": ("sample_prompts",),
}
"""Sizes and counts that must be >= 1 (0 divides by zero or trains nothing; negatives make no sense)."""

NON_NEGATIVE_INTS = {"prepare": ("num_reviews",), "evaluate": ("num_samples",), "ppo": ("sample_every",),
                     "dpo": ("sample_every",), "kto": ("sample_every",)}
"""Counts where 0 has a meaning (all reviews, no samples shown, no sample windows)."""

POSITIVE_FLOATS = {
    "sft": ("learning_rate", "num_train_epochs"),
    "reward_model": ("learning_rate", "num_train_epochs"),
    "ppo": ("learning_rate", "target", "horizon", "cliprange", "cliprange_value", "max_grad_norm"),
    "dpo": ("beta", "learning_rate", "num_train_epochs"),
    "registry": ("max_kl",),
}
"""Finite and > 0 (NaN, inf, 0 and negatives rejected)."""

NON_NEGATIVE_FLOATS = {
    "prepare": ("min_margin",),
    "sft": ("warmup_steps", "weight_decay"),
    "ppo": ("init_kl_coef", "vf_coef"),
    "registry": ("min_improvement",),
}
"""Finite and >= 0."""

UNIT_INTERVAL = {"ppo": ("gamma", "lam")}
"""Finite and in [0, 1]."""

CHOICES = {
    ("ppo", "kl_penalty"): ("kl", "abs", "mse", "full"), ("sft", "arch"): ("gpt2", "llama"),
    ("dpo", "loss_type"): ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                           "aot_pair", "apo_zero", "apo_down"),
}
"""Closed vocabularies: what the trainers implement (``sft.arch``: what ``rlhf_core/models/tiny.py`` builds;
``dpo.loss_type``: ``rlhf_core.losses.DPO_LOSS_TYPES``, spelled out so loading params imports no loss code)."""

FORBIDDEN_DIRS = (".git", ".dvc")
"""Output paths may not lie inside these: a stage would overwrite git or DVC internals."""


def _fail(source: str, key: str, message: str) -> None:
    raise ParamsError(f"{source}: {key}: {message}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(raw: dict, source: str, table: dict, low: float, high: float, low_open: bool, integer: bool) -> None:
    """Every ``section.key`` of ``table`` is a finite number in [low, high] (``(low, high]`` when ``low_open``)."""
    for section, keys in table.items():
        for key in keys:
            value = raw[section][key]
            name = f"{section}.{key}"
            if not _number(value) or (integer and not isinstance(value, int)):
                _fail(source, name, f"expected a {'whole ' if integer else ''}number, got {value!r}")
            if not math.isfinite(value):
                _fail(source, name, f"must be finite, got {value!r}")
            if value < low or (low_open and value == low) or value > high:
                bound = f"> {low}" if low_open else f">= {low}"
                _fail(source, name, f"must be {bound}" + (f" and <= {high}" if high != math.inf else "")
                      + f", got {value!r}")


def _check_choices(raw: dict, source: str) -> None:
    for (section, key), allowed in CHOICES.items():
        if raw[section][key] not in allowed:
            _fail(source, f"{section}.{key}", f"must be one of {', '.join(allowed)}, got {raw[section][key]!r}")


def _check_positions(raw: dict, source: str) -> None:
    """With the built model (``sft.model_name: ''``), every token length must fit ``sft.max_positions``; a prompt
    (at most ``prompt_token_budget`` tokens, see ``rlhf_core/data.py``) plus the sampled tokens too."""
    if raw["sft"]["model_name"]:
        return  # a hub/local model: its positions are only known once loaded
    positions = raw["sft"]["max_positions"]
    lengths = {"sft.max_seq_length": raw["sft"]["max_seq_length"], "dpo.max_length": raw["dpo"]["max_length"],
               "ppo.max_new_tokens": raw["ppo"]["max_new_tokens"],
               "evaluate.max_new_tokens": raw["evaluate"]["max_new_tokens"]}
    if raw["reward_model"]["init_from"] == "sft":
        lengths["reward_model.max_length"] = raw["reward_model"]["max_length"]
    for key, value in lengths.items():
        if value > positions:
            _fail(source, key, f"{value} tokens exceed the model's positions (sft.max_positions: {positions})")
    prompt = prompt_token_budget(raw["prepare"]["prompt_max_words"])  # prepare drops longer prompts
    for key in ("ppo.max_new_tokens", "evaluate.max_new_tokens"):
        if prompt + lengths[key] > positions:
            words = raw["prepare"]["prompt_max_words"]
            _fail(source, key, f"{lengths[key]} tokens after a prompt of up to {prompt} tokens (prepare.prompt_max_"
                               f"words {words} x {PROMPT_BYTES_PER_WORD} bytes) exceed the model's positions "
                               f"(sft.max_positions: {positions})")


def _check_paths(raw: dict, source: str) -> None:
    for key in PATH_KEYS:
        value = raw["paths"][key]
        parts = PurePath(str(value)).parts
        if not str(value).strip() or any(p in FORBIDDEN_DIRS for p in parts):
            _fail(source, f"paths.{key}", f"{value!r} is empty or inside {' or '.join(FORBIDDEN_DIRS)}")


def check(params: dict, source: str = "params.yaml") -> None:
    """Raise ``ParamsError`` naming ``source`` and the dotted key of the first bad value in ``params`` (the raw
    mapping of params.yaml, already checked for keys and types)."""
    _check_range(params, source, POSITIVE_INTS, 1, math.inf, False, integer=True)
    _check_range(params, source, NON_NEGATIVE_INTS, 0, math.inf, False, integer=True)
    _check_range(params, source, POSITIVE_FLOATS, 0.0, math.inf, True, integer=False)
    _check_range(params, source, NON_NEGATIVE_FLOATS, 0.0, math.inf, False, integer=False)
    _check_range(params, source, UNIT_INTERVAL, 0.0, 1.0, False, integer=False)
    _check_choices(params, source)
    _check_positions(params, source)
    _check_paths(params, source)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file; a syntax error becomes a ``ParamsError`` naming ``file:line:column`` and the problem."""
    text = Path(path).read_text()
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ParamsError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: YAML error: {err}") from None
