"""Slow: the registered champion is served by ``mlflow models serve --env-manager local`` and answers over HTTP."""

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
from test_registry import project  # noqa: F401  (the fixture: a tiny evaluated project)

from tasks.registry import registry_task

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
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/rlhf-policy@champion",
             "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port)],
            cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_until_up(url, server, log)
        body = json.dumps({"inputs": ["The film", "I think"],
                           "params": {"max_new_tokens": 4, "do_sample": False}}).encode()
        request = urllib.request.Request(f"{url}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            predictions = json.loads(response.read())["predictions"]
    finally:
        _stop(server)
    assert len(predictions) == 2
    assert predictions[0].startswith("The film") and predictions[1].startswith("I think")
    assert all(len(p) > len(q) for p, q in zip(predictions, ["The film", "I think"]))  # something was generated
    assert server.returncode is not None
