"""pass@k (unbiased), pass@1 and maj@k of rlhf_core.evaluation: exact small cases, worked by hand."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from rlhf_core.evaluation import maj_at_k, majority_answer, mean_pass_at_k, pass_at_1, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 0, 1, Fraction(0)), (5, 5, 3, Fraction(1)), (4, 1, 1, Fraction(1, 4)),
    (4, 1, 2, Fraction(1, 2)),    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 2, Fraction(7, 10)),   # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (10, 3, 5, Fraction(11, 12)),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
    (4, 3, 2, Fraction(1)),       # n - c = 1 < k: every pair holds a correct sample
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == float(expected)  # computed exactly, rounded once: equal on every CPU


def test_pass_at_k_is_the_chance_a_random_k_subset_holds_a_correct_sample():
    correct = [True, False, True, False, False, False]  # n 6, c 2
    for k in range(1, 7):
        subsets = list(itertools.combinations(correct, k))
        brute = Fraction(sum(any(s) for s in subsets), len(subsets))
        assert math.isclose(pass_at_k(6, 2, k), float(brute), rel_tol=0, abs_tol=0)  # both exact, rounded once


def test_pass_at_1_is_the_mean_of_c_over_n():
    counts = [(4, 1), (4, 4), (2, 0)]  # 1/4, 1, 0
    assert pass_at_1(counts) == 1.25 / 3
    assert mean_pass_at_k(counts, 2) == (0.5 + 1.0 + 0.0) / 3
    with pytest.raises(ValueError, match="at least one problem"):
        pass_at_1([])


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k needs"):
        pass_at_k(n, c, k)


def test_maj_at_k_votes_over_the_first_k_answers():
    answers = [Fraction(3), Fraction(4), Fraction(4), None, Fraction(3), Fraction(3)]
    correct = [True, False, False, False, True, True]
    assert maj_at_k(answers, correct, 3) == 0.0  # 4 wins 2-1
    assert maj_at_k(answers, correct, 6) == 1.0  # 3 wins 3-2; None does not vote
    assert maj_at_k(answers, correct, 1) == 1.0
    assert majority_answer([Fraction(4), Fraction(3), Fraction(3), Fraction(4)]) == 4  # a tie: the first seen
    assert maj_at_k([None, None], [False, False], 2) == 0.0
    with pytest.raises(ValueError, match="maj_at_k needs"):
        maj_at_k(answers, correct[:2], 2)


def test_verify_samples_scores_n_samples_per_problem_and_keeps_every_verdict():
    from rlhf_core.evaluation import verify_samples

    completions = [["<answer>3</answer>", "<answer>4</answer>", "no answer", "<answer>3</answer>"],  # c 2
                   ["#### 11", "#### 10", "<answer>10</answer>", "#### 12"]]  # c 2
    report = verify_samples(["p0", "p1"], ["3", "10"], completions, [[2, 2, 3, 2], [3, 3, 3, 2]], ks=(1, 2, 4))
    m = report.metrics
    assert m["pass@1"] == 0.5 and report.per_problem == [0.5, 0.5]
    assert m["pass@2"] == pass_at_k(4, 2, 2) == 1 - 1 / 6  # 1 - C(2,2)/C(4,2) per problem
    assert m["pass@4"] == 1.0
    # p0 votes 3 for every k (k=2: a 3-4 tie goes to the first seen); p1 votes 11 (k=1), 11 (k=2: a tie), 10 (k=4)
    assert (m["maj@1"], m["maj@2"], m["maj@4"]) == (0.5, 0.5, 1.0)
    assert m["format_error_rate"] == 1 / 8 and m["mean_length"] == 20 / 8
    assert len(report.verdicts) == 8
    assert report.verdicts[2] == {"problem_id": "p0", "sample": 2, "solution": "3", "completion": "no answer",
                                  "answer": "", "correct": False, "format_ok": False, "length": 3}
    with pytest.raises(ValueError, match="no readable number"):
        verify_samples(["x"], ["?"], [["#### 1"]], [[1]], ks=(1,))
    with pytest.raises(ValueError, match=r"every k must be in \[1, n=4\]"):
        verify_samples(["p0"], ["3"], completions[:1], [[1] * 4], ks=(5,))
