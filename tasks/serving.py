"""The served policy: an MLflow pyfunc that answers with the version holding a registry alias, follows the alias when
it moves, and records every generation as an MLflow trace tagged with the version that wrote it.

``make serve-model`` (``python -m flows.serve_model``) saves :class:`PolicyServer` as a small MLflow Model (code and
settings only, no weights: ``.serve/policy-server``) and runs MLflow's own scoring server on it
(``mlflow models serve --env-manager local``). MLflow keeps the HTTP side (``/invocations``, ``/ping``,
``/health``, request parsing); this module keeps what MLflow does not do for a registered transformers model:

- **the alias, followed.** ``models:/<name>@champion`` is resolved when the server starts and again at most every
  ``reload_s`` seconds at a request; a new version is loaded before it answers (the old one answers until then), a
  version that fails to load is logged and the old one keeps answering. No restart by hand.
- **a trace per generation.** Each prompt of a request is one trace in the project's experiment (root span
  ``generate``: inputs prompt, max_new_tokens, seed; output completion) tagged ``rlhf.served``,
  ``rlhf.model_name``, ``rlhf.model_version``, ``rlhf.model_alias``, ``rlhf.policy`` and linked to the version's
  MLflow Model, so a reviewer's feedback on it (an MLflow assessment) names the exact weights it judged. Traces are
  written before the answer is sent (synchronous trace logging), so an answer always has its trace.

A request: ``{"inputs": ["This movie was"], "params": {"max_new_tokens": 20, "seed": 7, "model_alias":
"challenger"}}``; every param is optional (``model_alias``: another alias of the same registered model, e.g. the
challenger for a side-by-side review). The answer, per prompt: ``{"text", "completion", "trace_id",
"model_version"}``. Sampling is the evaluation's (``rlhf_core.evaluation.sample_responses``: pure sampling, cut at
EOS); without a ``seed`` each prompt gets a fresh one, recorded in its trace (same version + prompt + seed = same
completion).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import SpanType
from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

SERVED_TAG = "rlhf.served"
MODEL_NAME_TAG = "rlhf.model_name"
MODEL_VERSION_TAG = "rlhf.model_version"
MODEL_ALIAS_TAG = "rlhf.model_alias"
POLICY_TAG = "rlhf.policy"
SPAN_NAME = "generate"
"""The root span of a served generation (and the trace's name)."""

PARAMS = {"max_new_tokens": 20, "seed": -1, "model_alias": ""}
"""Request params and their defaults: ``seed`` -1 = a fresh seed per prompt; ``model_alias`` '' = the served alias."""
MAX_NEW_TOKENS = 256
"""Most tokens one request may ask for per prompt (a CPU answers a few hundred tokens a second)."""
MAX_PROMPT_CHARS = 20_000
"""Longest prompt accepted (the feedback intake's ``max_field_chars``: a longer one could never be judged)."""

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

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ServerConfig:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedVersion:
    """One registered version in memory."""

    version: str
    model_id: str | None
    policy: str
    model: Any
    tokenizer: Any


class RequestError(ValueError):
    """A request the server refuses (HTTP 400), naming the input or param."""


def check_request(prompts: list[str], params: dict[str, Any]) -> tuple[int, int | None, str | None]:
    """``(max_new_tokens, seed or None, alias or None)`` of a request, or :class:`RequestError` naming what is wrong."""
    if not prompts:
        raise RequestError("inputs: no prompt")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(f"inputs[{i}]: a prompt must be a non-empty string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"inputs[{i}]: {len(prompt)} characters (limit {MAX_PROMPT_CHARS})")
    merged = {**PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
    tokens, seed, alias = merged["max_new_tokens"], merged["seed"], merged["model_alias"]
    if not isinstance(tokens, int) or not 1 <= tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"params.max_new_tokens: {tokens!r} (an integer from 1 to {MAX_NEW_TOKENS})")
    if not isinstance(seed, int) or seed < -1:
        raise RequestError(f"params.seed: {seed!r} (an integer >= 0, or -1 for a fresh one)")
    return tokens, (None if seed == -1 else seed), (alias or None)


class PolicyServer(PythonModel):
    """The served policy (see the module docstring). Built by :func:`save_server`; MLflow calls
    :meth:`load_context` once when the server starts and :meth:`predict` per request (possibly from several threads:
    one generation at a time, under a lock)."""

    # MLflow warns at every import that `predict` has no type hints (inside its own warnings context: no filter
    # reaches it). With hints it would derive the signature from them alone, and hints cannot declare the request
    # params (max_new_tokens, seed, model_alias): save_server gives the signature, and predict checks its input.
    # This class attribute is MLflow's own switch for that check (3.x, PythonModel.__init_subclass__).
    _skip_type_hint_validation = True

    def load_context(self, context) -> None:
        self.config = ServerConfig.from_dict(context.model_config)
        os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"  # the trace is stored before the answer is sent
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.config.tracking_uri
        if not uri:
            raise RuntimeError("the served policy needs MLFLOW_TRACKING_URI (the project's tracking server)")
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment_id=self.config.experiment_id)
        self._client = mlflow.MlflowClient()
        self._lock = threading.Lock()
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
            if known is None:
                raise RequestError(f"{self.config.model_name}@{alias}: no such version ({error.message})") from None
            log.warning("serving: looking up %s@%s failed (%s); still answering with v%s", self.config.model_name,
                        alias, error.message, known)
            return known
        if known is not None and found != known:
            log.info("serving: %s@%s moved from v%s to v%s", self.config.model_name, alias, known, found)
        return str(found)

    def _load(self, version: str) -> LoadedVersion:
        entry = self._client.get_model_version(self.config.model_name, version)
        uri = f"models:/{self.config.model_name}/{version}"
        components = mlflow.transformers.load_model(uri, return_type="components")
        model, tokenizer = components["model"], components["tokenizer"]
        model.eval()
        log.info("serving: loaded %s (policy %s)", uri, entry.tags.get("policy", "?"))
        model_id = entry.source.removeprefix("models:/") if entry.source.startswith("models:/m-") else None
        return LoadedVersion(version, model_id, entry.tags.get("policy", ""), model, tokenizer)

    def _forget_unused(self) -> None:
        """Keep in memory only the versions some alias holds now (a replaced champion is freed)."""
        wanted = {version for version, _ in self._resolved.values()}
        for version in [v for v in self._loaded if v not in wanted]:
            del self._loaded[version]

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[dict[str, str]]:
        prompts = _prompts(model_input)
        try:
            tokens, seed, alias = check_request(prompts, params or {})
            with self._lock:
                loaded = self.current(alias or self.config.alias)
                return [self._answer(loaded, alias or self.config.alias, p, tokens, seed) for p in prompts]
        except RequestError as error:
            raise MlflowException(str(error), error_code=INVALID_PARAMETER_VALUE) from None

    def _answer(self, loaded: LoadedVersion, alias: str, prompt: str, max_new_tokens: int,
                seed: int | None) -> dict[str, str]:
        """One generation, recorded as one trace."""
        from rlhf_core.evaluation import sample_responses  # torch: in the scoring server only, once the model loads

        def generate(text: str, tokens: int, seed: int) -> str:
            return sample_responses(loaded.model, loaded.tokenizer, [text], max_new_tokens=tokens, batch_size=1,
                                    seed=seed).responses[0]

        seed = secrets.randbelow(2**31) if seed is None else seed
        completion, trace_id = traced_generation(prompt, max_new_tokens, seed, generate,
                                                 trace_tags(self.config.model_name, loaded, alias), loaded.model_id)
        return {"text": prompt + completion, "completion": completion, "trace_id": trace_id,
                "model_version": loaded.version}


def traced_generation(prompt: str, max_new_tokens: int, seed: int, generate, tags: dict[str, str],
                      model_id: str | None = None) -> tuple[str, str]:
    """``generate(prompt, max_new_tokens, seed) -> completion`` inside one trace of the active experiment, in the
    served format (root span ``generate``: inputs prompt, max_new_tokens, seed; output completion; ``tags``; linked to
    the MLflow Model ``model_id``). Returns (completion, trace id)."""
    with mlflow.start_span(name=SPAN_NAME, span_type=SpanType.LLM) as span:
        span.set_inputs({"prompt": prompt, "max_new_tokens": max_new_tokens, "seed": seed})
        completion = generate(prompt, max_new_tokens, seed)
        span.set_outputs({"completion": completion})
        mlflow.update_current_trace(tags=tags, model_id=model_id)
        trace_id = span.trace_id
    mlflow.flush_trace_async_logging()  # stored before the answer leaves (a no-op when trace logging is synchronous)
    return completion, trace_id


def trace_tags(model_name: str, loaded: LoadedVersion, alias: str) -> dict[str, str]:
    return {SERVED_TAG: "true", MODEL_NAME_TAG: model_name, MODEL_VERSION_TAG: loaded.version,
            MODEL_ALIAS_TAG: alias, POLICY_TAG: loaded.policy}


def _prompts(model_input) -> list[str]:
    """The prompts of a request, whatever shape MLflow's parser gave them (a list, or a one-column frame)."""
    if hasattr(model_input, "columns"):  # pandas DataFrame (a JSON record input)
        return [str(v) for v in model_input.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return list(model_input)


def save_server(path, config: ServerConfig, requirements: list[str]) -> None:
    """Write the served model (code and settings, no weights) to ``path``, replacing what was there."""
    signature = ModelSignature(inputs=Schema([ColSpec("string")]),
                               params=ParamSchema([ParamSpec(k, _param_type(v), v) for k, v in PARAMS.items()]))
    shutil.rmtree(path, ignore_errors=True)
    with warnings.catch_warnings():  # "no input example": the signature says what a request holds
        warnings.filterwarnings("ignore", message=".*input example was not provided", category=UserWarning)
        mlflow.pyfunc.save_model(str(path), python_model=str(Path(__file__).with_name("served_model.py")),
                                 model_config=config.to_dict(), signature=signature, pip_requirements=requirements)


def _param_type(default) -> str:
    return {bool: "boolean", int: "long", float: "double", str: "string"}[type(default)]
