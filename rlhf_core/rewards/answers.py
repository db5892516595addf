"""Finding and comparing final answers: the text-level half of every verifier (pure, no I/O).

A completion states its final answer in one of the formats a task asks for:

- ``<answer>42</answer>`` (the tag; the last one counts),
- ``#### 42`` (GSM8K's marker; the last one counts),
- ``\\boxed{42}`` (LaTeX, as maths models write it).

Numbers are compared exactly, as fractions, after normalisation: surrounding space, a leading ``+``, ``$`` or
a trailing ``.``/``%`` sign are dropped, thousands separators (``1,234``) removed, the Unicode minus read as ``-``;
``0.5``, ``1/2`` and ``.50`` are the same number, as are ``5`` and ``5.0``. Comparing fractions, never floats,
keeps the verdict exact for every answer.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

ANSWER_FORMATS = ("tag", "hashes", "boxed")
"""The ways a completion may state its answer: ``<answer>..</answer>``, ``#### n``, ``\\boxed{n}``."""

_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_HASHES = re.compile(r"####[ \t]*([^\s<]*)")  # the token after the marker
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_PATTERNS = {"tag": _TAG, "hashes": _HASHES, "boxed": _BOXED}
# a number after normalisation: an optional sign, digits with an optional decimal part (or a leading-dot
# decimal), an optional exponent, and optionally "/ denominator"
_NUMBER = re.compile(r"[-]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?(/[-]?\d+(\.\d*)?)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(\D|$))")


def completion_text(completion: Any) -> str:
    """The text of a completion as TRL passes it: a string, or a list of messages (the last one's content)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion is a string or a list of {{'role', 'content'}} messages, got {completion!r:.80}")


def extract_answer(text: str, formats: tuple[str, ...] = ANSWER_FORMATS) -> str | None:
    """The stated final answer (stripped), in the first of ``formats`` the text uses; None when it states none.

    Within a format the last occurrence counts (a model may restate a draft answer before its final one).
    """
    for name in formats:
        if name not in _PATTERNS:
            raise ValueError(f"unknown answer format {name!r}: use some of {ANSWER_FORMATS}")
        found = _PATTERNS[name].findall(text)
        if found:
            return found[-1].strip()
    return None


def parse_number(text: str | int | float | None) -> Fraction | None:
    """The exact value of a number written as text (see the module's normalisation), or None if it is not one."""
    if text is None or isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return Fraction(text) if text == text and abs(text) != float("inf") else None
    cleaned = str(text).strip().replace("\u2212", "-").replace(" ", "")
    cleaned = cleaned.lstrip("+$").rstrip(".%")
    if cleaned.startswith("-$"):
        cleaned = "-" + cleaned[2:]
    cleaned = _THOUSANDS.sub("", cleaned)
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def gold_answer(solution: Any) -> Fraction | None:
    """The reference value of a dataset's ``solution``: a number, a bare numeric string, or a worked solution
    whose answer is marked in one of :data:`ANSWER_FORMATS`. None when no number can be read from it."""
    if isinstance(solution, (int, float)) and not isinstance(solution, bool):
        return parse_number(solution)
    text = str(solution)
    marked = extract_answer(text)
    return parse_number(marked if marked is not None else text)


__all__ = ["ANSWER_FORMATS", "completion_text", "extract_answer", "gold_answer", "parse_number"]
