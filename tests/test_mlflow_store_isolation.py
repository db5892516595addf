"""One project's MLflow store must not become the next project's (seen in CI: a test read the runs of an earlier
test's project because ``mlflow.set_tracking_uri`` had exported ``$MLFLOW_TRACKING_URI``)."""

from __future__ import annotations

import os

from tasks.store.mlflow_runs import mlflow_setup, tracking_uri


def test_setting_up_one_project_leaves_the_next_projects_store_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    mlflow_setup(first)
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert tracking_uri(second) == f"sqlite:///{second.resolve() / 'mlflow.db'}"


def test_a_users_store_stays_the_store(tmp_path, monkeypatch):
    mine = f"sqlite:///{tmp_path / 'team.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mine)
    mlflow_setup(tmp_path)
    assert os.environ["MLFLOW_TRACKING_URI"] == mine and tracking_uri(tmp_path / "other") == mine
