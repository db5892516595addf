"""Atomic file outputs of the stage tasks: a whole directory, or one text/JSON/CSV file, or nothing at all.

A directory output holds only what follows from the stage's inputs (DVC hashes it): ``atomic_dir`` drops the
loading-environment keys transformers writes into ``tokenizer_config.json`` before swapping it in.

Under a launcher only the main process writes: ``write_atomic``/``write_json``/``write_csv`` do nothing on the
other ranks and ``atomic_dir`` hands them a private scratch directory outside the project.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlhf_core.checkpointing import atomic_directory
from tasks.process.ranks import is_main_process


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside ``target``; on success fsync it and swap it in place of ``target``, on error
    delete it (``rlhf_core.checkpointing.atomic_directory``: a crash leaves the old output or the new one).

    On a non-main rank of a launch: a private scratch directory outside the project, deleted afterwards (every
    rank still calls the trainers' save, which sharded setups need as a collective; DDP saves on rank 0 only).
    """
    if not is_main_process():
        with tempfile.TemporaryDirectory(prefix=f"rlhf-{Path(target).name}-rank-") as scratch:
            yield Path(scratch)
        return
    with atomic_directory(target) as tmp:
        yield tmp
        drop_load_environment(tmp)  # DVC tracks the directory: the same inputs must give the same bytes


LOAD_ENVIRONMENT_KEYS = ("is_local", "local_files_only")
"""Keys transformers copies into a saved ``tokenizer_config.json`` from how the tokenizer was *loaded* (from a
local folder; ``local_files_only``, true whenever ``HF_HUB_OFFLINE=1``), not from what the tokenizer is: the
same stage gave a different file, hence a different DVC hash, with and without ``HF_HUB_OFFLINE``."""


def drop_load_environment(directory: str | Path) -> list[Path]:
    """Remove ``LOAD_ENVIRONMENT_KEYS`` from every ``tokenizer_config.json`` under ``directory``; returns the
    files rewritten (in transformers' own layout: sorted keys, indent 2, a final newline)."""
    rewritten = []
    for path in sorted(Path(directory).rglob("tokenizer_config.json")):
        config = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(config, dict) and set(config) & set(LOAD_ENVIRONMENT_KEYS):
            kept = {k: v for k, v in config.items() if k not in LOAD_ENVIRONMENT_KEYS}
            path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
            rewritten.append(path)
    return rewritten


def write_atomic(path: str | Path, text: str, scratch: str | Path | None = None) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename. Nothing on a non-main rank of a launch.
    ``scratch``: the folder of the temp file when it is on the same file system (a rename within one is atomic),
    so a process killed before the rename leaves its temp file there, not beside ``path`` (in a folder DVC hashes)."""
    if not is_main_process():
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=temp_folder(path, scratch))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def temp_folder(path: Path, scratch: str | Path | None) -> Path:
    """Where the temp file of ``path`` goes: ``scratch`` (created) when on ``path``'s file system, else beside it."""
    if scratch is None:
        return path.parent
    scratch = Path(scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    return scratch if os.stat(scratch).st_dev == os.stat(path.parent).st_dev else path.parent


def write_json(path: str | Path, obj: Any) -> None:
    """``obj`` as indented JSON (keys in insertion order), atomically."""
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_csv(path: str | Path, rows: list[Mapping[str, Any]], columns: list[str] | None = None) -> None:
    """``rows`` as CSV with a header (``columns``, default the first row's keys; missing cells empty), atomically."""
    columns = columns or (list(rows[0].keys()) if rows else [])
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in columns})
    write_atomic(path, buf.getvalue())


__all__ = ["LOAD_ENVIRONMENT_KEYS", "atomic_dir", "drop_load_environment", "write_atomic", "write_csv", "write_json"]
