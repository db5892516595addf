"""A user's own verifiable problems: a JSONL, CSV or Parquet file (or a folder of them), or a dataset named
``hub:<name>`` (``rlhf_core.data.iter_hub_records``: rows ``hub:<name>[<split>]:<row>``, from 1), read and checked.

Each row holds a prompt and its answer, and optionally a worked solution for SFT:

- the prompt column (``prompt`` by default): plain text, or a conversation (a list of ``{"role", "content"}``
  messages, ending with a user turn) that the policy's chat template renders;
- the answer column (``solution`` by default): a number, or a text whose number the verifier reads
  (``rlhf_core.rewards.answers.gold_answer``: ``42``, ``#### 42``, ``<answer>42</answer>``, a worked solution
  ending in one of those);
- the completion column (``completion``, optional): the worked solution (text, or a list of messages with an
  assistant turn).

Everything is read and checked before anything is returned; the first problem is a ``DataFormatError`` that
names the file, the row (its line in a JSONL or CSV file, the header being a CSV's line 1; the row number, from 1,
in a Parquet file) and the column, so
nothing is written from a file with a bad row. Pure: no model, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf_core.data import DataFormatError, iter_source_records
from rlhf_core.rewards.answers import gold_answer

ROLES = ("system", "user", "assistant", "tool")
"""Message roles a conversation may use."""


def check_messages(value: Any, file: str | Path, row: int, column: str, needs_assistant: bool) -> list[dict]:
    """A list of ``{"role", "content"}`` messages with known roles and text content; with ``needs_assistant``,
    at least one assistant turn (what SFT learns from); else the last turn must not be the assistant's (a prompt)."""
    if not isinstance(value, list) or not value:
        raise DataFormatError(file, row, f"column {column!r}: a conversation is a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise DataFormatError(file, row, f"column {column!r}, message {i}: expected {{'role', 'content'}}, got "
                                             f"{message!r:.80}")
        if message["role"] not in ROLES:
            raise DataFormatError(file, row, f"column {column!r}, message {i}: unknown role {message['role']!r} "
                                             f"(use {', '.join(ROLES)})")
        if not isinstance(message.get("content"), str):
            raise DataFormatError(file, row, f"column {column!r}, message {i}: content must be text")
    roles = [m["role"] for m in value]
    if needs_assistant and "assistant" not in roles:
        raise DataFormatError(file, row, f"column {column!r}: the conversation has no assistant turn to learn from")
    if not needs_assistant and roles[-1] == "assistant":
        raise DataFormatError(file, row, f"column {column!r}: a prompt conversation must end with a user turn, not "
                                         "the assistant's answer")
    return value


def _prompt(record: dict, file: str | Path, row: int, column: str) -> str | list[dict]:
    value = record[column]
    if isinstance(value, str):
        if not value.strip():
            raise DataFormatError(file, row, f"column {column!r}: the prompt is empty")
        return value
    return check_messages(value, file, row, column, needs_assistant=False)


def _completion(record: dict, file: str | Path, row: int, column: str) -> str | list[dict] | None:
    value = record.get(column)
    if value is None or value == "":
        return None
    if isinstance(value, str):
        return value
    return check_messages(value, file, row, column, needs_assistant=True)


def _require(record: dict, file: str | Path, row: int, column: str, what: str) -> None:
    if column not in record:
        raise DataFormatError(file, row, f"no column {column!r} ({what}); the row has {sorted(record)}")


def read_problems(path: str | Path, prompt_field: str = "prompt", answer_field: str = "solution",
                  completion_field: str = "completion", split: str = "train", revision: str = "") -> list[dict]:
    """Rows ``{"id", "prompt", "solution", "completion"}`` of every problem in ``path`` (a file or folder, or
    ``hub:<dataset>`` with its ``split`` and ``revision``; see the module docstring); ``id`` is
    ``<file name>:<row>``, ``completion`` None where the row has none."""
    problems = []
    for file, row, record in iter_source_records(path, prompt_field, split, revision):
        _require(record, file, row, prompt_field, "the prompt")
        _require(record, file, row, answer_field, "the answer the verifier checks")
        answer = record[answer_field]
        if answer is None or gold_answer(answer) is None:
            raise DataFormatError(file, row, f"column {answer_field!r}: {answer!r} has no number the verifier can "
                                             "read (a number, '#### n' or '<answer>n</answer>')")
        problems.append({"id": f"{Path(file).name}:{row}", "prompt": _prompt(record, file, row, prompt_field),
                         "solution": str(answer), "completion": _completion(record, file, row, completion_field)})
    if not problems:
        raise DataFormatError(path, None, "no problems in the file")
    return problems


__all__ = ["ROLES", "check_messages", "read_problems"]
