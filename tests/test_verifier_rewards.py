"""The verifiers of rlhf_core.rewards (TRL 1.16's names and signatures) and the answer parsing behind them."""

from __future__ import annotations

import pickle
from fractions import Fraction

import pytest

from rlhf_core.rewards import (
    accuracy_reward, answer_format_reward, extract_answer, get_answer_format_reward, get_soft_overlong_punishment,
    gold_answer, parse_number, think_format_reward, verify,
)


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), (" +42. ", Fraction(42)), ("1,234,567", Fraction(1234567)), ("$1,000", Fraction(1000)),
    ("-$5", Fraction(-5)), ("\u22123", Fraction(-3)), ("5.0", Fraction(5)), (".5", Fraction(1, 2)),
    ("1/2", Fraction(1, 2)), ("0.50", Fraction(1, 2)), ("1e3", Fraction(1000)), ("12%", Fraction(12)),
    (7, Fraction(7)), (0.25, Fraction(1, 4)),
])
def test_numbers_are_read_exactly_after_normalisation(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "4 2x", "1/0", "1,23", "--3", "3-", None, True, float("nan"),
                                  float("inf")])
def test_what_is_not_a_number_reads_as_none(text):
    assert parse_number(text) is None


def test_the_stated_answer_is_the_last_in_the_first_format_used():
    assert extract_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_answer("draft #### 3\nfinal #### 4") == "4"
    assert extract_answer(r"so \boxed{17}") == "17"
    assert extract_answer("tag wins: <answer>5</answer> #### 6") == "5"  # formats are tried in order
    assert extract_answer("#### 6 <answer>5</answer>", ("hashes",)) == "6"
    assert extract_answer("no answer here, just 12") is None  # no anchor, no answer (TRL's rule)
    with pytest.raises(ValueError, match="unknown answer format 'xml'"):
        extract_answer("x", ("xml",))


def test_a_gold_solution_is_a_number_or_a_worked_solution_with_a_marked_answer():
    assert gold_answer(12) == 12 and gold_answer("12") == 12
    assert gold_answer("3 + 4 = 7, 7 * 2 = 14\n#### 14") == 14
    assert gold_answer("no number") is None


def test_accuracy_reward_plain_and_conversational_with_none_for_an_unreadable_solution():
    completions = ["<answer>1,234</answer>", "#### 1234.0", "1234", r"\boxed{2468/2}", "<answer>1235</answer>"]
    assert accuracy_reward(completions, ["1234"] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]
    chat = [[{"role": "assistant", "content": "<answer>0.5</answer>"}]]
    assert accuracy_reward(completions=chat, solution=["#### 1/2"], prompts=["p"], trainer_state=None) == [1.0]
    assert accuracy_reward(["<answer>3</answer>"], ["n/a"]) == [None]  # skip, do not punish
    logged = {}
    accuracy_reward(["<answer>3</answer>", "x"], ["3", "4"], log_extra=logged.__setitem__)
    assert logged == {"solution": ["3", "4"], "answer_parsed": ["3", "[no answer]"]}
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        accuracy_reward(["a", "b"], ["1"])


def test_verify_reports_answer_verdict_and_format():
    assert verify("<answer>07</answer>", "7") == verify("<answer>07</answer>", 7)
    v = verify("<answer>07</answer>", "7")
    assert (v.answer, v.correct, v.format_ok) == ("07", True, True)
    v = verify("<answer>seven</answer>", "7")
    assert (v.answer, v.correct, v.format_ok) == ("seven", False, False)
    assert verify("#### 7", "?").correct is None


def test_think_format_reward_follows_trl_116():
    completions = ["<think>\nreasoning\n</think>\nanswer", "<think>\nreasoning\nanswer", "x<think>r</think>",
                   "<think>a<think>b</think>", [{"role": "assistant", "content": "<think></think>ok"}]]
    assert think_format_reward(completions) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_answer_format_reward_per_format_and_picklable():
    completions = ["<answer>3</answer>", "#### 3", r"\boxed{3}", "<answer>three</answer>", "3"]
    assert answer_format_reward(completions) == [1.0, 1.0, 1.0, 0.0, 0.0]
    tag_only = get_answer_format_reward("tag")
    assert tag_only(completions=completions) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert tag_only.__name__ == "answer_format_reward"
    assert pickle.loads(pickle.dumps(tag_only)).formats == ("tag",)
    with pytest.raises(ValueError, match="formats must be some of"):
        get_answer_format_reward(("tag", "json"))


def test_soft_overlong_punishment_is_daposs_eq_13():
    # L_max 100, cache 20: free up to 80 tokens, then (80 - L) / 20, -1 past 100
    penalty = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    lengths = [10, 80, 81, 90, 100, 101]
    assert penalty([[0] * n for n in lengths]) == [0.0, 0.0, -0.05, -0.5, -1.0, -1.0]
    assert penalty.__name__ == "soft_overlong_punishment_reward"
    hard = get_soft_overlong_punishment(10, 0)  # no soft band: a cliff at L_max
    assert hard(completion_ids=[[0] * 10, [0] * 11]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(10, 11)


def test_reasoning_accuracy_reward_verifies_only_what_follows_the_reasoning():
    """TRL 1.16's reasoning_accuracy_reward (trl/scripts/grpo.py imports it): the answer after the reasoning counts,
    unfinished reasoning is 0.0 (not None), an unreadable solution None."""
    from rlhf_core.rewards import reasoning_accuracy_reward

    completions = ["<think>1 + 2 = <answer>4</answer>?</think> <answer>3</answer>",  # the answer after </think>
                   "<think>1 + 2 = 3 so <answer>3</answer>",  # reasoning never closed
                   "<think>ok</think> <answer>4</answer>",
                   [{"role": "assistant", "content": "<think>x</think>#### 3"}]]
    assert reasoning_accuracy_reward(completions, ["3", "3", "3", "3"]) == [1.0, 0.0, 0.0, 1.0]
    assert reasoning_accuracy_reward(["<think>a</think> <answer>3</answer>"], ["no number"]) == [None]
    logged = {}
    reasoning_accuracy_reward(completions[:2], ["3", "3"], log_extra=lambda k, v: logged.setdefault(k, v))
    assert logged["answer_parsed"] == ["3", "[incomplete reasoning]"]
