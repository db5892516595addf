"""What a served answer is, whichever MLflow Model answers it: the request checks, one generation recorded as one
MLflow trace tagged with the version that wrote it, and a registered version's weights loaded from the registry.

Two MLflow Models answer with these pieces, both served by MLflow's own scoring server (``mlflow models serve``):

- **each registered version** (``tasks/registry/policy_pyfunc.py``): its weights as artifacts, answering with them. So the
  typed ``mlflow models serve -m models:/rlhf-policy@champion`` records a trace per answer, tagged with the version
  the alias held when the server started.
- **the served policy of the loop** (``tasks/serving/alias_server.py``, ``make serve-model``): code and settings only; it
  answers with the version holding an alias and follows the alias when it moves, without a restart.

A request: ``{"inputs": ["This movie was"], "params": {"max_new_tokens": 20, "seed": 7}}``; every param is optional
(``model_alias``: another alias of the same registered model, ``make serve-model`` only). The answer, per prompt:
``{"text", "completion", "trace_id", "model_version"}``. Sampling is the evaluation's
(``rlhf_core.evaluation.sample_responses``: pure sampling, cut at EOS); without a ``seed`` each prompt gets a fresh
one, recorded in its trace (same version + prompt + seed = same completion). Each trace: root span ``generate``
(inputs prompt, max_new_tokens, seed; output completion), tags ``rlhf.served``, ``rlhf.model_name``,
``rlhf.model_version``, ``rlhf.model_alias`` (when asked by alias), ``rlhf.policy``, linked to the version's MLflow
Model, and stored before the answer is sent (synchronous trace logging), so an answer always has its trace.

What one request may ask (refused with HTTP 400 naming the limit, before any generation): at most
:data:`MAX_PROMPTS` prompts, :data:`MAX_TOTAL_NEW_TOKENS` new tokens in all, and per prompt its tokens plus
``max_new_tokens`` within the model's positions (both numbers named: nothing is truncated). A request that runs past
its time is cancelled between tokens (``Cancelled``: HTTP 504), and the traces it had stored are deleted: only
answers that were returned are offered for review.
"""

from __future__ import annotations

import contextvars
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import SpanType
from mlflow.models import Model, ModelSignature
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
MAX_PROMPTS = 16
"""Most prompts in one request (each is one generation, answered one after the other)."""
MAX_TOTAL_NEW_TOKENS = 1024
"""Most new tokens one request may ask in all (prompts x ``max_new_tokens``): a few seconds of a CPU, so one request
cannot hold the model for minutes while every other one waits."""
MAX_SEED = 2**63 - 1
"""Largest seed (torch's generator takes a signed 64-bit integer)."""
MAX_PROMPT_CHARS = 20_000
"""Longest prompt accepted (the feedback intake's ``max_field_chars``: a longer one could never be judged)."""
log = logging.getLogger("rlhf_pipeline.serving")

WEIGHTS_ARTIFACT = "policy"
"""The artifact of a registered version (``tasks/registry/policy_pyfunc.py``) holding its causal LM, tokenizer and card."""


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


class Unavailable(RuntimeError):
    """The service cannot answer now (HTTP 503, with ``Retry-After``): busy, or no version holds the alias."""


class Cancelled(RuntimeError):
    """A request stopped because it ran past its time (HTTP 504); what it had stored is removed."""


REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("rlhf_request_id", default="")
"""The id of the HTTP request being answered (set by ``tasks/serving/http_app.py``; MLflow runs ``predict`` in a thread
that copies the context): named in every error answer and in the server's log."""

ALIAS_MISSING = "no version holds the alias"
"""The words of the 503 answered while an alias is unset (the review page falls back to the champion on them)."""


