"""A user's own preference pairs: a JSONL, CSV or Parquet file (or a folder of them), or a dataset named
``hub:<name>`` (``rlhf_core.data.iter_hub_records``), of ``prompt`` / ``chosen`` / ``rejected`` rows, read and
checked (TRL's preference formats, plain or conversational).

- plain: ``prompt``, ``chosen`` and ``rejected`` are texts (the two answers continue the prompt);
- conversational: ``prompt`` is a list of ``{"role", "content"}`` messages ending with a user turn, ``chosen`` and
  ``rejected`` lists of messages holding the assistant's answer (``rlhf_core.user_problems.check_messages``).

Every row is checked before anything is returned; the first problem is a ``DataFormatError`` naming the file, the
row (its line in a JSONL or CSV file, the header being a CSV's line 1; the row number, from 1, in a Parquet file)
and the column. Pure: no model, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_core.data import DataFormatError, iter_source_records
from rlhf_core.user_problems import check_messages

PAIR_COLUMNS = ("prompt", "chosen", "rejected")
"""The columns of a preference-pair row."""


def _prompt(value: Any, file: str | Path, row: int) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataFormatError(file, row, "column 'prompt': the prompt is empty")
        return value
    return check_messages(value, file, row, "prompt", needs_assistant=False)


def _answer(value: Any, file: str | Path, row: int, column: str) -> str | list[dict]:
    if isinstance(value, str):
        if not value.strip():
            raise DataFormatError(file, row, f"column {column!r}: the answer is empty")
        return value
    if value is None:
        raise DataFormatError(file, row, f"column {column!r}: no answer (null)")
    return check_messages(value, file, row, column, needs_assistant=True)


def check_pair(record: dict, file: str | Path, row: int) -> dict:
    """One row as ``{"prompt", "chosen", "rejected"}``, checked (see the module docstring)."""
    for column in PAIR_COLUMNS:
        if column not in record:
            raise DataFormatError(file, row, f"no column {column!r}; a preference pair has {list(PAIR_COLUMNS)}, the "
                                             f"row has {sorted(record)}")
    pair = {"prompt": _prompt(record["prompt"], file, row),
            **{c: _answer(record[c], file, row, c) for c in ("chosen", "rejected")}}
    if pair["chosen"] == pair["rejected"]:
        raise DataFormatError(file, row, "columns 'chosen' and 'rejected': the same answer (no preference)")
    return pair


def read_pairs(path: str | Path, split: str = "train", revision: str = "") -> list[dict]:
    """Rows ``{"id", "prompt", "chosen", "rejected"}`` of every pair in ``path`` (a file or folder, or
    ``hub:<dataset>`` with its ``split`` and ``revision``); ``id`` is ``<file name>:<row>``."""
    pairs = [{"id": f"{Path(file).name}:{row}", **check_pair(record, file, row)}
             for file, row, record in iter_source_records(path, "prompt", split, revision)]
    if not pairs:
        raise DataFormatError(path, None, "no preference pairs in the file")
    return pairs


__all__ = ["PAIR_COLUMNS", "check_pair", "read_pairs"]
