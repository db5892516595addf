"""Issue 24: the local MLflow store (SQLite ``mlflow.db``) locked by another process or deleted. A locked store is
waited for (bounded), then spooled like an unreachable server, naming the file; what a stage spooled is replayed
into its run when the store answers again by the stage's end; a store that vanished is never silently replaced by
a new, empty one (and so a new, empty registry)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _pipeline_project import make_project, mlflow_client

from tasks.store.mlflow_runs import start_pipeline_run, store_problem, tracking_reachable, vanished_store
from tasks.stages import load_params
from tasks.store.stage_run import stage_run

HOLD_LOCK = ("import sqlite3, sys, time\n"
             "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
             "db.execute('BEGIN EXCLUSIVE')  # what a long write of another process holds\n"
             "print('locked', flush=True)\n"
             "time.sleep(600)\n")


@pytest.fixture
def project(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_URI", "RLHF_PARENT_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RLHF_TRACKING_LOCK_WAIT_S", "1")  # the default 30 s, shortened for the test
    root = make_project(tmp_path / "proj", git_dvc=False)
    mlflow_client(root)  # the project's store exists, as after any earlier run
    return root


class LockedStore:
    """Another process holding ``mlflow.db`` locked until ``release()`` (stopped by its pid)."""

    def __init__(self, root: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(root / "mlflow.db")],
                                        stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "locked"

    def release(self) -> None:
        self.process.kill()
        self.process.wait()


def _section(root: Path):
    return load_params(root / "params.yaml").prepare


def _runs(root: Path, name: str):
    client = mlflow_client(root)
    experiment = client.get_experiment_by_name("rlhf-pipeline")
    return client, [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_name == name]


def test_a_store_locked_at_start_is_waited_for_then_spooled_naming_the_file_then_replayed(project):
    locked = LockedStore(project)
    try:
        started = time.monotonic()
        assert start_pipeline_run(project, entry="test") == ""  # not a raw `database is locked` after 37 s
        assert time.monotonic() - started < 15  # one bounded wait (1 s here), not MLflow's 20 s busy wait per call
        assert store_problem(project) == f"tracking store {project / 'mlflow.db'} unavailable (database is locked)"
        with pytest.warns(RuntimeWarning, match=rf"stage prepare: tracking store {project / 'mlflow.db'} unavailable"):
            with stage_run("prepare", project, _section(project), []) as run:
                assert run.offline
                run.log_metrics({"num_pairs": 7.0}, step=1)
                run.log_table("samples", [{"prompt": "This movie was", "response": " great."}])
                locked.release()  # the other process finishes before the stage does
    finally:
        locked.release()
    spool = run.spool_path
    assert not spool.exists() and spool.with_name(spool.name + ".uploaded").exists()  # replayed, never twice
    client, (replayed,) = _runs(project, "prepare")
    assert replayed.data.metrics["num_pairs"] == 7.0 and replayed.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(replayed.info.run_id, "tables")} == {"tables/samples.json"}


@pytest.mark.slow
def test_a_store_locked_mid_stage_loses_nothing(project):
    """The mid-PPO case: the stage's run is open, then another process locks the store. MLflow waits its own 20 s
    busy timeout, the call fails, and from then on the stage spools; the store is back by the stage's end, so
    the table logged under the lock (step 7) is in the run, as are the metrics around it."""
    with stage_run("ppo", project, load_params(project / "params.yaml").ppo, []) as run:
        assert not run.offline
        run.tracker.log({"reward": 0.5}, step=6)
        locked = LockedStore(project)
        try:
            with pytest.warns(RuntimeWarning, match="unavailable \\(database is locked\\)"):
                run.tracker.log_table("game_log", ["query", "response"], [["a", "b"]], step=7)
            run.tracker.log({"reward": 0.7}, step=7)
        finally:
            locked.release()
    client, (ppo,) = _runs(project, "ppo")
    assert {a.path for a in client.list_artifacts(ppo.info.run_id, "tables")} == {"tables/game_log_step000007.json"}
    assert [(m.step, m.value) for m in client.get_metric_history(ppo.info.run_id, "reward")] == [(6, 0.5), (7, 0.7)]
    assert ppo.info.status == "FINISHED"


def test_a_store_deleted_mid_run_is_named_with_how_to_restore_and_not_replaced(project):
    database = project / "mlflow.db"
    with pytest.warns(RuntimeWarning, match=rf"tracking store {database} unavailable \(attempt to write a readonly"):
        with stage_run("sft", project, load_params(project / "params.yaml").sft, []) as run:
            run.tracker.log({"loss": 1.0}, step=1)
            database.unlink()  # someone deletes mlflow.db while the stage trains
            run.tracker.log({"loss": 0.5}, step=2)  # kept in the spool
    spool = run.spool_path
    assert spool.is_file()  # nothing replayed into a store that is gone
    assert [r["data"] for r in map(json.loads, spool.read_text().splitlines()) if r["kind"] == "metrics"][0] == {
        "loss": 0.5}
    problem = vanished_store(project)
    assert problem.startswith(f"the MLflow store {database} (this project's runs and model registry) is gone")
    assert "make tracking-upload" in problem and f"mv {project / 'mlartifacts'} {project / 'mlartifacts'}.old" in problem

    # the next run: no new, empty store (and registry) in its place; it spools, saying why
    assert not tracking_reachable(project) and start_pipeline_run(project, entry="test") == ""
    with stage_run("reward_model", project, load_params(project / "params.yaml").reward_model, []) as run2:
        assert run2.offline
        run2.log_metrics({"loss": 0.25}, step=1)
    assert not database.exists()
    from tasks.store.mlflow_runs import StoreUnavailable, mlflow_setup

    with pytest.raises(StoreUnavailable, match="is gone"):
        mlflow_setup(project)  # what the retrain flow and the registry would call
    assert not database.exists()

    # the user's choice, as the message says: a new, empty store on purpose; then what was kept is uploaded (a new
    # process, as `make tracking-upload` is: this one's MLflow still holds the deleted file open)
    (project / "mlartifacts").rename(project / "mlartifacts.old")
    assert tracking_reachable(project)
    out = subprocess.run([sys.executable, "-m", "flows.tracking", "upload", str(spool), "--tracking-uri",
                          f"sqlite:///{database}"], cwd=project, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert sqlite3.connect(database).execute("SELECT value FROM metrics WHERE key = 'loss'").fetchall() == [(0.5,)]


def test_artifacts_of_a_stage_that_spooled_are_replayed_with_it(project, tmp_path):
    """Issue 33: metrics and tables were spooled and replayed, but the run's model_card.md (and any artifact) was
    skipped while offline: silently missing from the replayed run. Both are kept in the spool and replayed."""
    extra = tmp_path / "notes.txt"
    extra.write_text("kept\n")
    locked = LockedStore(project)
    try:
        with pytest.warns(RuntimeWarning, match="unavailable"):
            with stage_run("sft", project, load_params(project / "params.yaml").sft, []) as run:
                assert run.offline
                run.write_model_card(tmp_path / "model", "SFTTrainer", None, {"lr": 1e-3}, {"loss": 0.5})
                run.log_artifact(extra, "extra")
                locked.release()
    finally:
        locked.release()
    client, (replayed,) = _runs(project, "sft")
    paths = {a.path for a in client.list_artifacts(replayed.info.run_id)}
    assert "model_card.md" in paths and "extra" in paths
    card = Path(client.download_artifacts(replayed.info.run_id, "model_card.md", str(tmp_path / "dl")))
    assert "SFTTrainer" in card.read_text() or "rlhf-sft" in card.read_text()
    kept = Path(client.download_artifacts(replayed.info.run_id, "extra/notes.txt", str(tmp_path / "dl2")))
    assert kept.read_text() == "kept\n"


def test_a_new_store_in_place_of_the_projects_is_refused_with_a_message(project):
    """Issue 33: a plain `mlflow ui` on a deleted mlflow.db made a fresh store, and the next run started a new, empty
    registry silently (while DVC's records name versions of the old one). The fresh store is refused now."""
    from tasks.store.mlflow_runs import StoreUnavailable, mlflow_setup

    database = project / "mlflow.db"
    mlflow_setup(project)  # the project's store, recorded with its experiment
    database.unlink()
    fresh = f"import mlflow; mlflow.MlflowClient('sqlite:///{database}').search_experiments()"
    subprocess.run([sys.executable, "-c", fresh], check=True, timeout=120)  # what `mlflow ui` does: a fresh store
    assert database.stat().st_size > 0
    with pytest.raises(StoreUnavailable, match=rf"the MLflow store {database} is not this project's store: it has no "
                                               r"experiment 'rlhf-pipeline'.*mv .*mlartifacts .*mlartifacts.old"):
        mlflow_setup(project)
    assert not tracking_reachable(project)  # the stages spool instead of logging into it
    with sqlite3.connect(database) as db:  # (this process's MLflow still holds the deleted file open)
        assert [name for (name,) in db.execute("SELECT name FROM experiments")] == ["Default"]  # nothing made in it
