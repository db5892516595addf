"""The pipeline's ``reward: verifier`` (grpo, rloo, ppo): each prompt's ``solution`` checked before training,
errors naming file, row and column; the rewards are the verifier's."""

from __future__ import annotations

import pytest

from rlhf_core.rewards import accuracy_reward
from tasks.stages.common.group_policy import ONLINE_REWARDS, text_reward
from tasks.stages.common.problems import solutions_of, verifier_scores
from tasks.stages.ppo import REWARDS


def test_solutions_are_checked_naming_file_row_and_column():
    rows = [{"query": "Q: 1 + 1 = ?", "solution": "2"}, {"query": "Q: 2 + 2 = ?", "solution": 4}]
    assert solutions_of(rows, "data/prompts_train.jsonl") == ["2", "4"]
    with pytest.raises(ValueError, match=r"data/p.jsonl: row 2 has no 'solution' column \(columns: \['query'\]\)"):
        solutions_of([rows[0], {"query": "x"}], "data/p.jsonl")
    with pytest.raises(ValueError, match=r"data/p.jsonl: row 1, column 'solution': 'four' has no number"):
        solutions_of([{"query": "x", "solution": "four"}], "data/p.jsonl")


def test_ppo_scores_each_response_against_its_querys_solution():
    score = verifier_scores(["a", "b"], ["2", "4"])
    assert score(["b", "a", "a"], ["<answer>4</answer>", "<answer>4</answer>", "#### 2"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="appears with two solutions"):
        verifier_scores(["a", "a"], ["2", "3"])


def test_the_stages_accept_the_verifier_and_grpo_gets_trls_accuracy_reward(tmp_path):
    assert "verifier" in ONLINE_REWARDS and "verifier" in REWARDS
    assert text_reward("verifier", tmp_path / "unused") is accuracy_reward  # reads the dataset's solution column


@pytest.mark.slow
def test_sft_then_grpo_on_the_verifier_through_the_stages(tmp_path, monkeypatch):
    """The arithmetic task through prepare -> sft -> grpo, ppo, rloo with ``reward: verifier`` (tiny sizes, no reward
    model; their rewards are the verifier's 0/1 verdicts) -> evaluate (n samples per problem, pass@k, maj@k, one
    verdict row per sample)."""
    import csv
    import json

    from _pipeline_project import make_project

    from tasks.run.stage_task import run_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    project = make_project(tmp_path / "proj", {"task.name": "arithmetic", "task.num_train": 64, "task.num_eval": 8,
                                               "grpo.reward": "verifier", "rloo.reward": "verifier",
                                               "ppo.reward": "verifier", "ppo.sample_every": 0, "dpo.enabled": False,
                                               "kto.enabled": False, "label.num_problems": 8,
                                               "label.samples_per_problem": 4, "label.max_new_tokens": 8},
                           git_dvc=False)
    run_stage("prepare", str(project))
    run_stage("sft", str(project))
    labelled = run_stage("label", str(project))  # the trained SFT's samples, verifier-labelled (dpo/kto's data)
    assert (labelled["problems"], labelled["samples"]) == (8, 32)
    assert len((project / "data" / "labelled" / "verdicts.jsonl").read_text().splitlines()) == 32
    assert labelled["problems_with_both"] + labelled["problems_all_correct"] + labelled["problems_none_correct"] == 8
    metrics = run_stage("grpo", str(project))
    assert metrics["enabled"] and metrics["steps"] == 2
    assert json.loads((project / "metrics" / "grpo.json").read_text())["steps"] == 2
    run_stage("ppo", str(project))
    for stage, column in (("grpo", "reward"), ("ppo", "reward_mean")):
        lines = (project / "plots" / f"{stage}.csv").read_text().splitlines()
        index = lines[0].split(",").index(column)
        rewards = [float(line.split(",")[index]) for line in lines[1:]]
        assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards), (stage, rewards)  # a mean of 0/1 verdicts
    for stage in ("rloo", "dpo", "kto"):  # dpo and kto switched off here (tests/test_label_stage.py trains them)
        run_stage(stage, str(project))
    run_stage("evaluate", str(project))
    results = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert set(results) == {"sft", "ppo", "grpo", "rloo", "scored"}
    for policy in ("sft", "ppo", "grpo", "rloo"):
        m = results[policy]
        assert {"pass@1", "pass@4", "pass@8", "maj@1", "maj@4", "maj@8", "format_error_rate", "mean_length",
                "kl"} == set(m)
        assert 0 <= m["pass@1"] <= m["pass@4"] <= m["pass@8"] <= 1 and 0 <= m["format_error_rate"] <= 1
    assert results["sft"]["kl"] == 0.0
    with (project / "data" / "evaluate_prompts.csv").open(newline="", encoding="utf-8") as f:
        verdicts = list(csv.DictReader(f))  # completions may hold newlines: read as CSV, not lines
    assert list(verdicts[0]) == ["policy", "problem_id", "sample", "solution", "answer", "correct", "format_ok",
                                 "length", "completion"]
    assert len(verdicts) == 4 * 8 * 8  # policies x held-out problems (evaluate.num_prompts) x samples
    problems = {r["id"]: r["solution"] for r in
                (json.loads(line) for line in (project / "data" / "prompts_eval.jsonl").read_text().splitlines())}
    assert all(problems[v["problem_id"]] == v["solution"] for v in verdicts)
