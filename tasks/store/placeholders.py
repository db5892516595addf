"""The placeholder of a disabled stage: a stage whose section says ``enabled: false`` still runs and is recorded by
DVC, in well under a second. It writes ``models/<stage>/DISABLED`` (the whole output), ``metrics/<stage>.json`` =
``{"enabled": false}`` and header-only plots (``tasks/run/stage_task.py``), so ``dvc status`` is clean after the
pipeline whatever the switches say. ``evaluate`` skips a placeholder (:func:`is_placeholder`).
"""

from __future__ import annotations

from pathlib import Path

from tasks.store.outputs import atomic_dir

PLACEHOLDER = "DISABLED"
"""File name that marks ``models/<stage>`` as the output of a disabled stage (no model inside)."""


def is_placeholder(model_dir: str | Path) -> bool:
    """True when ``model_dir`` is a disabled stage's placeholder (or missing), not a trained model."""
    model_dir = Path(model_dir)
    return (model_dir / PLACEHOLDER).exists() or not model_dir.is_dir()


def write_placeholder(out: Path, stage: str) -> None:
    """``out`` (a model directory) as the placeholder of the disabled ``stage``."""
    with atomic_dir(out) as tmp:
        (tmp / PLACEHOLDER).write_text(f"{stage} is disabled ({stage}.enabled: false in params.yaml); "
                                       "no model was trained. evaluate and the registry skip it.\n")


__all__ = ["PLACEHOLDER", "is_placeholder", "write_placeholder"]
