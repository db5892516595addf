"""The ``task`` section of params.yaml: which task every stage serves, and where its problems come from.

A task is data, a reward and a metric (DESIGN.md): ``sentiment`` (reviews, a learned reward model, the VADER gold
judge; the default), ``arithmetic`` (problems generated offline from ``prepare.seed`` by
``rlhf_core.arithmetic``, scored by a verifier) or ``problems`` (a user's own file of problems and answers named by
``prepare.source``, scored by the same verifier). The keys below the name are the arithmetic task's difficulty
controls and the columns of a user's file; the sentiment task does not read them (its outputs do not depend on them). A stage that reads the task
declares it (its row's ``task_reads``: :data:`TASK_READS` join its params in dvc.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from rlhf_core.arithmetic import ANSWER_STYLES, OPERATIONS, ArithmeticSpec
from tasks.spec.param_rules import ValueRules

TASKS = ("sentiment", "arithmetic", "problems")
"""The tasks: the two shipped ones, and ``problems``, a user's own file of problems and answers."""


@dataclass(frozen=True)
class TaskParams:
    """The task the pipeline serves and, for ``arithmetic``, its problems."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("min_digits", "max_digits", "steps", "num_train", "num_eval", "samples_per_problem"),
        choices={"name": TASKS, "answer_format": tuple(ANSWER_STYLES)})
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    name: str
    """``sentiment`` (the default) or ``arithmetic``."""
    min_digits: int
    """Arithmetic: fewest digits of an operand."""
    max_digits: int
    """Arithmetic: most digits of an operand."""
    operations: str
    """Arithmetic: the operations drawn from, written together (``+-``, ``+-*``)."""
    steps: int
    """Arithmetic: operations per problem (2 or more: multi-step, one worked line per step)."""
    answer_format: str
    """Arithmetic: how the answer is stated, ``tag`` (``<answer>n</answer>``) or ``hashes`` (``#### n``)."""
    num_train: int
    """Arithmetic: training problems (SFT's worked solutions and the RL prompts)."""
    num_eval: int
    """Arithmetic: held-out problems (evaluation), none of them a training problem."""
    samples_per_problem: int
    """Evaluate: samples of each held-out problem per policy (the n of pass@k)."""
    pass_k: list
    """Evaluate: the k of pass@k and maj@k reported (each in [1, samples_per_problem]; pass@1 always is)."""
    prompt_field: str
    """Problems: the column of ``prepare.source`` holding each prompt (text; ``rlhf_core.user_problems``)."""
    answer_field: str
    """Problems: the column holding each answer the verifier checks."""
    completion_field: str
    """Problems: the column holding a worked solution for SFT (optional per row; without one SFT learns
    ``answer_format``'s statement of the answer)."""

    def problems(self, name: str) -> list[str]:
        """Difficulty controls the generator accepts (its own checks, named by key) and the k of pass@k."""
        if any(op not in OPERATIONS for op in self.operations) or not self.operations:
            return [f"{name}.operations must be made of {''.join(OPERATIONS)}, got {self.operations!r}"]
        if not self.pass_k or any(isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.samples_per_problem
                                  for k in self.pass_k):
            return [f"{name}.pass_k must be a list of integers in [1, {name}.samples_per_problem="
                    f"{self.samples_per_problem}], got {self.pass_k!r}"]
        try:
            self.spec()
        except ValueError as err:
            return [f"{name}: {err}"]
        return []

    def spec(self) -> ArithmeticSpec:
        """The generator's spec of these controls."""
        return ArithmeticSpec(min_digits=self.min_digits, max_digits=self.max_digits,
                              operations=tuple(dict.fromkeys(self.operations)), steps=self.steps,
                              answer_format=self.answer_format)


TASK_READS = tuple(f"task.{f.name}" for f in fields(TaskParams))
"""The dotted keys a task-reading stage declares (all of the section)."""


def task_problems(params: Any) -> list[str]:
    """What a verifiable task cannot run, by key: a policy stage on a reward the task does not have (no reward model
    is trained for it). Empty for sentiment. (``dpo``/``kto`` train on the ``label`` stage's verifier-labelled
    samples of the SFT policy there.)"""
    task = params.section("task")
    if task.name == "sentiment":
        return []
    return [f"{stage}.reward must be verifier for task.name: {task.name} (no reward model is trained for it)"
            for stage in ("ppo", "grpo", "rloo") if params.section(stage).enabled
            and params.section(stage).reward != "verifier"]


def task_of(params: Any) -> TaskParams:
    """The ``task`` section as :class:`TaskParams` from a stage's params view (which hands out declared keys only)."""
    section = params.section("task")
    return TaskParams(**{f.name: getattr(section, f.name) for f in fields(TaskParams)})


__all__ = ["TASKS", "TASK_READS", "TaskParams", "task_of", "task_problems"]
