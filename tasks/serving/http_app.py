"""The HTTP side of the served policy: MLflow's own scoring server app (``/invocations``, ``/ping``, ``/health``),
wrapped so that one request cannot take the service down and no answer leaks the server's insides.

``make serve-model`` runs ``uvicorn --factory tasks.serving.http_app:create_app`` on the served model named by
``$RLHF_SERVED_MODEL`` (``flows/serve_model.py``). Around MLflow's app, before a byte of the body is read:

- ``Content-Length`` must be present (411; a chunked body is refused), a non-negative integer (400), and at most
  :data:`MAX_BODY_BYTES` (413 naming the limit).
- the prompts of a JSON body must be non-empty strings (400 naming the first that is not: MLflow's parser would
  turn a null into the string "None").
- every error answer is rewritten to ``{"error_code", "message", "request_id"}``: MLflow's ``stack_trace`` and its
  echo of the request data are dropped, absolute paths are masked; the original is logged under the request id
  (also sent as ``X-Request-Id`` on every answer).
- a 429 or 503 carries ``Retry-After`` (busy, or an alias not set: ``tasks/serving/alias_server.py``).

MLflow's own per-request limit (``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT``) is set a little above the served
model's ``request_timeout_s``, so a slow request is cancelled by the model (504 with its reason) before MLflow would
answer 504 and leave the work running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import uuid

from tasks.serving.answer import REQUEST_ID

log = logging.getLogger("rlhf_pipeline.serving")

MODEL_ENV = "RLHF_SERVED_MODEL"
"""The environment variable naming the served model's folder (what :func:`create_app` loads)."""
MAX_BODY_BYTES = 1024 * 1024
"""Largest request body (16 prompts of 20,000 characters are ~320 kB of JSON, ~1.3 MB at worst in escapes: the
per-request limits of ``tasks/serving/answer.py`` refuse those anyway)."""
RETRY_AFTER_S = 5
"""What ``Retry-After`` says on a 429/503 (a short generation's time on a CPU)."""
TIMEOUT_MARGIN_S = 10
"""MLflow's request limit is the model's ``request_timeout_s`` plus this (the model cancels first)."""
_PATH = re.compile(r"(?<![\w:/])/(?:[\w.@+-]+/)+[\w.@+-]*")
"""An absolute file path inside a message (masked in an answer: it names the server's folders)."""


def create_app():
    """MLflow's scoring server app on the model in ``$RLHF_SERVED_MODEL``, wrapped in :class:`Guard`."""
    from mlflow.pyfunc import scoring_server  # FastAPI and the model: only in the server process

    model = scoring_server.load_model_with_mlflow_config(os.environ[MODEL_ENV])
    return Guard(scoring_server.init(model))


def scoring_timeout(request_timeout_s: float) -> int:
    """MLflow's ``MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT`` for a model that cancels its requests at this time."""
    return int(request_timeout_s) + TIMEOUT_MARGIN_S


class Guard:
    """ASGI middleware: body-size checks, sanitised error answers, ``Retry-After``, a request id (module docstring)."""

    def __init__(self, app, max_body: int = MAX_BODY_BYTES):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex[:12]
        refusal = self._check_length(scope)
        if refusal is not None:
            return await _answer(send, *refusal, request_id)
        if scope["method"] == "POST" and scope["path"] == "/invocations":
            body = await _read_body(receive)
            problem = prompt_problem(body)
            if problem is not None:
                return await _answer(send, 400, "INVALID_PARAMETER_VALUE", problem, request_id)
            receive = _replay(body)
        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, _Rewriter(send, request_id).send)
        finally:
            REQUEST_ID.reset(token)

    def _check_length(self, scope) -> tuple[int, str, str] | None:
        """(status, code, message) refusing the request from its headers alone, or None. A body must say its
        length (the HTTP parser then reads exactly that many bytes): a chunked one could not be refused up front."""
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        raw = headers.get("content-length")
        if raw is None:
            return 411, "BAD_REQUEST", "Content-Length is required (a chunked body is not accepted)"
        if not raw.strip().isdigit():
            return 400, "BAD_REQUEST", f"Content-Length: {raw[:20]!r} is not a byte count (a non-negative integer)"
        if int(raw) > self.max_body:
            return 413, "REQUEST_LIMIT_EXCEEDED", (f"Content-Length {int(raw)} exceeds {self.max_body} bytes (the "
                                                   "limit of one request)")
        return None


def prompt_problem(body: bytes) -> str | None:
    """What is wrong with the prompts of a JSON request, or None. Checked here because MLflow's parser turns a JSON
    null into the string "None" before the model sees it (a null prompt was served and traced as "None")."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None  # not JSON: MLflow's parser answers it
    if not isinstance(payload, dict):
        return None
    for key in ("inputs", "instances"):
        values = payload.get(key)
        for i, value in enumerate(values if isinstance(values, list) else [values] if key in payload else []):
            if not isinstance(value, str) or not value.strip():
                return f"{key}[{i}]: a prompt must be a non-empty string, got {json.dumps(value)[:40]}"
    rows = payload.get("dataframe_records") or (payload.get("dataframe_split") or {}).get("data") or []
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        for value in row.values() if isinstance(row, dict) else row if isinstance(row, list) else [row]:
            if value is None:
                return f"row {i}: a prompt must be a non-empty string, got null"
    return None


async def _read_body(receive) -> bytes:
    """The whole body (its length is checked already: at most ``MAX_BODY_BYTES``)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes):
    """A ``receive`` that hands the app the body already read, then waits as a connection does."""
    sent = False

    async def receive():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the app asks again only to watch for a disconnect
        return {"type": "http.disconnect"}

    return receive


class _Rewriter:
    """Passes a success through (with ``X-Request-Id``); buffers an error answer and sends it sanitised."""

    def __init__(self, send, request_id: str):
        self._send, self.request_id = send, request_id
        self.start: dict | None = None
        self.body = b""

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            if message["status"] < 400:
                headers = [*message.get("headers", []), (b"x-request-id", self.request_id.encode())]
                return await self._send({**message, "headers": headers})
            self.start = message
            return None
        if self.start is None:
            return await self._send(message)
        self.body += message.get("body", b"")
        if not message.get("more_body", False):
            status = self.start["status"]
            code, text = _error_of(self.body, status)
            log.warning("serving: request %s answered %d: %s", self.request_id, status,
                        self.body.decode("utf-8", "replace")[:4000])
            await _answer(self._send, status, code, text, self.request_id)
        return None


def _error_of(body: bytes, status: int) -> tuple[str, str]:
    """(error code, message) of an error answer, without stack trace, request echo or path."""
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = {"message": body.decode("utf-8", "replace")}
    if not isinstance(parsed, dict):
        parsed = {"message": str(parsed)}
    code = str(parsed.get("error_code") or ("INTERNAL_ERROR" if status >= 500 else "BAD_REQUEST"))
    text = str(parsed.get("message") or parsed.get("detail") or "")
    # MLflow wraps a model's error as "Failed to predict data '<the whole request>'. \nError: <the error>"
    text = text.rsplit("\nError: ", 1)[-1] if text.startswith("Failed to predict data") else text
    if "Traceback (most recent call last)" in text or 'File "' in text:
        text = "the server failed to answer (see the server's log)"
    text = _PATH.sub("<path>", text)
    return code, text[:1000]


async def _answer(send, status: int, code: str, message: str, request_id: str) -> None:
    body = json.dumps({"error_code": code, "message": message, "request_id": request_id}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"x-request-id", request_id.encode())]
    if status in (429, 503):
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
