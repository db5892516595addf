"""What a user sees: the end-of-run block, the MLflow parent run's name/params/metrics/note, Prefect run names."""

from __future__ import annotations

import json

import pytest

from flows.summary import champion_of, end_block, results_table
from tasks.store.mlflow_runs import NOOP_NAME, changed_params, headline_metrics, pipeline_run_name

RESULTS = {"sft": {"gold_reward": 0.1113, "rm_reward": 0.5196, "kl": 0.0, "perplexity": 2.6284, "win_rate": 0.5},
           "ppo": {"gold_reward": 0.6666, "rm_reward": 3.6327, "kl": 3.3283, "perplexity": 3.0891, "win_rate": 0.8379}}


def test_results_table_is_aligned_rounded_and_marks_the_champion():
    table = results_table(RESULTS, champion="ppo").splitlines()
    assert table[0].split() == ["policy", "gold", "reward", "RM", "score", "KL", "perplexity", "win", "rate"]
    assert table[2].split() == ["sft", "0.111", "0.520", "0.00", "2.63", "0.500"]
    assert table[3].split() == ["ppo", "0.667", "3.633", "3.33", "3.09", "0.838", "<-", "champion"]
    assert len({len(line) for line in table[:3]}) == 1  # header, rule and rows share one width
    assert "champion" not in results_table(RESULTS, champion=None)


def test_results_table_keeps_unknown_metrics_and_handles_no_results():
    table = results_table({"a": {"gold_reward": 1.0, "extra": 2.0}}, None).splitlines()
    assert table[0].split() == ["policy", "gold", "reward", "extra"] and table[2].split() == ["a", "1.000", "2.000"]
    assert "no evaluation results" in results_table({}, None)


def test_champion_only_when_the_registry_promoted_in_this_run():
    assert champion_of({"registered": True, "decision": "promote", "policy": "ppo"}) == "ppo"
    assert champion_of({"registered": True, "decision": "keep", "policy": "ppo"}) is None
    assert champion_of({"registered": False, "reason": "already registered"}) is None


def test_end_block_is_one_block_with_link_and_runnable_commands():
    url = "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    block = end_block(RESULTS, ["ppo", "evaluate"], {"registered": True, "decision": "promote", "policy": "ppo",
                                                       "reason": "no champion yet"}, url)
    lines = block.splitlines()
    assert lines[1] == "=" * 72 and lines[-1] == "=" * 72 and block.count("=" * 72) == 2
    assert "stages run: ppo, evaluate" in block and "registry: no champion yet" in block
    assert f"MLflow run: {url}" in block and "<- champion" in block
    commands = [line.split("#")[0].strip() for line in lines[lines.index("Next:") + 1:-1]]
    assert commands and all(c.startswith((".venv/bin/", "make ")) for c in commands)  # run with or without the venv
    offline = end_block({}, [], {"registered": False, "reason": "tracking store unavailable"}, None)
    assert "MLflow run: none" in offline and "none (everything up to date)" in offline
    assert "tracking store unavailable" in offline
    noop = end_block(RESULTS, [], {"registered": False, "reason": "already registered"}, None, noop=True)
    assert "MLflow run: none kept (nothing ran" in noop and "unavailable" not in noop


def test_makefile_run_prints_no_second_block():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    run = text[text.index("\nrun:"):text.index("\npipeline:")]
    assert "echo" not in run


def test_pipeline_run_name_says_what_it_did():
    changed = {"ppo.learning_rate": "0.0002"}
    assert pipeline_run_name("synthetic", ["ppo", "evaluate"], changed) == \
        "ppo,evaluate | ppo.learning_rate=0.0002 | data=synthetic"
    assert pipeline_run_name("/data/reviews.jsonl", ["prepare"], {}, dvc_exp="exp-1a2b") == \
        "[exp-1a2b] prepare | data=reviews.jsonl"
    assert pipeline_run_name("synthetic", [], {}) == NOOP_NAME
    from tasks.stages import DEFAULT_STAGES, NAMES

    assert pipeline_run_name("synthetic", list(NAMES), {}, default_stages=DEFAULT_STAGES) == "all stages | data=synthetic"
    assert pipeline_run_name("synthetic", list(DEFAULT_STAGES[1:]), {}, default_stages=DEFAULT_STAGES) == \
        ",".join(DEFAULT_STAGES[1:]) + " | data=synthetic"  # not all: named one by one
    assert pipeline_run_name("synthetic", ["prepare"], {}, failed_stage="sft").startswith("FAILED at sft")
    many = {f"ppo.k{i}": str(i) for i in range(5)}
    assert "(+2)" in pipeline_run_name("synthetic", ["ppo"], many)


def test_changed_params_and_headline_metrics():
    assert changed_params({"a": "1", "b": "2"}, {"a": "1", "b": "3"}) == {"b": "2"}
    assert changed_params({"a": "1", "new": "x"}, {"a": "1"}) == {"new": "x"}
    assert changed_params({"a": "1"}, None) == {}
    assert headline_metrics({"ppo": {"gold_reward": 0.5, "kl": 1, "note": "x"}}) == {"ppo.gold_reward": 0.5,
                                                                                        "ppo.kl": 1.0}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.setenv("RLHF_MLFLOW_EXPERIMENT", "review-test")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "evaluate.json").write_text(json.dumps(RESULTS))
    return tmp_path


