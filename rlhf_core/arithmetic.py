"""The arithmetic task's problems: generated offline from a seed, with difficulty controls and worked solutions.

Pure: a spec and a seed in, problems out (no files, no model). A problem is an integer expression of
``steps`` operations on operands of ``min_digits``..``max_digits`` digits, evaluated left to right; the prompt
writes it with the parentheses that standard precedence then needs (``(12 + 7) * 3``). Each has

- ``prompt``: the question, ending with the answer format it asks for;
- ``solution``: the exact answer (an integer, as text): what ``rlhf_core.rewards.accuracy_reward`` checks;
- ``completion``: a worked solution, one line per step, then the answer in the stated format: SFT's target.

The same ``(spec, n, seed)`` gives the same problems on every machine (``random.Random`` with an integer seed,
integer arithmetic only). Problems are distinct by expression; :func:`split_problems` cuts a pool into parts
that share no expression, so a held-out problem is never one trained on.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

OPERATIONS = ("+", "-", "*")
"""The operations a problem may use (division is left out: exact integer answers without it stay simple)."""

ANSWER_STYLES = {"tag": "<answer>{}</answer>", "hashes": "#### {}"}
"""How a completion states its final answer, by ``ArithmeticSpec.answer_format``."""

INSTRUCTIONS = {"tag": "Answer in <answer></answer>.", "hashes": "End with #### and the answer."}
"""What the prompt asks for, by answer format (the format is stated, never guessed)."""


@dataclass(frozen=True)
class ArithmeticSpec:
    """Difficulty controls of generated problems."""

    min_digits: int = 1
    """Fewest digits of an operand (1: operands from 0)."""
    max_digits: int = 2
    """Most digits of an operand."""
    operations: tuple[str, ...] = ("+", "-")
    """Operations drawn from (a subset of :data:`OPERATIONS`)."""
    steps: int = 1
    """Operations per problem (2 or more: multi-step problems, one worked line per step)."""
    answer_format: str = "tag"
    """``tag`` (``<answer>n</answer>``) or ``hashes`` (``#### n``)."""
    allow_negative: bool = False
    """Whether an intermediate or final value may be negative; False redraws a step that would go below 0."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 9:
            raise ValueError(f"digits must satisfy 1 <= min_digits <= max_digits <= 9, got "
                             f"min_digits={self.min_digits}, max_digits={self.max_digits}")
        if not self.operations or any(op not in OPERATIONS for op in self.operations):
            raise ValueError(f"operations must be a non-empty subset of {OPERATIONS}, got {self.operations!r}")
        if not 1 <= self.steps <= 8:
            raise ValueError(f"steps must be in [1, 8], got {self.steps}")
        if self.answer_format not in ANSWER_STYLES:
            raise ValueError(f"answer_format must be one of {tuple(ANSWER_STYLES)}, got {self.answer_format!r}")


@dataclass(frozen=True)
class Problem:
    """One generated problem (see the module docstring); ``id`` is stable for a given spec, seed and index."""

    id: str
    expression: str
    prompt: str
    solution: str
    completion: str

    def as_record(self) -> dict[str, str]:
        return asdict(self)


def _operand(rng: random.Random, spec: ArithmeticSpec) -> int:
    digits = rng.randint(spec.min_digits, spec.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


def _apply(value: int, op: str, operand: int) -> int:
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def _draw_chain(rng: random.Random, spec: ArithmeticSpec) -> tuple[int, list[tuple[str, int]]]:
    """The first operand and the (operation, operand) steps. Without negatives, a subtraction that would go
    below 0 becomes an addition (when ``+`` is allowed) or subtracts at most the current value (then the operand
    may have fewer digits than ``min_digits``)."""
    start = _operand(rng, spec)
    value, steps = start, []
    for _ in range(spec.steps):
        op, operand = rng.choice(spec.operations), _operand(rng, spec)
        if not spec.allow_negative and _apply(value, op, operand) < 0:
            op = "+" if "+" in spec.operations else op
            operand = operand if op == "+" else min(operand, value)  # "-" alone: subtract at most the value
        steps.append((op, operand))
        value = _apply(value, op, operand)
    return start, steps


def render(start: int, steps: list[tuple[str, int]]) -> str:
    """The expression of a left-to-right chain with the parentheses standard precedence needs."""
    text, last = str(start), None
    for op, operand in steps:
        if op == "*" and last in ("+", "-"):
            text = f"({text})"
        text, last = f"{text} {op} {operand}", op  # the new top-level operation
    return text


def worked_solution(start: int, steps: list[tuple[str, int]], answer_format: str) -> tuple[int, str]:
    """The answer and the worked solution: ``a op b = c`` per step, then the answer in ``answer_format``."""
    value, lines = start, []
    for op, operand in steps:
        result = _apply(value, op, operand)
        lines.append(f"{value} {op} {operand} = {result}")
        value = result
    return value, " ; ".join(lines) + " ; " + ANSWER_STYLES[answer_format].format(value)


def make_prompt(expression: str, answer_format: str) -> str:
    """The question: the expression and the answer format it asks for, then a newline the answer follows."""
    return f"Q: {expression} = ? {INSTRUCTIONS[answer_format]}\nA: "


def generate_problems(n: int, spec: ArithmeticSpec, seed: int = 0) -> list[Problem]:
    """``n`` distinct problems (by expression) of ``spec`` from ``seed``; a ValueError if the spec has fewer."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(seed)
    problems: list[Problem] = []
    seen: set[str] = set()
    attempts = 0
    while len(problems) < n:
        attempts += 1
        if attempts > 50 * n + 1000:  # a draw repeats only when the space of problems is nearly used up
            raise ValueError(f"only {len(problems)} distinct problems found for n={n} with {spec}: widen the "
                             "digits, operations or steps, or lower n")
        start, steps = _draw_chain(rng, spec)
        expression = render(start, steps)
        if expression in seen:
            continue
        seen.add(expression)
        answer, completion = worked_solution(start, steps, spec.answer_format)
        problems.append(Problem(id=f"arith-{seed}-{len(problems)}", expression=expression,
                                prompt=make_prompt(expression, spec.answer_format), solution=str(answer),
                                completion=completion))
    return problems


def split_problems(problems: list[Problem], sizes: tuple[int, ...]) -> list[list[Problem]]:
    """Consecutive parts of ``sizes`` problems (a generated pool is already in random order and distinct)."""
    if sum(sizes) > len(problems) or any(s < 0 for s in sizes):
        raise ValueError(f"cannot cut {len(problems)} problems into parts of {sizes}")
    parts, start = [], 0
    for size in sizes:
        parts.append(problems[start:start + size])
        start += size
    return parts


__all__ = ["ANSWER_STYLES", "ArithmeticSpec", "INSTRUCTIONS", "OPERATIONS", "Problem", "generate_problems",
           "make_prompt", "render", "split_problems", "worked_solution"]
