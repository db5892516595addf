"""Verifier rewards with TRL 1.16's reward-function contract (``trl.rewards``' names and signatures).

Each is called as GRPO/RLOO call a reward function: keyword arguments ``prompts``, ``completions`` (strings, or
lists of messages for conversational data), ``completion_ids`` and every dataset column (``solution`` here), and
returns one float per completion, or ``None`` where it does not apply. They are pure and fast (string work only),
so the trainers' time limit is a guard for user functions, not for these.

- :func:`accuracy_reward`: 1.0 when the stated answer equals the ``solution`` exactly (numbers, normalised; see
  :mod:`rlhf_core.rewards.answers`), 0.0 when it differs or no answer is stated, None when the solution itself
  has no readable number (TRL's rule: skip, do not punish). TRL 1.16 parses LaTeX with ``math_verify``; this one
  reads numbers (integers, decimals, fractions), which is what the arithmetic task and GSM8K-style data need.
- :func:`think_format_reward`: TRL 1.16's reasoning format (starts with ``<think>``, one opening tag, closed).
- :func:`answer_format_reward` / :func:`get_answer_format_reward`: the answer is stated in the task's format.
- :func:`get_soft_overlong_punishment`: DAPO's soft length penalty, TRL 1.16's name and formula.
- :func:`verify`: one completion's verdict (extracted answer, correct, format ok), what evaluation records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlhf_core.rewards.answers import ANSWER_FORMATS, completion_text, extract_answer, gold_answer, parse_number


@dataclass(frozen=True)
class Verdict:
    """What a verifier found in one completion."""

    answer: str | None
    """The stated answer as written (None: no answer in the accepted formats)."""
    correct: bool | None
    """Whether it equals the solution; None when the solution has no readable number (not applicable)."""
    format_ok: bool
    """Whether an answer was stated in an accepted format and reads as a number."""


def verify(completion: Any, solution: Any, formats: tuple[str, ...] = ANSWER_FORMATS) -> Verdict:
    """The verdict on one completion (a string or a message list) against its ``solution``."""
    answer = extract_answer(completion_text(completion), formats)
    value = parse_number(answer)
    gold = gold_answer(solution)
    correct = None if gold is None else value is not None and value == gold
    return Verdict(answer=answer, correct=correct, format_ok=value is not None)


def accuracy_reward(completions: Sequence[Any], solution: Sequence[Any],
                    log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[float | None]:
    """1.0 if a completion's stated answer equals its ``solution``, 0.0 if not (or none stated), None if the
    solution has no readable number. ``log_extra(name, values)`` (the trainer's, when given) receives the
    solutions and the extracted answers for the completions table, as TRL 1.16's does."""
    if len(completions) != len(solution):
        raise ValueError(f"accuracy_reward: {len(completions)} completions but {len(solution)} solutions")
    verdicts = [verify(c, s) for c, s in zip(completions, solution)]
    if log_extra is not None:
        log_extra("solution", [str(s) for s in solution])
        log_extra("answer_parsed", [v.answer if v.answer is not None else "[no answer]" for v in verdicts])
    return [None if v.correct is None else float(v.correct) for v in verdicts]


def reasoning_accuracy_reward(completions: Sequence[Any], solution: Sequence[Any],
                              reasoning_delimiters: Sequence[str] | None = None,
                              log_extra: Callable[[str, list], None] | None = None, **kwargs: Any) -> list[float | None]:
    """TRL 1.16's ``reasoning_accuracy_reward`` on this module's exact answers: only what follows the reasoning (the
    text after the first of ``reasoning_delimiters``, default ``["</think>"]``, that occurs) is verified; a completion
    whose reasoning never ends gets 0.0 (not None: incomplete reasoning is penalised), a solution without a readable
    number None. TRL compares LaTeX through ``math_verify``; here answers are numbers, compared exactly.

    Example: solution "3"; "<think>1+2</think> <answer>3</answer>" -> 1.0; "<think>... <answer>3</answer>" -> 0.0.
    """
    if len(completions) != len(solution):
        raise ValueError(f"reasoning_accuracy_reward: {len(completions)} completions but {len(solution)} solutions")
    delimiters = ["</think>"] if reasoning_delimiters is None else list(reasoning_delimiters)
    finals = []
    for completion in completions:
        text = completion_text(completion)
        delimiter = next((d for d in delimiters if d in text), None)
        finals.append(None if delimiter is None else text.split(delimiter)[-1])
    verdicts = [None if final is None else verify(final, sol) for final, sol in zip(finals, solution)]
    if log_extra is not None:
        log_extra("solution", [str(sol) for sol in solution])
        log_extra("answer_parsed", ["[incomplete reasoning]" if v is None else v.answer or "[no answer]"
                                    for v in verdicts])
    return [0.0 if v is None else None if v.correct is None else float(v.correct) for v in verdicts]


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 when a completion starts with ``<think>``, opens no second ``<think>`` and closes it with
    ``</think>`` (anything may follow); else 0.0. TRL 1.16's rule."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        opened = text.startswith("<think>")
        rest = text[len("<think>"):]
        rewards.append(1.0 if opened and "<think>" not in rest and "</think>" in rest else 0.0)
    return rewards


class AnswerFormatReward:
    """1.0 when a completion states a numeric answer in one of ``formats``, else 0.0 (a callable class, not a
    closure, so it pickles; ``__name__`` names its metrics)."""

    def __init__(self, formats: tuple[str, ...] = ANSWER_FORMATS) -> None:
        unknown = [f for f in formats if f not in ANSWER_FORMATS]
        if not formats or unknown:
            raise ValueError(f"formats must be some of {ANSWER_FORMATS}, got {formats!r}")
        self.formats = tuple(formats)
        self.__name__ = "answer_format_reward"

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [float(parse_number(extract_answer(completion_text(c), self.formats)) is not None)
                for c in completions]


def get_answer_format_reward(formats: tuple[str, ...] | str = ANSWER_FORMATS) -> AnswerFormatReward:
    """A format reward accepting only ``formats`` (e.g. ``"tag"`` for ``<answer>..</answer>``)."""
    return AnswerFormatReward((formats,) if isinstance(formats, str) else tuple(formats))


answer_format_reward = AnswerFormatReward()
"""The format reward accepting any of :data:`ANSWER_FORMATS`."""


class SoftOverlongPunishment:
    """DAPO's soft overlong penalty (Eq. 13) on the number of completion tokens ``L``: 0 up to
    ``max_completion_len - soft_punish_cache``, then falling linearly to -1 at ``max_completion_len``, -1 beyond."""

    __name__ = "soft_overlong_punishment_reward"  # TRL 1.16's metric name

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        if max_completion_len < 1:
            raise ValueError(f"max_completion_len must be >= 1, got {max_completion_len}")
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(f"soft_punish_cache must be in [0, max_completion_len], got {soft_punish_cache}")
        self.max_completion_len, self.soft_punish_cache = max_completion_len, soft_punish_cache

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        free = self.max_completion_len - self.soft_punish_cache  # the length that costs nothing
        rewards = []
        for ids in completion_ids:
            length = len(ids)
            if length <= free:
                rewards.append(0.0)
            elif length <= self.max_completion_len:  # only reached with soft_punish_cache > 0
                rewards.append((free - length) / self.soft_punish_cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """TRL 1.16's factory: the soft overlong penalty for completions of at most ``max_completion_len`` tokens."""
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


__all__ = ["AnswerFormatReward", "SoftOverlongPunishment", "Verdict", "accuracy_reward", "answer_format_reward",
           "get_answer_format_reward", "get_soft_overlong_punishment", "think_format_reward", "verify"]
