"""``prepare.source``: where the reviews come from (``synthetic``, a local file or directory, ``hub:<dataset>``; or
``pairs:<file>`` / ``pairs:hub:<dataset>``, a user's preference pairs instead of reviews),
read for the prepare stage, checked before a run starts and fingerprinted so an edited file makes prepare stale.

DVC cannot depend on a path held in a param (``synthetic`` is not a file), so the pipeline supervisor compares the
fingerprint (:func:`source_changed`) and re-runs prepare when the file was edited.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rlhf_core.data import HUB_PREFIX, DataFormatError, generate_reviews, load_hub_texts, read_text_records
from rlhf_core.user_pairs import read_pairs
from tasks.store.provenance import md5_dir, md5_file

PAIRS_PREFIX = "pairs:"
"""``prepare.source: pairs:<file>``: a user's preference pairs (``tasks/stages/common/pair_source.py``)."""

SOURCE_FINGERPRINT = ".source-fingerprint.json"
"""In ``paths.data``: the md5 of the local file/directory ``prepare.source`` named when prepare last ran."""


def _named(p: Any) -> str:
    """``prepare.source`` without its ``pairs:`` prefix."""
    return p.source[len(PAIRS_PREFIX):] if p.source.startswith(PAIRS_PREFIX) else p.source


def hub_source(p: Any) -> str | None:
    """``hub:<dataset>`` when ``prepare.source`` names a dataset to load (``hub:...`` or ``pairs:hub:...``;
    ``prepare.split`` and ``prepare.source_revision`` pick its split and revision), else None."""
    named = _named(p)
    return named if named.startswith(HUB_PREFIX) else None


def source_path(p: Any, root: Path) -> Path | None:
    """The local file/directory ``prepare.source`` names (relative to the project), None for synthetic/hub."""
    if p.source == "synthetic" or hub_source(p) is not None:
        return None
    path = Path(os.path.expanduser(_named(p)))
    return path if path.is_absolute() else root / path


def read_source(p: Any, root: Path, reader: Any, *args: Any) -> Any:
    """``reader(source, *args, split=..., revision=...)`` of ``prepare.source``'s file or hub dataset (``read_pairs``,
    ``read_problems``), its errors naming the parameter (``source_error``)."""
    try:
        return reader(hub_source(p) or source_path(p, root), *args, split=p.split, revision=p.source_revision)
    except (DataFormatError, FileNotFoundError) as error:
        raise source_error(p, error) from None


def source_error(p: Any, error: Exception) -> Exception:
    """``error`` from reading ``prepare.source`` as the same kind of error naming the parameter, with the fix
    when it is obvious (a missing text field whose text is in another field: ``prepare.text_field: review``)."""
    message = f"prepare.source: {error}"
    hint = getattr(error, "hint_field", None)
    if hint:
        message += f". Fix: set `prepare.text_field: {hint}` in params.yaml (now {p.text_field!r})"
    elif isinstance(error, FileNotFoundError):
        message += ". Fix: point `prepare.source` in params.yaml at an existing file or directory (or `synthetic`)"
    if isinstance(error, DataFormatError):
        wrapped = DataFormatError(error.path, error.line, "", hint_field=hint)
        wrapped.args = (message,)
        return wrapped
    return type(error)(message) if isinstance(error, (FileNotFoundError, ValueError)) else error


def check_source(p: Any, root: Path) -> None:
    """Cheap checks of ``prepare.source`` before any server or model starts: the file exists, its type is
    supported and its first record has ``prepare.text_field``. Raises ``source_error``'s errors."""
    path = source_path(p, root)
    if path is None:
        return
    try:
        if p.source.startswith(PAIRS_PREFIX):
            read_pairs(path)  # every row: a bad one is named before anything runs
            return
        read_text_records(path, text_field=p.text_field, limit=1)
    except (DataFormatError, FileNotFoundError) as error:
        raise source_error(p, error) from None


def load_pairs(p: Any, root: Path) -> list[dict]:
    """The preference pairs of ``prepare.source: pairs:<file>`` (or ``pairs:hub:<dataset>``), every row checked
    (errors name the parameter, the file, the row and the column: ``source_error``)."""
    return read_source(p, root, read_pairs)


def load_source(p: Any, root: Path) -> list[str]:
    """The reviews named by ``prepare.source`` (errors name the parameter: ``source_error``)."""
    if p.source == "synthetic":
        return generate_reviews(p.num_reviews, seed=p.seed)
    if p.source.startswith("hub:"):
        return load_hub_texts(p.source[4:], split=p.split, text_field=p.text_field, revision=p.source_revision,
                              limit=p.num_reviews)
    try:
        return read_text_records(source_path(p, root), text_field=p.text_field, limit=p.num_reviews)
    except (DataFormatError, FileNotFoundError) as error:
        raise source_error(p, error) from None


def source_fingerprint(p: Any, root: Path) -> dict[str, str]:
    """``{"source", "md5"}`` of ``prepare.source`` (md5 empty for synthetic/hub: params cover those)."""
    path = source_path(p, root)
    if path is None or not path.exists():
        return {"source": p.source, "md5": ""}
    return {"source": p.source, "md5": md5_dir(path) if path.is_dir() else md5_file(path)}


def source_changed(p: Any, root: Path, data_dir: Path) -> str | None:
    """Why prepare is stale although DVC says it is not (the source file's content changed, or was never
    recorded), else None. Synthetic and hub sources: always None (their params are DVC params)."""
    current = source_fingerprint(p, root)
    if not current["md5"]:
        return None
    try:
        recorded = json.loads((data_dir / SOURCE_FINGERPRINT).read_text())
    except (OSError, ValueError):
        return f"prepare.source {p.source}: no recorded fingerprint"
    if recorded != current:
        return f"prepare.source {p.source}: content changed"
    return None


__all__ = ["PAIRS_PREFIX", "SOURCE_FINGERPRINT", "check_source", "hub_source", "load_pairs", "load_source",
           "read_source", "source_changed", "source_error", "source_fingerprint", "source_path"]
