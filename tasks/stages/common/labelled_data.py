"""Which preference data ``dpo`` and ``kto`` train on: the ``label`` stage's verifier-labelled samples of the SFT
policy (``data/labelled/``) when that stage made them (a verifiable task), else prepare's file (the sentiment task:
``label`` wrote its placeholder). The stages themselves never read the task (DESIGN.md: a task is configuration)."""

from __future__ import annotations

from pathlib import Path

from tasks.spec.stage import StageContext
from tasks.store.placeholders import is_placeholder


def preference_file(ctx: StageContext, prepared: str, labelled_name: str) -> tuple[Path, str]:
    """(absolute path, path as the project names it) of the data to train on: ``<labelled>/<labelled_name>`` when
    the ``labelled`` dependency holds the label stage's output, else the ``prepared`` dependency."""
    if not is_placeholder(ctx.dep("labelled")):
        return ctx.dep("labelled") / labelled_name, f"{ctx.io.deps['labelled']}/{labelled_name}"
    return ctx.dep(prepared), ctx.io.deps[prepared]


__all__ = ["preference_file"]
