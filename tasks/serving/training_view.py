"""MLflow's UI server app, opening on the training view: what ``make mlflow-ui`` serves.

MLflow 3's UI keeps the view a browser last chose (GenAI: traces and evaluation runs; or classic "Model training")
in the browser's localStorage under ``mlflow.workflowType_v1``, and a browser with no choice yet gets GenAI, so the
bare root (``http://127.0.0.1:5000``) opened this project's training runs in a view that hides them (issue 33).
This app is MLflow's own (``mlflow.server.fastapi_app``: every request goes through its host checks and headers)
with one change: the HTML that ``GET /`` returns first stores the training view when the browser has no choice
yet, before MLflow's script reads it. A reviewer's own toggle is kept. MLflow finds the app through pyproject's
``mlflow.app`` entry point (``mlflow ui --app-name rlhf-training-view``); ``app`` is a factory (uvicorn
``--factory``), so nothing loads until the server's worker calls it.
"""

from __future__ import annotations

import json

APP_NAME = "rlhf-training-view"
"""The ``mlflow.app`` entry point's name (pyproject.toml)."""
VIEW_KEY = "mlflow.workflowType_v1"
"""MLflow's localStorage key of the chosen view (``mlflow.workflowType``, version 1: its ``<key>_v<version>``)."""
TRAINING_VIEW = "machine_learning"
"""MLflow's name of the "Model training" view (the other one is ``genai``)."""
SCRIPT = ("<script>try{if(localStorage.getItem(%s)===null)localStorage.setItem(%s,%s)}catch(e){}</script>"
          % (json.dumps(VIEW_KEY), json.dumps(VIEW_KEY), json.dumps(json.dumps(TRAINING_VIEW)))).encode()
"""Stores ``"machine_learning"`` (JSON, as MLflow stores it) unless the browser already chose; a browser without
localStorage (private modes) just gets MLflow's default."""


def with_training_view(html: bytes) -> bytes:
    """``html`` with :data:`SCRIPT` first in its ``<head>`` (before MLflow's deferred script); unchanged without one."""
    head = html.find(b"<head>")
    if head < 0:
        return html
    end = head + len(b"<head>")
    return html[:end] + SCRIPT + html[end:]


CONDITIONAL = (b"if-none-match", b"if-modified-since")
"""Request headers dropped from ``GET /``: a browser holding MLflow's unchanged page would be told 304 and keep it."""
VALIDATORS = (b"content-length", b"etag", b"last-modified")
"""Response headers of MLflow's file replaced or dropped on the changed page (they describe the file on disk)."""


class TrainingViewApp:
    """An ASGI app: ``inner`` (MLflow's), with the HTML body of a successful ``GET /`` passed through
    :func:`with_training_view`, its ``content-length`` set to match and its file validators dropped."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != "/":
            return await self.inner(scope, receive, send)
        scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() not in CONDITIONAL]}
        start: dict = {}
        body: list[bytes] = []

        async def rewrite(message):
            if message["type"] == "http.response.start":
                start.update(message)  # held until the body is whole: its content-length changes
                return
            if message["type"] != "http.response.body":
                return await send(message)
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            await send_page(send, start, b"".join(body))

        await self.inner(scope, receive, rewrite)


async def send_page(send, start: dict, body: bytes) -> None:
    """Send the held response start and ``body``, the page rewritten when it is a 200 HTML page."""
    headers = list(start.get("headers", []))
    content_type = next((v for k, v in headers if k.lower() == b"content-type"), b"")
    if start.get("status") == 200 and content_type.startswith(b"text/html"):
        body = with_training_view(body)
        headers = [(k, v) for k, v in headers if k.lower() not in VALIDATORS]
        headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def app():
    """The server's app (a factory: MLflow's app is built in the worker that serves it, never at import)."""
    from mlflow.server.fastapi_app import app as mlflow_app  # mlflow: builds MLflow's server app (heavy)

    return TrainingViewApp(mlflow_app)
