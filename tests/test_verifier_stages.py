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
def test_the_arithmetic_task_folder_runs_as_one_pipeline_beside_the_root(tmp_path, monkeypatch):
    """Issue 32: the arithmetic folder (pipelines/arithmetic: its own params.yaml, dvc.yaml, dvc.lock) through the
    pipeline flow, tiny: prepare -> sft -> label (the SFT's samples, verifier-labelled) -> grpo, ppo, rloo on
    ``reward: verifier`` (no reward model; dpo, kto off here) -> evaluate (n samples per problem, pass@k, maj@k, one verdict row per sample) -> the registry on pass@1. Its
    outputs land in the folder, nothing at the root; MLflow is the project's one store; then `dvc repro
    pipelines/arithmetic/dvc.yaml` from the root runs a changed stage through its command."""
    import csv
    import json

    import yaml
    from _pipeline_project import ROOT, make_project, make_task_folder, mlflow_client, run
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import pipeline
    from tasks.store.dvc_ops import _repo

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    project = make_project(tmp_path / "proj")
    folder = make_task_folder(project, "arithmetic", {"task.num_train": 64, "task.num_eval": 8,
                                                       "ppo.sample_every": 0, "label.num_problems": 8,
                                                       "label.samples_per_problem": 4, "label.max_new_tokens": 8,
                                                       # a tiny SFT rarely answers both right and wrong: no pairs
                                                       # (test_label_stage.py trains dpo/kto on labelled samples)
                                                       "dpo.enabled": False, "kto.enabled": False})
    run(["git", "add", "-A"], project)
    run(["git", "commit", "-q", "-m", "arithmetic folder"], project)
    with prefect_test_harness(server_startup_timeout=120):
        summary = pipeline(str(folder))
    assert {"prepare", "sft", "label", "grpo", "ppo", "rloo", "evaluate"} <= set(summary["ran"])
    labelled = json.loads((folder / "metrics" / "label.json").read_text())  # dpo/kto's data: the SFT's samples
    assert (labelled["problems"], labelled["samples"]) == (8, 32)
    assert len((folder / "data" / "labelled" / "verdicts.jsonl").read_text().splitlines()) == 32
    assert json.loads((folder / "metrics" / "grpo.json").read_text())["steps"] == 2
    for stage, column in (("grpo", "reward"), ("ppo", "reward_mean")):
        lines = (folder / "plots" / f"{stage}.csv").read_text().splitlines()
        index = lines[0].split(",").index(column)
        rewards = [float(line.split(",")[index]) for line in lines[1:]]
        assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards), (stage, rewards)  # a mean of 0/1 verdicts
    results = json.loads((folder / "metrics" / "evaluate.json").read_text())
    assert set(results) == {"sft", "ppo", "grpo", "rloo", "scored"}
    for policy in ("sft", "ppo", "grpo", "rloo"):
        m = results[policy]
        assert {"pass@1", "pass@4", "pass@8", "maj@1", "maj@4", "maj@8", "format_error_rate", "mean_length",
                "kl"} == set(m)
        assert 0 <= m["pass@1"] <= m["pass@4"] <= m["pass@8"] <= 1 and 0 <= m["format_error_rate"] <= 1
    assert results["sft"]["kl"] == 0.0
    with (folder / "data" / "evaluate_prompts.csv").open(newline="", encoding="utf-8") as f:
        verdicts = list(csv.DictReader(f))  # completions may hold newlines: read as CSV, not lines
    assert list(verdicts[0]) == ["policy", "problem_id", "sample", "solution", "answer", "correct", "format_ok",
                                 "length", "completion"]
    assert len(verdicts) == 4 * 8 * 8  # policies x held-out problems (evaluate.num_prompts) x samples
    problems = {r["id"]: r["solution"] for r in
                (json.loads(line) for line in (folder / "data" / "prompts_eval.jsonl").read_text().splitlines())}
    assert all(problems[v["problem_id"]] == v["solution"] for v in verdicts)

    # the registry decided on pass@1, into the task's own registered model
    decision = summary["registry"]
    assert decision["registered"] and decision["model"] == "rlhf-policy-arithmetic"
    assert decision["decided_by"] == "pass@1" and decision["decision"] == "promote"  # no champion yet
    client = mlflow_client(project)
    version = client.get_model_version("rlhf-policy-arithmetic", str(decision["version"]))
    assert version.tags["decided_by"] == "pass@1" and "`pass@1`" in version.description

    # the folder's own records; nothing at the root; the project's one MLflow store, runs tagged with the folder
    assert set(yaml.safe_load((folder / "dvc.lock").read_text())["stages"]) == set(summary["ran"])
    assert not any((project / name).exists() for name in ("dvc.lock", "data", "models", "metrics", "plots"))
    assert not (folder / "mlflow.db").exists() and (project / "mlflow.db").is_file()
    parent = client.get_run(summary["mlflow_run"])
    assert parent.data.tags["rlhf.task_folder"] == "pipelines/arithmetic"
    with _repo(folder) as repo:
        assert repo.status(targets=["dvc.yaml"]) == {}  # (the root's dvc.yaml, never run here, is stale)

    # dvc repro of the folder's dvc.yaml, from the repository root: a changed evaluate param re-runs evaluate only,
    # through its command (up to the root, the stage with --root the folder)
    params = yaml.safe_load((folder / "params.yaml").read_text())
    params["evaluate"]["num_prompts"] = 4
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([str(ROOT / ".venv" / "bin" / "python"), "-m", "tasks.store.dvc_lockfile", "repro",
               "pipelines/arithmetic/dvc.yaml"], project)
    assert "Running stage 'pipelines/arithmetic/dvc.yaml:evaluate'" in out, out
    assert "Stage 'pipelines/arithmetic/dvc.yaml:sft' didn't change" in out, out  # the trained stages are not re-run
    with (folder / "data" / "evaluate_prompts.csv").open(newline="", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == 4 * 4 * 8
    with _repo(folder) as repo:
        assert repo.status(targets=["dvc.yaml"]) == {}  # (the root's dvc.yaml, never run here, is stale)