def check_request(prompts: list[str], params: dict[str, Any]) -> tuple[int, int | None, str | None]:
    """``(max_new_tokens, seed or None, alias or None)`` of a request, or :class:`RequestError` naming what is wrong."""
    if not prompts:
        raise RequestError("inputs: no prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"inputs: {len(prompts)} prompts (limit {MAX_PROMPTS} per request)")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise RequestError(f"inputs[{i}]: a prompt must be a non-empty string, got {_shown(prompt)}")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"inputs[{i}]: {len(prompt)} characters (limit {MAX_PROMPT_CHARS})")
    merged = {**PARAMS, **{k: v for k, v in (params or {}).items() if v is not None}}
    tokens, seed, alias = merged["max_new_tokens"], merged["seed"], merged["model_alias"]
    if not _integer(tokens) or not 1 <= tokens <= MAX_NEW_TOKENS:
        raise RequestError(f"params.max_new_tokens: {_shown(tokens)} (an integer from 1 to {MAX_NEW_TOKENS})")
    if len(prompts) * tokens > MAX_TOTAL_NEW_TOKENS:
        raise RequestError(f"params.max_new_tokens: {len(prompts)} prompts x {tokens} = {len(prompts) * tokens} new "
                           f"tokens (limit {MAX_TOTAL_NEW_TOKENS} per request)")
    if not _integer(seed) or not -1 <= seed <= MAX_SEED:
        raise RequestError(f"params.seed: {_shown(seed)} (an integer from 0 to 2**63-1, or -1 for a fresh one)")
    if not isinstance(alias, str):
        raise RequestError(f"params.model_alias: {_shown(alias)} (an alias name)")
    return tokens, (None if seed == -1 else seed), (alias or None)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (an error message never echoes a whole request)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_context(tokenizer, model, prompt: str, max_new_tokens: int, index: int = 0) -> None:
    """:class:`RequestError` naming both numbers when the prompt's tokens plus ``max_new_tokens`` exceed the model's
    positions (generating past them fails inside the model; nothing is truncated silently)."""
    positions = context_length(model)
    if positions is None:
        return
    used = len(tokenizer(prompt).input_ids)
    if used + max_new_tokens > positions:
        raise RequestError(f"inputs[{index}]: {used} prompt tokens + params.max_new_tokens {max_new_tokens} = "
                           f"{used + max_new_tokens} exceeds the model's context of {positions} positions")


def context_length(model) -> int | None:
    """The model's positions (GPT-2's ``n_positions``, most others' ``max_position_embeddings``); None if unknown."""
    config = getattr(model, "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def request_prompts(model_input) -> list[str]:
    """The prompts of a request, whatever shape MLflow's parser gave them (a list, or a one-column frame)."""
    if hasattr(model_input, "columns"):  # pandas DataFrame (a JSON record input)
        # as they came: a null prompt stays None (refused by check_request), never the string "None"
        return [v if isinstance(v, str) else None for v in model_input.iloc[:, 0].tolist()]
    if isinstance(model_input, str):
        return [model_input]
    return list(model_input)


def signature() -> ModelSignature:
    """A request: one string column of prompts, and the params of :data:`PARAMS`."""
    kinds = {bool: "boolean", int: "long", float: "double", str: "string"}
    return ModelSignature(inputs=Schema([ColSpec("string")]),
                          params=ParamSchema([ParamSpec(k, kinds[type(v)], v) for k, v in PARAMS.items()]))


def synchronous_traces() -> None:
    """Store each trace before its answer leaves (MLflow exports traces in the background by default)."""
    os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"


def answer(loaded: LoadedVersion, model_name: str, alias: str | None, prompt: str, max_new_tokens: int,
           seed: int | None, deadline: float | None = None) -> dict[str, str]:
    """One generation of ``loaded``, recorded as one trace; the served answer. Past ``deadline`` (``time.monotonic``)
    the generation stops at the next token and :class:`Cancelled` is raised (its trace is deleted)."""
    from rlhf_core.evaluation import sample_responses  # torch: in the scoring server only, once the model loads

    def past_deadline() -> bool:
        return deadline is not None and time.monotonic() > deadline

    def generate(text: str, tokens: int, seed: int) -> str:
        completion = sample_responses(loaded.model, loaded.tokenizer, [text], max_new_tokens=tokens, batch_size=1,
                                      seed=seed, should_stop=past_deadline).responses[0]
        if past_deadline():
            raise Cancelled("the request ran past its time and was cancelled")
        return completion

    seed = secrets.randbelow(2**31) if seed is None else seed
    completion, trace_id = traced_generation(prompt, max_new_tokens, seed, generate,
                                             trace_tags(model_name, loaded, alias), loaded.model_id)
    return {"text": prompt + completion, "completion": completion, "trace_id": trace_id,
            "model_version": loaded.version}


def traced_generation(prompt: str, max_new_tokens: int, seed: int, generate, tags: dict[str, str],
                      model_id: str | None = None) -> tuple[str, str]:
    """``generate(prompt, max_new_tokens, seed) -> completion`` inside one trace of the active experiment, in the
    served format (root span ``generate``: inputs prompt, max_new_tokens, seed; output completion; ``tags``; linked to
    the MLflow Model ``model_id``). Returns (completion, trace id)."""
    try:
        with mlflow.start_span(name=SPAN_NAME, span_type=SpanType.LLM) as span:
            trace_id = span.trace_id
            span.set_inputs({"prompt": prompt, "max_new_tokens": max_new_tokens, "seed": seed})
            completion = generate(prompt, max_new_tokens, seed)
            span.set_outputs({"completion": completion})
            mlflow.update_current_trace(tags=tags, model_id=model_id)
    except Exception:
        delete_traces([trace_id])  # a failed generation answers nothing: it is not offered for review
        raise
    mlflow.flush_trace_async_logging()  # stored before the answer leaves (a no-op when trace logging is synchronous)
    return completion, trace_id


def delete_traces(trace_ids: list[str]) -> None:
    """Remove traces of answers that were never returned (a cancelled or failed request), best effort: a store that
    refuses is logged (those traces carry no ``rlhf.served`` tag when their generation failed)."""
    if not trace_ids:
        return
    try:
        experiment_id = mlflow.tracking.fluent._get_experiment_id()
        mlflow.MlflowClient().delete_traces(experiment_id, trace_ids=trace_ids)
    except Exception as error:  # noqa: BLE001 - cleaning up after a failure must not hide that failure
        log.warning("serving: could not delete the traces of an unreturned answer %s (%s)", trace_ids, error)


def trace_tags(model_name: str, loaded: LoadedVersion, alias: str | None) -> dict[str, str]:
    tags = {SERVED_TAG: "true", MODEL_NAME_TAG: model_name, MODEL_VERSION_TAG: loaded.version,
            POLICY_TAG: loaded.policy}
    return {**tags, MODEL_ALIAS_TAG: alias} if alias else tags


def load_pretrained(folder: str | Path) -> tuple[Any, Any]:
    """(causal LM in eval mode, tokenizer) of a policy saved with ``save_pretrained`` in ``folder``: the evaluation's
    loaders (a weight that does not belong to a causal LM is an error naming the folder)."""
    from tasks.stages.common.scoring import load_policy, load_tokenizer  # torch and transformers: only when a version loads

    model = load_policy(folder)
    model.eval()
    return model, load_tokenizer(folder)


def load_weights(model_uri: str) -> tuple[Any, Any]:
    """(causal LM, tokenizer) of a registered version or MLflow Model, whichever way it was logged: the project's
    pyfunc (``tasks/registry/policy_pyfunc.py``: the weights in its artifact ``policy``) or, for versions registered before
    that, MLflow's transformers flavour. Loads the weights only (no trace, no experiment set)."""
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri))
    flavors = Model.load(str(local)).flavors
    if "transformers" in flavors:
        components = mlflow.transformers.load_model(str(local), return_type="components")
        components["model"].eval()
        return components["model"], components["tokenizer"]
    artifacts = flavors.get("python_function", {}).get("artifacts", {})
    if WEIGHTS_ARTIFACT not in artifacts:
        raise ValueError(f"{model_uri}: neither a transformers model nor a policy of this project (no artifact "
                         f"{WEIGHTS_ARTIFACT!r})")
    return load_pretrained(local / artifacts[WEIGHTS_ARTIFACT]["path"])
