"""Slow: the registered champion is served by ``mlflow models serve -m models:/rlhf-policy@champion --env-manager
local`` as the docs type it (the venv's ``mlflow``, in the project's folder, no ``MLFLOW_TRACKING_URI``: MLflow's
default store ``./mlflow.db`` is the project's), answers over HTTP, and records each answer as a trace tagged with
the version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _launch import free_port
from _pipeline_project import mlflow_client
from test_registry import project  # noqa: F401  (the fixture: a tiny evaluated project)

from tasks.registry.gate import registry_task

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 180  # the server imports torch + transformers and loads the model
REQUEST_TIMEOUT_S = 60


def _wait_until_up(url: str, server: subprocess.Popen, log: Path) -> None:
    """Poll ``/ping`` until it answers 200; fail early if the server exits, or after START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow models serve exited with {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"mlflow models serve did not answer /ping within {START_TIMEOUT_S}s:\n{log.read_text()[-4000:]}")


def _stop(server: subprocess.Popen) -> None:
    """Stop the server we started (its own process group: the CLI and its workers), by its PID."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def test_the_champion_is_served_over_http(project, tmp_path):  # noqa: F811
    record = registry_task.fn(str(project))
    assert record["decision"] == "promote"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "models", "serve", "-m", "models:/rlhf-policy@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port)],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(url, server, log)
        body = json.dumps({"inputs": ["The film", "I think"], "params": {"max_new_tokens": 4, "seed": 1}}).encode()
        request = urllib.request.Request(f"{url}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            predictions = json.loads(response.read())["predictions"]
    finally:
        _stop(server)
    assert [p["text"][:len(q)] for p, q in zip(predictions, ["The film", "I think"])] == ["The film", "I think"]
    assert all(p["text"] == q + p["completion"] for p, q in zip(predictions, ["The film", "I think"]))
    assert {p["model_version"] for p in predictions} == {str(record["version"])}
    client = mlflow_client(project)
    for answer in predictions:
        trace = client.get_trace(answer["trace_id"])
        assert trace.info.tags["rlhf.model_version"] == str(record["version"])
        assert trace.data.spans[0].outputs == {"completion": answer["completion"]}
    assert server.returncode is not None
