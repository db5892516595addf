"""The served policy over HTTP (tasks/serving/http_app.py around MLflow's scoring server app, in process): crafted
requests are refused before their body is read, every error answer names a request id and carries no stack trace,
no request echo and no path, and a 503 says when to retry."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_serving import registry, server  # noqa: F401  (fixtures: a store of tiny versions, the served model)

from tasks.serving.http_app import MAX_BODY_BYTES, Guard


def _call(guard: Guard, method: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, dict]:
    """One request straight through the ASGI interface: (status, headers, JSON body). The inner app must not run."""
    sent: list[dict] = []

    async def inner(scope, receive, send):
        raise AssertionError("the request reached the app")

    async def receive():
        raise AssertionError("the body was read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": "/invocations", "headers": headers}
    asyncio.run(Guard(inner)(scope, receive, send) if guard is None else guard(scope, receive, send))
    start, body = sent
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, json.loads(body["body"])


@pytest.mark.parametrize("length, status, message", [
    (b"-1", 400, "Content-Length: '-1' is not a byte count"),
    (b"12x", 400, "is not a byte count"),
    (None, 411, "Content-Length is required"),
    (str(MAX_BODY_BYTES + 1).encode(), 413, f"exceeds {MAX_BODY_BYTES} bytes"),
])
def test_a_body_of_no_or_a_bad_length_is_refused_unread(length, status, message):
    headers = [(b"content-type", b"application/json")] + ([(b"content-length", length)] if length else [])
    got, sent_headers, body = _call(None, "POST", headers)
    assert got == status and message in body["message"]
    assert set(body) == {"error_code", "message", "request_id"} and sent_headers["x-request-id"] == body["request_id"]


@pytest.fixture()
def http(server, monkeypatch):  # noqa: F811
    """A client of MLflow's scoring server app on the served model, wrapped as `make serve-model` wraps it."""
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server

    monkeypatch.setenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "true")  # init sets it: restored after the test
    with TestClient(Guard(scoring_server.init(server))) as client:
        yield client


def _post(http, inputs, params) -> tuple[int, dict, dict]:
    response = http.post("/invocations", json={"inputs": inputs, "params": params})
    return response.status_code, dict(response.headers), response.json()


def _clean(body: dict) -> None:
    text = json.dumps(body)
    assert set(body) == {"error_code", "message", "request_id"}, body
    assert "Traceback" not in text and "site-packages" not in text and "/tmp" not in text and "/work" not in text


def test_an_answer_carries_its_request_id(http):
    status, headers, body = _post(http, ["The film"], {"max_new_tokens": 2, "seed": 1})
    assert status == 200 and body["predictions"][0]["model_version"] == "1" and len(headers["x-request-id"]) == 12


@pytest.mark.parametrize("inputs, params, message", [
    (["word " * 60], {"max_new_tokens": 120}, "exceeds the model's context of 128 positions"),
    (["The film"], {"seed": 2**64}, "seed"),
    (["The film", None], {}, "inputs[1]: a prompt must be a non-empty string, got null"),
    (["The film", ""], {}, "inputs[1]: a prompt must be a non-empty string"),
    (["x"] * 1000, {}, "inputs: 1000 prompts (limit 16 per request)"),
])
def test_a_bad_request_is_a_400_without_stack_trace_or_path(http, inputs, params, message):
    status, _, body = _post(http, inputs, params)
    assert status == 400 and message in body["message"], body
    _clean(body)
    assert len(body["message"]) < 300  # the request is never echoed back


def test_an_unset_alias_is_a_503_naming_it_with_retry_after(http):
    status, headers, body = _post(http, ["The film"], {"model_alias": "nope"})
    assert status == 503 and "rlhf-policy@nope: no version holds the alias" in body["message"]
    assert headers["retry-after"] == "5"
    _clean(body)


def test_a_failure_inside_is_a_500_naming_the_request_id_logged_with_its_trace(http, monkeypatch, caplog):
    import logging

    import tasks.serving.alias_server as policy_server

    def broken(*args):
        raise OSError("[Errno 2] No such file: '/srv/secret/place/weights.bin'")

    monkeypatch.setattr(policy_server, "answer", broken)
    with caplog.at_level(logging.ERROR, logger="rlhf_pipeline.serving"):
        status, headers, body = _post(http, ["The film"], {"max_new_tokens": 2})
    assert status == 500 and f"request {headers['x-request-id']}" in body["message"]
    _clean(body)
    assert "secret" not in json.dumps(body)
    assert f"request {headers['x-request-id']} failed" in caplog.text and "/srv/secret/place" in caplog.text
