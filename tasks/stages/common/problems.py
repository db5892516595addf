"""What ``prepare`` makes for a verifiable task (``arithmetic``: generated problems; ``problems``: a user's file):
the same six datasets as for sentiment.

The problems come from ``rlhf_core.arithmetic`` with the ``task`` section's difficulty controls and
``prepare.seed``: one pool of distinct problems cut into training and held-out parts, so no held-out problem is
trained on. Rows:

- ``sft_train``: ``{"text"}`` = prompt + worked solution of each training problem (SFT's warm start); a user's
  conversational file: ``{"prompt": [messages], "completion": [messages]}``;
- ``heldout``: the same for the held-out problems (perplexity);
- ``prompts_train`` / ``prompts_eval``: ``{"id", "query", "solution"}`` (RL prompts; evaluation's problems); the
  ``solution`` column is what the verifier (``rlhf_core.rewards.accuracy_reward``) receives;
- ``preferences`` and ``ratings``: empty. Verifier-labelled pairs and ratings are made from the SFT policy's
  samples, which exist only after SFT.
"""

from __future__ import annotations

from collections import Counter

import random

from rlhf_core.arithmetic import ANSWER_STYLES, Problem, generate_problems, split_problems
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


def user_datasets(problems: list[dict], task: TaskParams, eval_fraction: float, seed: int) -> dict[str, list[dict]]:
    """The six datasets from a user's checked problems (``rlhf_core.user_problems.read_problems``): a seeded
    shuffle cut by ``eval_fraction``; SFT learns each row's worked solution, or the answer stated in
    ``task.answer_format`` where the row has none.

    A file with a conversational row (a prompt or a worked solution that is a list of messages) is conversational
    throughout: every prompt becomes messages (a text prompt a user turn), ``sft_train``/``heldout`` rows are TRL's
    conversational prompt-completion rows (a text solution an assistant turn), and the stages render the prompts
    with the policy's chat template where they sample (``tasks/stages/common/chat_prompts.py``)."""
    order = list(range(len(problems)))
    random.Random(seed).shuffle(order)
    held = max(1, round(eval_fraction * len(problems)))
    if held >= len(problems):
        raise ValueError(f"{len(problems)} problems leave none to train on with eval_fraction={eval_fraction}")
    rows = [problems[i] for i in order]
    train, held_out = rows[held:], rows[:held]
    chat = any(not isinstance(p["prompt"], str) or isinstance(p["completion"], list) for p in problems)

    def target(problem: dict) -> str | list[dict]:
        return problem["completion"] or " " + ANSWER_STYLES[task.answer_format].format(problem["solution"])

    def sft_row(problem: dict) -> dict:
        if not chat:
            return {"text": problem["prompt"] + target(problem)}
        answer = target(problem)
        return {"prompt": as_messages(problem["prompt"], "user"),
                "completion": answer if isinstance(answer, list) else as_messages(answer, "assistant")}

    def prompt_rows(part: list[dict]) -> list[dict]:
        return [{"id": p["id"], "query": as_messages(p["prompt"], "user") if chat else p["prompt"],
                 "solution": p["solution"]} for p in part]

    return {"sft_train": [sft_row(p) for p in train], "heldout": [sft_row(p) for p in held_out],
            "prompts_train": prompt_rows(train), "prompts_eval": prompt_rows(held_out), "preferences": [],
            "ratings": []}


def as_messages(value: str | list[dict], role: str) -> list[dict]:
    """A conversation as it is, or a text as one ``role`` turn."""
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def answer_histogram(rows: list[dict]) -> list[dict]:
    """plots/prepare.csv for the arithmetic task: training problems per number of answer digits, in prepare's
    columns (``gold_bin``: the digit count, ``count``)."""
    digits = Counter(len(str(abs(int(gold_answer(r["solution"]))))) for r in rows)  # a fraction counts its integer part
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


__all__ = ["answer_histogram", "arithmetic_datasets", "as_messages", "problem_rows", "solutions_of", "user_datasets", "verifier_scores"]
