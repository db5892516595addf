"""Issue 32: the registry gate of a verifiable task decides on pass@1, each problem's c/n read from evaluate's verdict
file, compared by the one paired bootstrap over problems (tasks/registry/gate.py); exact small cases."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf_core.evaluation import PairedTest
from tasks.registry.gate import _load_challenger, decide, paired_test, paired_unit, problem_values
from tasks.spec.params import PathsParams, RegistryParams
from tasks.stages.common.scoring import content_md5
from tasks.stages.common.verified_eval import problem_pass, read_problem_pass, write_verdicts

RULE = RegistryParams(model_name="rlhf-policy-arithmetic", candidates=["grpo", "rloo"], metric="pass@1",
                      min_improvement=0.05, max_kl=10.0, max_kl_increase=5.0, significance=0.05,
                      bootstrap_samples=2000, seed=0)
PATHS = PathsParams(data="data", models="models", metrics="metrics", plots="plots", incoming="incoming",
                    allow_outside=False)


def verdict(policy: str, problem: str, sample: int, correct: bool) -> dict:
    return {"policy": policy, "problem_id": problem, "sample": sample, "solution": "4", "answer": "4" if correct else "5",
            "correct": correct, "format_ok": True, "length": 3, "completion": "#### 4" if correct else "#### 5"}


def rows(policy: str, correct_per_problem: dict[str, int], n: int = 4) -> list[dict]:
    """``n`` samples of each problem, the first ``c`` of them correct."""
    return [verdict(policy, q, i, i < c) for q, c in correct_per_problem.items() for i in range(n)]


def test_problem_pass_is_each_problems_c_over_n_in_file_order():
    verdicts = rows("sft", {"p7": 1, "p2": 0, "p9": 4}) + rows("grpo", {"p7": 3, "p2": 2, "p9": 4})
    assert problem_pass(verdicts) == {"sft": {"p7": 0.25, "p2": 0.0, "p9": 1.0},
                                      "grpo": {"p7": 0.75, "p2": 0.5, "p9": 1.0}}
    assert list(problem_pass(verdicts)["sft"]) == ["p7", "p2", "p9"]  # the order the file names them


def test_the_verdict_file_round_trips_to_the_same_rates(tmp_path):
    verdicts = rows("sft", {"a": 1, "b": 3}) + rows("rloo", {"a": 2, "b": 4})
    write_verdicts(tmp_path / "v.csv", verdicts)  # correct is written as True/False
    assert read_problem_pass(tmp_path / "v.csv") == problem_pass(verdicts) == {"sft": {"a": 0.25, "b": 0.75},
                                                                               "rloo": {"a": 0.5, "b": 1.0}}
    assert read_problem_pass(tmp_path / "missing.csv") == {}


def test_problem_values_pair_by_problem_and_refuse_other_problems():
    assert problem_values({"b": 0.5, "a": 0.25}, ["a", "b"], "x") == [0.25, 0.5]
    with pytest.raises(ValueError, match="x: the policies were not scored on the same problems.*'c'"):
        problem_values({"a": 0.25, "b": 0.5}, ["a", "c"], "x")
    with pytest.raises(ValueError, match="first missing: \\['z'\\]"):
        problem_values({"a": 0.25, "z": 0.5}, ["a"], "x")


def test_the_paired_test_over_problems_is_the_one_bootstrap():
    """Every problem better: every resampled mean gain is positive, p = 1 / (S + 1) exactly; no problem differs:
    p = 1. (c/n with n = 4 are exact binary fractions: the means are exact.)"""
    better = paired_test([1.0, 0.75, 0.5, 1.0], [0.5, 0.25, 0.25, 0.75], RULE)
    assert better.n == 4 and better.gain == 0.375 and better.p_value == 1 / (RULE.bootstrap_samples + 1)
    assert paired_test([0.5, 0.25], [0.5, 0.25], RULE).p_value == 1.0


def test_decide_on_pass_at_1_speaks_of_problems():
    assert paired_unit(RULE) == "problems" and paired_unit(replace(RULE, metric="gold_reward")) == "prompts"
    clear = PairedTest(n=64, gain=0.1, low=0.05, high=0.15, p_value=0.001)
    noise = PairedTest(n=64, gain=0.1, low=-0.05, high=0.25, p_value=0.2)
    won = decide({"pass@1": 0.6, "kl": 1.0}, {"pass@1": 0.5, "kl": 1.0}, RULE, clear)
    assert won.promote and "pass@1 0.6000 vs champion 0.5000: gain +0.1000" in won.reason
    assert "paired test over 64 problems: p=0.0010" in won.reason
    lost = decide({"pass@1": 0.6, "kl": 1.0}, {"pass@1": 0.5, "kl": 1.0}, RULE, noise)
    assert not lost.promote and "not beyond the evaluation's noise (paired test over 64 problems" in lost.reason
    assert not decide({"pass@1": 0.53, "kl": 1.0}, {"pass@1": 0.5, "kl": 1.0}, RULE, clear).promote  # < 0.05


def test_the_challenger_of_a_verifiable_task_is_the_best_pass_at_1_with_its_problem_values(tmp_path):
    """Read from metrics/evaluate.json (pass@1 per policy, the scored hashes) and data/evaluate_prompts.csv (one
    verdict row per sample): the challenger is the candidate with the best pass@1; every evaluated policy's c/n per
    problem is ready for the paired test, in the challenger's problem order."""
    for name in ("sft", "grpo", "rloo"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "model.safetensors").write_text(name)
    scored = {n: content_md5(tmp_path / "models" / n) for n in ("sft", "grpo", "rloo")}
    evaluation = {"sft": {"pass@1": 0.25, "kl": 0.0}, "grpo": {"pass@1": 0.625, "kl": 1.0},
                  "rloo": {"pass@1": 0.5, "kl": 1.0}, "scored": {"policies": scored, "evaluation_set": "abc"}}
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "evaluate.json").write_text(json.dumps(evaluation))
    write_verdicts(tmp_path / "data" / "evaluate_prompts.csv", rows("sft", {"q1": 1, "q2": 1})
                   + rows("grpo", {"q1": 4, "q2": 1}) + rows("rloo", {"q1": 2, "q2": 2}))
    challenger = _load_challenger(Path(tmp_path), RULE, PATHS)
    assert challenger.name == "grpo" and challenger.metrics["pass@1"] == 0.625 and challenger.units == ["q1", "q2"]
    assert challenger.values == {"sft": [0.25, 0.25], "grpo": [1.0, 0.25], "rloo": [0.5, 0.5]}
    assert challenger.prompt_scores == {}
    write_verdicts(tmp_path / "data" / "evaluate_prompts.csv", rows("sft", {"q1": 1}))
    with pytest.raises(ValueError, match="no verdicts of grpo"):
        _load_challenger(Path(tmp_path), RULE, PATHS)


def test_pass_at_k_goes_to_mlflow_under_a_key_it_accepts_and_comes_back():
    """MLflow refuses '@' in metric and tag keys: ``pass@1`` is logged and tagged as ``pass_at_1`` and read back as
    ``pass@1``; the sentiment task's names are unchanged."""
    from tasks.registry.gate import _metrics_from_tags
    from tasks.store.mlflow_runs import headline_metrics, mlflow_key

    assert [mlflow_key(k) for k in ("pass@1", "maj@8", "gold_reward", "win_rate")] == [
        "pass_at_1", "maj_at_8", "gold_reward", "win_rate"]
    assert headline_metrics({"grpo": {"pass@1": 0.5, "kl": 1.0}}) == {"grpo.pass_at_1": 0.5, "grpo.kl": 1.0}
    tags = {"metric.pass_at_1": "0.5", "metric.kl": "1.0", "policy": "grpo", "champion.metric.pass_at_1": "0.25"}
    assert _metrics_from_tags(tags) == {"pass@1": 0.5, "kl": 1.0}
    assert _metrics_from_tags(tags, "champion.metric.") == {"pass@1": 0.25}
