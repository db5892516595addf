"""One scheduled-retraining run with new data: re-runs what changed, registers a new version, moves the
champion only if it won, pushes DVC outputs to the local remote. Plus the prefect.yaml deployments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from _pipeline_project import ROOT, make_project, mlflow_client, write_params

pytestmark = pytest.mark.slow


def test_prefect_yaml_defines_pipeline_and_scheduled_retraining():
    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"]}
    assert deployments["rlhf-pipeline"]["entrypoint"] == "flows/pipeline.py:pipeline"
    retrain = deployments["rlhf-retrain"]
    assert retrain["entrypoint"] == "flows/retrain.py:retrain"
    cron = retrain["schedules"][0]["cron"]
    assert len(cron.split()) == 5
    for d in deployments.values():
        path, func = d["entrypoint"].split(":")
        assert f"def {func}(" in (ROOT / path).read_text()


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def test_retraining_run_with_new_data(harness, tmp_path, monkeypatch):
    from flows.retrain import retrain

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    root = make_project(tmp_path / "proj")
    first = retrain(str(root))
    assert first["registry"]["decision"] == "promote"
    remote = root / ".dvc-remote"
    assert first["pushed"] > 0 and any(p.is_file() for p in remote.rglob("*"))
    client = mlflow_client(root)
    v1 = client.get_model_version_by_alias("rlhf-policy", "champion").version

    # new preference data arrives; this time the challenger cannot win (min_improvement is out of reach)
    pairs = [{"prompt": "This movie was", "chosen": f" wonderful, truly {w}.", "rejected": f" awful and {w}."}
             for w in ("fun", "sweet", "smart", "lovely")]
    (root / "incoming" / "2026-11-batch.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    write_params(root, {"registry.min_improvement": 10.0})
    second = retrain(str(root))
    assert "prepare" in second["ran"] and "reward_model" in second["ran"] and "dpo" in second["ran"]
    assert "evaluate" in second["ran"]
    assert "sft" not in second["ran"]  # the SFT corpus did not change: only what depends on the pairs re-ran
    record = second["registry"]
    assert record["registered"] and record["version"] != v1
    assert record["decision"] == "keep" and "min_improvement" in record["reason"]
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == v1  # did not win: unchanged
    assert client.get_model_version_by_alias("rlhf-policy", "challenger").version == record["version"]
    assert json.loads((root / "metrics" / "prepare.json").read_text())["num_incoming_pairs"] == 4
    assert second["pushed"] > 0


def test_retrain_cli_documents_serve():
    from flows.retrain import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert Path(ROOT / "flows" / "retrain.py").read_text().count("retrain.serve(") == 1
