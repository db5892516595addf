"""The served policy of the loop: an MLflow pyfunc that answers with the version holding a registry alias, follows the
alias when it moves, and records every generation as an MLflow trace tagged with the version that wrote it.

``make serve-model`` (``python -m flows.serve_model``) saves :class:`PolicyServer` as a small MLflow Model (code and
settings only, no weights: ``.serve/policy-server``) and runs MLflow's own scoring server on it
(``mlflow models serve --env-manager local``). MLflow keeps the HTTP side (``/invocations``, ``/ping``,
``/health``, request parsing); ``tasks/serving/answer.py`` keeps the answer and its trace; this module keeps the alias:

- ``models:/<name>@champion`` is resolved when the server starts and again at most every ``reload_s`` seconds at a
  request; a new version is loaded before it answers (the old one answers until then), a version that fails to load
  is logged and the old one keeps answering. No restart by hand.
- a request may ask another alias of the same model (``params.model_alias``: the review page asks ``challenger``).
- an alias that disappears (deleted in the registry) stops being served at the next look-up: HTTP 503 naming the
  alias until one is set again (a registry that cannot be reached keeps the version known answering).
- one generation at a time; up to ``max_waiting`` requests wait for it, more are refused at once (HTTP 503 with
  ``Retry-After``, ``tasks/serving/http_app.py``). A request still running after ``request_timeout_s`` (its wait
  included) is cancelled between tokens (HTTP 504) and the traces of its answers are deleted: the model is free again
  and nothing unreturned is offered for review. Any other failure answers 500 naming the request id, never a stack
  trace or a path; the server's log has the trace under that id.

A registered version served on its own (``mlflow models serve -m models:/rlhf-policy@champion``,
``tasks/registry/policy_pyfunc.py``) answers the same way but stays on the version the alias held when it started.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (DEADLINE_EXCEEDED, INTERNAL_ERROR, INVALID_PARAMETER_VALUE,
                                          TEMPORARILY_UNAVAILABLE)
from mlflow.pyfunc import PythonModel

from tasks.serving.answer import (ALIAS_MISSING, REQUEST_ID, Cancelled, LoadedVersion, RequestError, Unavailable, answer,
                           check_context, check_request, delete_traces, load_weights, request_prompts, signature,
                           synchronous_traces)

log = logging.getLogger("rlhf_pipeline.serving")


@dataclass(frozen=True)
class ServerConfig:
    """What the served model answers with and where its traces go (the MLflow Model's ``model_config``)."""

    model_name: str
    """The registered model (``registry.model_name``)."""
    alias: str
    """The alias served by default (``champion``)."""
    experiment_id: str
    """The project's MLflow experiment: traces are recorded there."""
    tracking_uri: str
    """The project's store when it is a local SQLite file; '' = ``$MLFLOW_TRACKING_URI`` (a server: its address may
    carry credentials, which never go into a file)."""
    reload_s: float = 10.0
    """Look the alias up again at most this often (seconds), at a request."""
    request_timeout_s: float = 50.0
    """A request still unanswered after this many seconds (waiting included) is cancelled: HTTP 504. Below the HTTP
    server's own limit (``tasks/serving/http_app.py``), so the work stops before the client is told it timed out."""
    max_waiting: int = 4
    """Requests that may wait while one generates; more are refused at once (HTTP 503 with ``Retry-After``)."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ServerConfig:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PolicyServer(PythonModel):
    """The served policy (see the module docstring). Built by :func:`save_server`; MLflow calls
    :meth:`load_context` once when the server starts and :meth:`predict` per request (from several threads: one
    generation at a time, under a lock; at most ``max_waiting`` waiting)."""

    # MLflow warns at every import that `predict` has no type hints (inside its own warnings context: no filter
    # reaches it). With hints it would derive the signature from them alone, and hints cannot declare the request
    # params (max_new_tokens, seed, model_alias): save_server gives the signature, and predict checks its input.
    # This class attribute is MLflow's own switch for that check (3.x, PythonModel.__init_subclass__).
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        self.config = ServerConfig.from_dict(context.model_config)
        synchronous_traces()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.config.tracking_uri
        if not uri:
            raise RuntimeError("the served policy needs MLFLOW_TRACKING_URI (the project's tracking server)")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment_id=self.config.experiment_id)
        self._client = mlflow.MlflowClient()
        self._lock = threading.Lock()  # one generation at a time
        self._admission = threading.Lock()  # guards _admitted
        self._admitted = 0  # requests generating or waiting to
        self._loaded: dict[str, LoadedVersion] = {}
        self._resolved: dict[str, tuple[str, float]] = {}  # alias -> (version, monotonic time looked up)
        self.current(self.config.alias)  # fail at start, not at the first request, when nothing can be served

    def current(self, alias: str) -> LoadedVersion:
        """The loaded version holding ``alias``: looked up again once ``reload_s`` has passed, and a new version is
        loaded before it answers. A new version that fails to load is logged and the one loaded keeps answering."""
        known, looked_up = self._resolved.get(alias, (None, float("-inf")))
        if time.monotonic() - looked_up < self.config.reload_s:
            return self._loaded[known]
        found = self._lookup(alias, known)
        if found not in self._loaded:
            try:
                self._loaded[found] = self._load(found)
            except Exception as error:  # noqa: BLE001 - a broken new version must not stop the service
                if known is None:
                    raise
                log.error("serving: %s v%s cannot be loaded (%s); still answering with v%s", self.config.model_name,
                          found, error, known)
                found = known
        self._resolved[alias] = (found, time.monotonic())
        self._forget_unused()
        return self._loaded[found]

    def _lookup(self, alias: str, known: str | None) -> str:
        """The version holding ``alias`` in the registry; on a registry error, the one known (if any)."""
        try:
            found = self._client.get_model_version_by_alias(self.config.model_name, alias).version
        except MlflowException as error:
            if error.error_code in ("INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST"):  # the alias is not set
                self._resolved.pop(alias, None)
                self._forget_unused()
                raise Unavailable(f"{self.config.model_name}@{alias}: {ALIAS_MISSING} (set it in the registry: "
                                  f"nothing is served for it until then)") from None
            if known is None:
                raise Unavailable(f"{self.config.model_name}@{alias}: the registry cannot be reached") from None
            log.warning("serving: looking up %s@%s failed (%s); still answering with v%s", self.config.model_name,
                        alias, error.message, known)
            return known
        if known is not None and found != known:
            log.info("serving: %s@%s moved from v%s to v%s", self.config.model_name, alias, known, found)
        return str(found)

    def _load(self, version: str) -> LoadedVersion:
        entry = self._client.get_model_version(self.config.model_name, version)
        uri = f"models:/{self.config.model_name}/{version}"
        model, tokenizer = load_weights(uri)
        log.info("serving: loaded %s (policy %s)", uri, entry.tags.get("policy", "?"))
        model_id = entry.source.removeprefix("models:/") if entry.source.startswith("models:/m-") else None
        return LoadedVersion(version, model_id, entry.tags.get("policy", ""), model, tokenizer)

    def _forget_unused(self) -> None:
        """Keep in memory only the versions some alias holds now (a replaced champion is freed)."""
        wanted = {version for version, _ in self._resolved.values()}
        for version in [v for v in self._loaded if v not in wanted]:
            del self._loaded[version]

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[dict[str, str]]:
        request_id = REQUEST_ID.get() or uuid.uuid4().hex[:12]
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            prompts = request_prompts(model_input)
            tokens, seed, alias = check_request(prompts, params or {})
            with self._admit():
                return self._generate(prompts, tokens, seed, alias or self.config.alias, deadline)
        except RequestError as error:
            raise MlflowException(str(error), error_code=INVALID_PARAMETER_VALUE) from None
        except Unavailable as error:
            raise MlflowException(str(error), error_code=TEMPORARILY_UNAVAILABLE) from None
        except Cancelled as error:
            log.warning("serving: request %s cancelled after %.0f s", request_id, self.config.request_timeout_s)
            raise MlflowException(f"{error} (limit {self.config.request_timeout_s:g} s)",
                                  error_code=DEADLINE_EXCEEDED) from None
        except Exception:  # noqa: BLE001 - logged here with its trace; the client gets the request id, no internals
            log.exception("serving: request %s failed", request_id)
            raise MlflowException(f"the server failed to answer (request {request_id}: see the server's log)",
                                  error_code=INTERNAL_ERROR) from None

    @contextmanager
    def _admit(self):
        """Count the request in while it generates or waits; refuse it when ``max_waiting`` already wait."""
        with self._admission:
            if self._admitted > self.config.max_waiting:
                raise Unavailable(f"busy: {self._admitted} requests are generating or waiting (limit "
                                  f"{self.config.max_waiting + 1}); retry later")
            self._admitted += 1
        try:
            yield
        finally:
            with self._admission:
                self._admitted -= 1

    def _generate(self, prompts: list[str], tokens: int, seed: int | None, alias: str,
                  deadline: float) -> list[dict[str, str]]:
        """The answers, one generation at a time; on a failure or past ``deadline``, the traces already stored for
        this request are deleted (its answers are never returned)."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise Unavailable(f"busy: the model was generating for other requests for all of this request's "
                              f"{self.config.request_timeout_s:g} s; retry later")
        answered: list[dict[str, str]] = []
        try:
            loaded = self.current(alias)
            for i, prompt in enumerate(prompts):  # every prompt checked before the first generation
                check_context(loaded.tokenizer, loaded.model, prompt, tokens, i)
            for prompt in prompts:
                answered.append(answer(loaded, self.config.model_name, alias, prompt, tokens, seed, deadline))
            return answered
        except BaseException:
            delete_traces([a["trace_id"] for a in answered])
            raise
        finally:
            self._lock.release()


def save_server(path, config: ServerConfig, requirements: list[str]) -> None:
    """Write the served model (code and settings, no weights) to ``path``, replacing what was there."""
    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():  # "no input example": the signature says what a request holds
        warnings.filterwarnings("ignore", message=".*input example was not provided", category=UserWarning)
        mlflow.pyfunc.save_model(str(path), python_model=str(Path(__file__).with_name("served_model.py")),
                                 model_config=config.to_dict(), signature=signature(), pip_requirements=requirements)