def _params(lr: float, source: str = "synthetic"):
    """The project's params with another ``ppo.learning_rate`` and ``prepare.source``."""
    import dataclasses
    from pathlib import Path

    from tasks.spec.params import PARAMS_FILE, Params
    from tasks.stages import load_params

    params = load_params(Path(__file__).resolve().parents[1] / PARAMS_FILE)
    sections = params.sections()
    sections["ppo"] = dataclasses.replace(params.ppo, config={**params.ppo.config, "learning_rate": lr})
    sections["prepare"] = dataclasses.replace(params.prepare, source=source)
    return Params(sections)


def test_parent_run_named_with_params_metrics_note_and_changes(store, monkeypatch):
    import mlflow

    from tasks.store import mlflow_runs

    first = mlflow_runs.start_pipeline_run(store, entry="test")
    assert mlflow.MlflowClient().get_run(first).data.tags["mlflow.runName"] == mlflow_runs.RUNNING_NAME
    assert mlflow_runs.end_pipeline_run(store, first, params=_params(1e-4), ran=["ppo", "evaluate"], skipped=[],
                                        registry={"registered": True, "reason": "promoted"}, results=RESULTS)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-abc")
    second = mlflow_runs.start_pipeline_run(store, entry="test")
    mlflow_runs.end_pipeline_run(store, second, params=_params(2e-4), ran=["ppo", "evaluate"], skipped=["sft"],
                                 registry={"registered": True, "reason": "kept"}, results=RESULTS)
    run = mlflow.MlflowClient().get_run(second)
    experiment = mlflow.MlflowClient().get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # UI: the training view
    assert run.data.tags["mlflow.runName"] == "[exp-abc] ppo,evaluate | ppo.learning_rate=0.0002 | data=synthetic"
    assert run.data.tags["dvc.exp_name"] == "exp-abc" and run.data.tags["rlhf.changed_params"] == "ppo.learning_rate"
    assert run.data.params["ppo.learning_rate"] == "0.0002" and "sft.learning_rate" in run.data.params
    assert run.data.metrics["ppo.gold_reward"] == pytest.approx(0.6666)
    note = run.data.tags["mlflow.note.content"]
    assert "ppo.learning_rate=0.0002" in note and "| ppo |" in note and "skipped): sft" in note


def test_noop_run_is_marked_and_deleted_and_failed_run_carries_the_error(store, monkeypatch):
    import mlflow

    from tasks.store import mlflow_runs

    noop = mlflow_runs.start_pipeline_run(store, entry="test")
    assert mlflow_runs.end_pipeline_run(store, noop, params=_params(1e-4), ran=[], skipped=["sft"],
                                        registry={"registered": False, "reason": "already registered"}) is False
    run = mlflow.MlflowClient().get_run(noop)
    assert run.info.lifecycle_stage == "deleted" and run.data.tags["rlhf.noop"] == "true"
    assert run.data.tags["mlflow.runName"] == NOOP_NAME and not run.data.params

    failed = mlflow_runs.start_pipeline_run(store, entry="test")
    mlflow_runs.end_pipeline_run(store, failed, "FAILED", params=_params(1e-4), ran=["prepare"], failed_stage="sft",
                                 error=ValueError("sft.learning_rate: must be > 0"))
    run = mlflow.MlflowClient().get_run(failed)
    assert run.info.status == "FAILED" and run.info.lifecycle_stage == "active"
    assert run.data.tags["rlhf.failed_stage"] == "sft"
    assert run.data.tags["rlhf.error"] == "ValueError: sft.learning_rate: must be > 0"
    assert run.data.tags["mlflow.runName"].startswith("FAILED at sft")
    assert "**Failed**: stage sft: ValueError" in run.data.tags["mlflow.note.content"]


def test_stage_tracker_drops_a_trainer_param_the_stage_already_logged(tmp_path):
    from rlhf_core.tracking import MemoryTracker
    from tasks.store.mlflow_runs import StageSpoolingTracker

    memory = MemoryTracker()
    tracker = StageSpoolingTracker(lambda project_name, run_name: memory, spool_dir=tmp_path, project_name="p", run_name="ppo")
    tracker.log_params({"ppo.learning_rate": "0.0001", "ppo.steps": "4"})
    tracker.log_params({"learning_rate": 0.0001, "batch_size": 8, "steps": 5})  # steps differs: kept
    assert memory.params == {"ppo.learning_rate": "0.0001", "ppo.steps": "4", "batch_size": 8, "steps": 5}


def test_table_artifacts_sort_by_step():
    from rlhf_core.tracking import table_artifact_file

    names = [table_artifact_file("game_log", s) for s in (1, 10, 2)]
    assert sorted(names) == [table_artifact_file("game_log", s) for s in (1, 2, 10)]
    assert names[0] == "tables/game_log_step000001.json" and table_artifact_file("t", None) == "tables/t.json"


def test_prefect_stage_run_name():
    from flows.stage import stage_run_name

    assert stage_run_name("ppo", {"learning_rate": 1e-4, "total_steps": 20, "x": 1}) == "stage ppo lr=0.0001 steps=20"
    assert stage_run_name("dpo", {"beta": 0.1}) == "stage dpo beta=0.1"
    assert stage_run_name("evaluate", {}) == "stage evaluate"


def test_run_link_opens_the_training_view(monkeypatch):
    from tasks.store.mlflow_runs import mlflow_ui_link

    monkeypatch.delenv("RLHF_MLFLOW_UI_URL", raising=False)
    assert mlflow_ui_link("3", "abc") == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"


def test_stage_note_lists_the_summary():
    from tasks.store.stage_run import stage_note

    note = stage_note("ppo", {"kl_last": 4.58491, "steps": 20})
    assert note.splitlines()[2:] == ["| key | value |", "|---|---|", "| kl_last | 4.5849 |", "| steps | 20 |"]
