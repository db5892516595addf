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
    """The arithmetic task through prepare -> sft -> grpo and ppo with ``reward: verifier`` (tiny sizes, no reward
    model): their rewards are the verifier's 0/1 verdicts."""
    import json

    from _pipeline_project import make_project

    from tasks.run.stage_task import run_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    project = make_project(tmp_path / "proj", {"task.name": "arithmetic", "task.num_train": 64, "task.num_eval": 8,
                                               "grpo.reward": "verifier", "rloo.reward": "verifier",
                                               "ppo.reward": "verifier", "ppo.sample_every": 0, "dpo.enabled": False,
                                               "kto.enabled": False}, git_dvc=False)
    run_stage("prepare", str(project))
    run_stage("sft", str(project))
    metrics = run_stage("grpo", str(project))
    assert metrics["enabled"] and metrics["steps"] == 2
    assert json.loads((project / "metrics" / "grpo.json").read_text())["steps"] == 2
    run_stage("ppo", str(project))
    for stage, column in (("grpo", "reward"), ("ppo", "reward_mean")):
        lines = (project / "plots" / f"{stage}.csv").read_text().splitlines()
        index = lines[0].split(",").index(column)
        rewards = [float(line.split(",")[index]) for line in lines[1:]]
        assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards), (stage, rewards)  # a mean of 0/1 verdicts
