"""Where the pipeline writes: output paths from ``params.yaml`` kept inside the project, and each stage's
resumable-state directory under ``.checkpoints/``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from rlhf_core.checkpointing import fingerprint


def resolve_output_path(root: str | Path, relative: str | Path, allow_outside: bool = False) -> Path:
    """``root / relative`` resolved; a ``ValueError`` if it escapes ``root`` (``..``, absolute, symlink).

    ``allow_outside=True`` is the explicit opt-in for writing elsewhere (e.g. a shared scratch disk).
    """
    root_path = Path(root).resolve()
    text = str(relative)
    if not text or "\x00" in text:
        raise ValueError(f"output path {relative!r} is empty or contains a NUL byte")
    candidate = (root_path / Path(relative).expanduser()).resolve()
    if allow_outside:
        return candidate
    if candidate != root_path and root_path not in candidate.parents:
        raise ValueError(
            f"output path {str(relative)!r} resolves to {candidate}, outside the project directory {root_path}; "
            "use a path inside the project, or allow it explicitly (allow_outside=True)"
        )
    return candidate


def stage_checkpoint_dir(root: str | Path, stage: str, params: Any, base: str = ".checkpoints") -> Path:
    """Where a pipeline stage keeps its resumable state: ``<root>/.checkpoints/<stage>-<fingerprint(params)>``.

    Outside DVC's outputs (``dvc repro`` deletes a stage's outs before running it) and keyed by the stage's
    parameters, so a changed parameter starts afresh instead of resuming a different run. Delete the directory
    when the stage has finished and written its outputs.
    """
    return resolve_output_path(root, Path(base) / f"{stage}-{fingerprint(params)}")


def project_root(root: str | Path) -> Path:
    """The project (DVC repository) that ``root`` belongs to: the nearest of ``root`` and its parents holding a
    ``.dvc/`` folder, else ``root`` itself. A task's folder (``pipelines/arithmetic``) keeps its own params.yaml,
    dvc.yaml, dvc.lock and outputs, but shares the checkout's lock, DVC scratch (``.dvc/tmp``) and MLflow store with
    every other task of the project; at the repository root both are the same folder."""
    start = Path(root).resolve()
    return next((folder for folder in (start, *start.parents) if (folder / ".dvc").is_dir()), start)


def task_folder(root: str | Path) -> str:
    """``root`` relative to its project (``.`` at the repository root, ``pipelines/arithmetic`` in a task folder)."""
    start = Path(root).resolve()
    return start.relative_to(project_root(start)).as_posix()


__all__ = ["project_root", "resolve_output_path", "stage_checkpoint_dir", "task_folder"]


def remove_stage_checkpoints(root: str | Path, stage: str, base: str = ".checkpoints") -> list[Path]:
    """Delete every ``<root>/<base>/<stage>-<fingerprint>`` resume state once ``stage`` has completed: states of
    abandoned parameters are never resumed again (moved-aside ``*.corrupt-*`` ones are kept for inspection)."""
    directory = Path(root) / base
    if not directory.is_dir():
        return []
    removed = [p for p in directory.glob(f"{stage}-*") if p.is_dir() and ".corrupt-" not in p.name
               and p.name[len(stage) + 1:].split(".", 1)[0].isalnum()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
