"""Preference data from verifier-labelled samples (the ``label`` stage): the rule that turns one problem's sampled
completions and their verdicts into DPO pairs and KTO ratings. Pure: lists in, rows out.

Per problem, the completions are first made distinct (the same text sampled twice is one completion, at its first
sample index; its verdict is the same both times since the verifier is a function of the text), then split into
correct and incorrect in sample order. Pair ``k`` is (the ``k``-th correct, the ``k``-th incorrect), the shorter
list cycled, so every distinct completion is used once before any is used twice; ``max(#correct, #incorrect)``
pairs, at most ``max_pairs``. A problem whose samples are all correct, or all incorrect, gives no pair (no
preference between them), but its completions still are KTO ratings (desirable or not). A verdict of None (a
solution without a readable number: not applicable) labels nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LabelledProblem:
    """One problem's distinct completions split by the verifier's verdict (sample order kept)."""

    correct: list[str]
    incorrect: list[str]

    @property
    def has_both(self) -> bool:
        """A correct and an incorrect completion: the problem gives pairs."""
        return bool(self.correct) and bool(self.incorrect)


def split_by_verdict(completions: Sequence[str], verdicts: Sequence[bool | None]) -> LabelledProblem:
    """The distinct completions of one problem, correct and incorrect, in sample order (None verdicts left out)."""
    if len(completions) != len(verdicts):
        raise ValueError(f"{len(completions)} completions but {len(verdicts)} verdicts")
    correct, incorrect, seen = [], [], set()
    for completion, verdict in zip(completions, verdicts):
        if verdict is None or completion in seen:
            continue
        seen.add(completion)
        (correct if verdict else incorrect).append(completion)
    return LabelledProblem(correct, incorrect)


def preference_pairs(prompt: str, labelled: LabelledProblem, max_pairs: int, **extra) -> list[dict]:
    """DPO rows ``{prompt, chosen, rejected, **extra}`` of one problem (the rule in the module docstring)."""
    if max_pairs < 1:
        raise ValueError(f"max_pairs must be >= 1, got {max_pairs}")
    if not labelled.has_both:
        return []
    count = min(max_pairs, max(len(labelled.correct), len(labelled.incorrect)))
    return [{"prompt": prompt, "chosen": labelled.correct[k % len(labelled.correct)],
             "rejected": labelled.incorrect[k % len(labelled.incorrect)], **extra} for k in range(count)]


def ratings(prompt: str, labelled: LabelledProblem, **extra) -> list[dict]:
    """KTO rows ``{prompt, completion, label, **extra}``: every distinct completion, correct ones first."""
    return ([{"prompt": prompt, "completion": c, "label": True, **extra} for c in labelled.correct]
            + [{"prompt": prompt, "completion": c, "label": False, **extra} for c in labelled.incorrect])


__all__ = ["LabelledProblem", "preference_pairs", "ratings", "split_by_verdict"]
