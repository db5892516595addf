"""What ``prepare`` makes for the arithmetic task: the same six datasets as for sentiment, from generated problems.

The problems come from ``rlhf_core.arithmetic`` with the ``task`` section's difficulty controls and
``prepare.seed``: one pool of distinct problems cut into training and held-out parts, so no held-out problem is
trained on. Rows:

- ``sft_train``: ``{"text"}`` = prompt + worked solution of each training problem (SFT's warm start);
- ``heldout``: the same for the held-out problems (perplexity);
- ``prompts_train`` / ``prompts_eval``: ``{"id", "query", "solution"}`` (RL prompts; evaluation's problems); the
  ``solution`` column is what the verifier (``rlhf_core.rewards.accuracy_reward``) receives;
- ``preferences`` and ``ratings``: empty. Verifier-labelled pairs and ratings are made from the SFT policy's
  samples, which exist only after SFT.
"""

from __future__ import annotations

from collections import Counter

from rlhf_core.arithmetic import Problem, generate_problems, split_problems
from rlhf_core.rewards import accuracy_reward, gold_answer
from tasks.spec.task import TaskParams


def problem_rows(problems: list[Problem]) -> list[dict]:
    """A prompt file's rows: ``id``, ``query`` (the prompt) and ``solution``."""
    return [{"id": p.id, "query": p.prompt, "solution": p.solution} for p in problems]


def arithmetic_datasets(task: TaskParams, seed: int) -> dict[str, list[dict]]:
    """The six datasets of the arithmetic task (see the module docstring), in prepare's ``DATASETS`` order."""
    pool = generate_problems(task.num_train + task.num_eval, task.spec(), seed=seed)
    train, held_out = split_problems(pool, (task.num_train, task.num_eval))
    return {
        "sft_train": [{"text": p.prompt + p.completion} for p in train],
        "heldout": [{"text": p.prompt + p.completion} for p in held_out],
        "prompts_train": problem_rows(train),
        "prompts_eval": problem_rows(held_out),
        "preferences": [],
        "ratings": [],
    }


def answer_histogram(rows: list[dict]) -> list[dict]:
    """plots/prepare.csv for the arithmetic task: training problems per number of answer digits, in prepare's
    columns (``gold_bin``: the digit count, ``count``)."""
    digits = Counter(len(str(abs(int(r["solution"])))) for r in rows)
    return [{"gold_bin": d, "count": digits[d]} for d in sorted(digits)]


def solutions_of(rows: list[dict], where: str) -> list[str]:
    """Each prompt row's ``solution``, checked: a ValueError naming ``where`` (the file), the row (1-based, as its
    line in the JSONL file) and the column when one is missing or has no number the verifier can read."""
    solutions = []
    for line, row in enumerate(rows, start=1):
        if "solution" not in row:
            raise ValueError(f"{where}: row {line} has no 'solution' column (columns: {sorted(row)}); the "
                             "verifier reward needs each prompt's answer")
        if gold_answer(row["solution"]) is None:
            raise ValueError(f"{where}: row {line}, column 'solution': {row['solution']!r} has no number the "
                             "verifier can read")
        solutions.append(str(row["solution"]))
    return solutions


def verifier_scores(queries: list[str], solutions: list[str]):
    """PPO's ``(queries, responses) -> scores`` with the verifier: each response's ``accuracy_reward`` against the
    solution of its query (``queries`` and ``solutions`` are the prompt file's, row by row)."""
    by_query: dict[str, str] = {}
    for query, solution in zip(queries, solutions):
        if by_query.setdefault(query, solution) != solution:
            raise ValueError(f"the prompt {query!r} appears with two solutions, {by_query[query]!r} and {solution!r}")

    def score(batch_queries: list[str], responses: list[str]) -> list[float]:
        rewards = accuracy_reward(responses, [by_query[q] for q in batch_queries])
        return [float(r) for r in rewards]  # never None: every solution was checked readable above

    return score


__all__ = ["answer_histogram", "arithmetic_datasets", "problem_rows", "solutions_of", "verifier_scores"]
