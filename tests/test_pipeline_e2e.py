"""The whole pipeline once, under prefect_test_harness, in a temporary git + DVC repo with its own MLflow
store and tiny parameters: first run, cached second run, a PPO parameter change, dvc repro agreement."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from _pipeline_project import ROOT, make_project, mlflow_client, run, write_params

from tasks.spec.params import METRIC_KEYS
from tasks.stages import BY_NAME, DEFAULT_STAGES, NAMES, POLICIES

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("e2e") / "proj")


def _dvc_status(root) -> dict:
    from tasks.store.dvc_ops import _repo

    with _repo(root) as repo:
        return repo.status()


def test_pipeline_end_to_end(harness, project, monkeypatch):
    from flows.pipeline import pipeline

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)

    # 1. first run: every stage, then the registry
    first = pipeline(str(project))
    assert first["ran"] == list(NAMES)  # ddpo too: disabled, it writes its placeholder
    assert _dvc_status(project) == {}
    results = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert list(results) == [*POLICIES, "scored"]  # + the hashes evaluate scored (tasks/stages/evaluate.py)
    for policy in POLICIES:
        assert list(results[policy]) == list(METRIC_KEYS)
    assert results["sft"]["kl"] == 0.0 and results["sft"]["win_rate"] == 0.5
    for stage in DEFAULT_STAGES:
        assert (project / "metrics" / f"{stage}.json").is_file()
        assert (project / "plots" / f"{stage}.csv").is_file()
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert set(lock) == set(NAMES)
    assert first["registry"]["registered"] and first["registry"]["decision"] == "promote"

    # MLflow: one parent, one child per stage (+ registry), tagged with provenance
    client = mlflow_client(project)
    exp = client.get_experiment_by_name("rlhf-pipeline")
    runs = client.search_runs([exp.experiment_id])
    parent = client.get_run(first["mlflow_run"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rlhf.kind"] == "pipeline"
    children = {r.data.tags["rlhf.stage"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    # a stage that serves other tasks only (label: the verifiable ones) writes placeholders here, with no run
    assert set(children) == {s for s in DEFAULT_STAGES if not BY_NAME[s].serves or "sentiment" in BY_NAME[s].serves} \
        | {"registry"}
    for stage, child in children.items():
        tags = child.data.tags
        assert len(tags["git.commit"]) == 40
        assert tags["prefect.flow_run_id"]
        assert any(key.startswith("dvc.input.") for key in tags), stage
    assert children["ppo"].data.params["ppo.learning_rate"] == "0.0001"
    assert "objective/kl" in children["ppo"].data.metrics and "env/reward_mean" in children["ppo"].data.metrics
    assert "dvc.input.models/sft" in children["ppo"].data.tags
    ppo_artifacts = {a.path for a in client.list_artifacts(children["ppo"].info.run_id)}
    assert "model_card.md" in ppo_artifacts
    eval_artifacts = {a.path for a in client.list_artifacts(children["evaluate"].info.run_id, "tables")}
    assert "tables/before_after.json" in eval_artifacts
    assert children["prepare"].inputs.dataset_inputs  # datasets logged as inputs
    champion = client.get_model_version_by_alias("rlhf-policy", "champion")
    assert champion.tags["decision"] == "promote" and champion.tags["reason"]

    # 2. nothing changed: no training, seconds, registry untouched
    start = time.time()
    second = pipeline(str(project))
    assert second["ran"] == []
    assert time.time() - start < 30
    assert second["registry"]["registered"] is False
    assert len(client.search_model_versions("name='rlhf-policy'")) == 1

    # dvc repro agrees: nothing to do
    out = run([str(ROOT / ".venv" / "bin" / "dvc"), "repro"], project)
    assert "up to date" in out.lower() or "didn't change" in out.lower()

    # 3. a PPO parameter change re-runs ppo and what depends on it, nothing else
    write_params(project, {"ppo.learning_rate": 2e-4})
    third = pipeline(str(project))
    assert third["ran"] == ["ppo", "evaluate"]
    assert _dvc_status(project) == {}

    # 3b. the same change through DVC: dvc repro runs the same tasks (python -m flows.stage) for ppo and
    # evaluate only, and the flow then agrees that nothing is stale
    from prefect.settings import PREFECT_API_URL

    write_params(project, {"ppo.learning_rate": 3e-4})
    # the stage flows report to the harness's server instead of each starting a temporary one
    out = run([str(ROOT / ".venv" / "bin" / "dvc"), "repro"], project, env={"PREFECT_API_URL": PREFECT_API_URL.value()})
    assert "Running stage 'ppo'" in out and "Running stage 'evaluate'" in out
    assert "Running stage 'sft'" not in out and "Running stage 'dpo'" not in out
    assert _dvc_status(project) == {}
    fourth = pipeline(str(project))
    assert fourth["ran"] == [] and fourth["registry"]["registered"]  # a new evaluation: registered once

    # 4. a failing stage (malformed new data): stops in prepare, nothing recorded, registry untouched
    lock_before = (project / "dvc.lock").read_text()
    data_before = (project / "data" / "preferences.jsonl").read_bytes()
    versions_before = len(client.search_model_versions("name='rlhf-policy'"))
    bad = project / "incoming" / "bad.jsonl"
    bad.write_text('{"prompt": "This film", "chosen": " was fine.", "rejected": " was bad."}\n{"prompt": oops}\n')
    from rlhf_core.data import DataFormatError

    with pytest.raises(DataFormatError, match=r"bad.jsonl: not ingested"):  # loose files are refused
        pipeline(str(project))
    assert (project / "dvc.lock").read_text() == lock_before
    assert (project / "data" / "preferences.jsonl").read_bytes() == data_before
    assert len(client.search_model_versions("name='rlhf-policy'")) == versions_before
    failed = client.search_runs([exp.experiment_id], "tags.`rlhf.kind` = 'pipeline'", order_by=["start_time DESC"])[0]
    assert failed.info.status == "FAILED"
    bad.unlink()
