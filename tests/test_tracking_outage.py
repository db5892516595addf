"""MLflow outages: training completes, nothing is lost, a warning says where the data is, upload replays it."""

from __future__ import annotations

import json
import socket
import warnings

import pytest
import torch

from flows.tracking import main
from rlhf_core.tracking import SpoolingTracker, Tracker, make_tracker

mlflow = pytest.importorskip("mlflow")


@pytest.fixture
def refusing_uri(monkeypatch):
    """An http tracking URI on a local port nobody listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    mlflow.set_tracking_uri(uri)
    yield uri
    mlflow.set_tracking_uri(None)


def read_spool(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ppo_stage_against_a_refusing_server_completes_and_uploads_later(tokenizer, tmp_path, refusing_uri, monkeypatch):
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    spool_dir = tmp_path / "spool"
    config = PPOConfig(batch_size=2, mini_batch_size=1, ppo_epochs=1, log_with="mlflow", tracker_project_name="outage",
                       tracker_kwargs={"spool_dir": str(spool_dir)})
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    with pytest.warns(RuntimeWarning, match="unreachable") as caught:
        trainer = PPOTrainer(config, model, None, tokenizer)
        for step in range(2):
            queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
            responses = [torch.tensor([10, 11, 12]), torch.tensor([13, 14])]
            rewards = [torch.tensor(1.0), torch.tensor(0.5)]
            stats = trainer.step(queries, responses, rewards)
            trainer.log_stats(stats, {"query": ["a", "b"], "response": ["c", "d"]}, rewards)
        trainer.tracker.finish()
    assert trainer.current_step == 2  # training went on
    assert sum("unreachable" in str(w.message) for w in caught) == 1  # warned once, not per call
    (spool,) = spool_dir.glob("*.jsonl")
    records = read_spool(spool)
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "run" and kinds.count("metrics") == 2 and kinds.count("table") == 2 and kinds[-1] == "finish"
    assert [r["step"] for r in records if r["kind"] == "metrics"] == [1, 2]  # log_stats logs at the step count
    params = next(r["data"] for r in records if r["kind"] == "params")
    assert params["batch_size"] == 2

    # afterwards: the documented command replays everything into a reachable store
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["upload", str(spool), "--tracking-uri", store]) == 0
    client = mlflow.MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    history = client.get_metric_history(run.info.run_id, "objective/kl")
    assert [m.step for m in history] == [1, 2]
    assert history[-1].value == pytest.approx(float(stats["objective/kl"]))
    assert run.data.params["batch_size"] == "2" and run.info.status == "FINISHED"
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "tables")}
    assert tables == {"tables/game_log_step000001.json", "tables/game_log_step000002.json"}
    assert not spool.exists() and spool.with_name(spool.name + ".uploaded").exists()  # never replayed twice


class FlakyBackend(Tracker):
    """Accepts the first call, then the 'server' goes away."""

    name = "mlflow"

    def __init__(self, project_name, run_name):
        self.calls = 0

    def log(self, metrics, step=None):
        self.calls += 1
        if self.calls > 1:
            raise ConnectionError("Connection refused")


def test_an_outage_mid_run_spools_the_rest_and_warns_once(tmp_path):
    tracker = SpoolingTracker(FlakyBackend, spool_dir=tmp_path, project_name="flaky")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            tracker.log({"loss": float(step), "hub_token_len": 3}, step=step)
        tracker.log_params({"lr": 0.1, "hub_token": "secret-value", "db_password": "x"})
    assert tracker.offline
    assert sum("unreachable" in str(w.message) for w in caught) == 1
    records = read_spool(next(tmp_path.glob("*.jsonl")))
    assert [r["step"] for r in records if r["kind"] == "metrics"] == [1, 2, 3]  # step 0 reached the server
    params = next(r["data"] for r in records if r["kind"] == "params")
    assert params == {"lr": 0.1}  # secrets are never written, not even locally
    assert "secret-value" not in next(tmp_path.glob("*.jsonl")).read_text()


def test_a_reachable_store_gets_no_spool(tmp_path, monkeypatch):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    mlflow.set_tracking_uri(store)
    tracker = make_tracker("mlflow", project_name="online", spool_dir=str(tmp_path / "spool"))
    tracker.log({"x": 1.0}, step=0)
    tracker.finish()
    assert not tracker.offline and not (tmp_path / "spool").exists()


def test_upload_rejects_a_file_that_is_not_a_spool(tmp_path):
    bogus = tmp_path / "x.jsonl"
    bogus.write_text('{"kind": "metrics"}\n')
    with pytest.raises(ValueError, match="not a tracking spool"):
        main(["upload", str(bogus), "--tracking-uri", f"sqlite:///{tmp_path / 'db.sqlite'}"])


class ErrorBackend(Tracker):
    """A backend whose server answers every call with the given error."""

    name = "mlflow"
    error: BaseException = RuntimeError("unset")

    def __init__(self, project_name, run_name):
        self.calls = 0

    def log(self, metrics, step=None):
        self.calls += 1
        raise self.error


def _wrapped_connection_failure() -> BaseException:
    """What MLflow's REST client raises when the server is down: an MlflowException raised inside the handler
    of requests' ConnectionError (its message carries urllib3's)."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        try:
            raise requests.exceptions.ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=9): Max retries "
                                                      "exceeded with url: /api/2.0/mlflow/runs/log-batch")
        except Exception as e:  # noqa: BLE001
            raise MlflowException(f"API request to http://127.0.0.1:9/api/2.0/mlflow/runs/log-batch failed with "
                                  f"exception {e}")
    except MlflowException as wrapped:
        return wrapped


