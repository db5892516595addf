"""Atomic file outputs of the stage tasks: a whole directory, or one text/JSON/CSV file, or nothing at all.

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
from tasks.ranks import is_main_process


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


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename. Nothing on a non-main rank of a launch."""
    if not is_main_process():
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


__all__ = ["atomic_dir", "write_atomic", "write_csv", "write_json"]
