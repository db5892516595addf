"""rlhf_core.arithmetic: seeded, distinct problems whose stated answers, worked solutions and verifier agree."""

from __future__ import annotations

import ast
import operator

import pytest

from rlhf_core.arithmetic import ArithmeticSpec, generate_problems, render, split_problems, worked_solution
from rlhf_core.rewards import accuracy_reward, answer_format_reward, extract_answer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The expression's value by Python's precedence rules (an independent check of rendering and answers)."""
    def walk(node):
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        assert isinstance(node, ast.Constant)
        return node.value
    return walk(ast.parse(expression, mode="eval").body)


SPECS = [ArithmeticSpec(), ArithmeticSpec(min_digits=2, max_digits=3, operations=("+", "-", "*"), steps=3),
         ArithmeticSpec(operations=("-",), steps=2, answer_format="hashes"),
         ArithmeticSpec(operations=("-", "*"), steps=4, allow_negative=True)]


@pytest.mark.parametrize("spec", SPECS)
def test_answers_worked_solutions_and_the_verifier_agree(spec):
    problems = generate_problems(200, spec, seed=3)
    assert len({p.expression for p in problems}) == 200  # distinct
    for p in problems:
        assert evaluate(p.expression) == int(p.solution)
        assert p.completion.count(" = ") == spec.steps  # one worked line per step
        assert p.expression in p.prompt and p.prompt.endswith("\nA: ")
        if not spec.allow_negative:
            assert all(int(line.split(" = ")[1]) >= 0 for line in p.completion.split(" ; ")[:-1])
    completions = [p.completion for p in problems]
    assert accuracy_reward(completions, [p.solution for p in problems]) == [1.0] * 200
    assert answer_format_reward(completions) == [1.0] * 200
    style = {"tag": ("tag",), "hashes": ("hashes",)}[spec.answer_format]
    assert all(extract_answer(c, style) == p.solution for c, p in zip(completions, problems))


def test_difficulty_controls_are_obeyed():
    spec = ArithmeticSpec(min_digits=2, max_digits=2, operations=("*",), steps=2)
    for p in generate_problems(50, spec, seed=0):
        operands = [int(t) for t in p.expression.replace("(", "").replace(")", "").split() if t.isdigit()]
        assert len(operands) == 3 and all(10 <= x <= 99 for x in operands) and "*" in p.expression
        assert "+" not in p.expression and "-" not in p.expression


def test_same_seed_same_problems_other_seed_others():
    spec = SPECS[1]
    first, again, other = (generate_problems(30, spec, seed=s) for s in (7, 7, 8))
    assert first == again and first != other
    # one fixed example, so a change of the generator (and of every task's data) cannot pass unnoticed
    p = generate_problems(1, ArithmeticSpec(), seed=1)[0]
    assert (p.prompt, p.completion, p.solution) == (
        "Q: 9 + 25 = ? Answer in <answer></answer>.\nA: ", "9 + 25 = 34 ; <answer>34</answer>", "34")


def test_rendering_puts_parentheses_where_precedence_needs_them():
    assert render(2, [("+", 3), ("*", 4)]) == "(2 + 3) * 4"
    assert render(2, [("*", 3), ("+", 4), ("*", 5)]) == "(2 * 3 + 4) * 5"
    assert render(2, [("*", 3), ("*", 4), ("-", 1)]) == "2 * 3 * 4 - 1"
    assert worked_solution(2, [("+", 3), ("*", 4)], "hashes") == (20, "2 + 3 = 5 ; 5 * 4 = 20 ; #### 20")


def test_bad_specs_and_too_small_spaces_are_refused():
    for bad, match in ((dict(min_digits=3, max_digits=2), "min_digits"), (dict(operations=("/",)), "operations"),
                       (dict(steps=0), "steps"), (dict(answer_format="json"), "answer_format")):
        with pytest.raises(ValueError, match=match):
            ArithmeticSpec(**bad)
    with pytest.raises(ValueError, match="distinct problems"):
        generate_problems(500, ArithmeticSpec(max_digits=1, operations=("+",)), seed=0)  # only 100 exist
    train, test = split_problems(generate_problems(10, ArithmeticSpec(), seed=0), (7, 3))
    assert len(train) == 7 and len(test) == 3 and not {p.expression for p in train} & {p.expression for p in test}
    with pytest.raises(ValueError, match="cannot cut"):
        split_problems(train, (5, 5))