@pytest.mark.parametrize("make_error", [
    lambda: ConnectionRefusedError("[Errno 111] Connection refused"),
    lambda: __import__("requests").exceptions.ConnectionError("Connection aborted"),
    lambda: __import__("requests").exceptions.ReadTimeout("read timed out"),
    _wrapped_connection_failure,
])
def test_only_a_connection_failure_spools_with_a_warning_that_says_so(tmp_path, make_error):
    from rlhf_core.tracking import is_connection_failure

    error = make_error()
    assert is_connection_failure(error)
    ErrorBackend.error = error
    tracker = SpoolingTracker(ErrorBackend, spool_dir=tmp_path, project_name="down")
    with pytest.warns(RuntimeWarning, match="unreachable"):
        tracker.log({"loss": 1.0}, step=1)
    assert tracker.offline
    records = read_spool(next(tmp_path.glob("*.jsonl")))
    assert [r["kind"] for r in records] == ["run", "metrics"] and records[1]["data"] == {"loss": 1.0}


def test_any_other_backend_error_is_reported_not_treated_as_an_outage(tmp_path, caplog):
    from mlflow.exceptions import MlflowException

    from rlhf_core.tracking import is_connection_failure

    error = MlflowException("INVALID_PARAMETER_VALUE: Changing param values is not allowed")
    assert not is_connection_failure(error) and not is_connection_failure(TypeError("not JSON serializable"))
    ErrorBackend.error = error
    tracker = SpoolingTracker(ErrorBackend, spool_dir=tmp_path, project_name="answers")
    with pytest.warns(RuntimeWarning, match="log was not logged to mlflow: MlflowException: INVALID_PARAMETER_VALUE"
                                            ".*not an outage") as caught:
        tracker.log({"loss": 1.0}, step=1)
        tracker.log({"loss": 2.0}, step=2)
    assert not any("unreachable" in str(w.message) for w in caught)
    assert not tracker.offline and tracker.backend.calls == 2  # still online: the next call reached the backend
    assert not list(tmp_path.glob("*.jsonl"))  # no spool
    assert "Changing param values is not allowed" in caplog.text


def test_a_backend_that_fails_to_start_for_another_reason_raises(tmp_path):
    def broken(project_name, run_name):
        raise ValueError("experiment name must not be empty")

    with pytest.raises(ValueError, match="experiment name"):
        SpoolingTracker(broken, spool_dir=tmp_path, project_name="")
    assert not list(tmp_path.glob("*.jsonl"))
