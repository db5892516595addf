"""Model cards: a README.md with YAML front matter written beside every saved checkpoint.

The card says which rlhf_core trainer produced the weights, from which base model, with which
hyper-parameters and final metrics. Trainers call ``write_model_card`` from their save hook; the
PPO trainer and the pipeline tasks reuse it with the same signature.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CARD_FILENAME = "README.md"
# Plain words YAML would read as booleans or null.
YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n"}


def _yaml_scalar(value: Any) -> str:
    """A YAML-safe scalar: plain for simple names, JSON-quoted (valid YAML) otherwise."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z][A-Za-z0-9_.-]*", value) and value.lower() not in YAML_WORDS:
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, numbers.Number):
        return json.dumps(value) if math.isfinite(float(value)) else json.dumps(str(value))
    return json.dumps(str(value))


def _markdown_cell(value: Any) -> str:
    """Render one table cell; pipes and newlines would break the markdown table."""
    if isinstance(value, float):
        value = f"{value:.6g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(rows: Mapping[str, Any], header: tuple[str, str]) -> list[str]:
    """A two-column markdown table of ``rows`` sorted by key."""
    lines = [f"| {header[0]} | {header[1]} |", "|---|---|"]
    lines += [f"| {_markdown_cell(k)} | {_markdown_cell(v)} |" for k, v in sorted(rows.items())]
    return lines


def trainer_tag_for(trainer_name: str) -> str:
    """The card tag of a trainer: ``"SFTTrainer"`` and ``"sft"`` both give ``"sft"``."""
    name = trainer_name.strip().lower()
    return name.removesuffix("trainer") or name


def render_model_card(
    model_name: str,
    trainer_name: str,
    base_model: str | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    notes: str | None = None,
) -> str:
    """The card's markdown text (YAML front matter + sections), without touching disk."""
    trainer_tag = trainer_tag_for(trainer_name)
    front = ["---", "library_name: rlhf_core", "tags:", "- rlhf_core", f"- {_yaml_scalar(trainer_tag)}"]
    if base_model:
        front.append(f"base_model: {_yaml_scalar(base_model)}")
    front.append("---")
    body = [
        f"# {model_name}",
        "",
        f"This model was trained with `rlhf_core`'s `{trainer_name}`"
        + (f", starting from `{base_model}`." if base_model else "."),
    ]
    if hyperparameters:
        body += ["", "## Training hyperparameters", "", *_table(hyperparameters, ("name", "value"))]
    if metrics:
        body += ["", "## Metrics", "", *_table(metrics, ("metric", "value"))]
    if notes:
        body += ["", "## Notes", "", notes.strip()]
    return "\n".join(front + body) + "\n"


def write_model_card(
    save_directory: str | Path,
    model_name: str,
    trainer_name: str,
    base_model: str | None = None,
    hyperparameters: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Any] | None = None,
    notes: str | None = None,
) -> Path:
    """Write ``README.md`` (YAML front matter: library_name, tags, base_model) into ``save_directory``."""
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CARD_FILENAME
    text = render_model_card(model_name, trainer_name, base_model, hyperparameters, metrics, notes)
    path.write_text(text, encoding="utf-8")
    return path
