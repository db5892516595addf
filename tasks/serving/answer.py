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
"""

from __future__ import annotations

import os
import secrets
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
MAX_PROMPT_CHARS = 20_000
"""Longest prompt accepted (the feedback intake's ``max_field_chars``: a longer one could never be judged)."""
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


def request_prompts(model_input) -> list[str]:
    """The prompts of a request, whatever shape MLflow's parser gave them (a list, or a one-column frame)."""
    if hasattr(model_input, "columns"):  # pandas DataFrame (a JSON record input)
        return [str(v) for v in model_input.iloc[:, 0].tolist()]
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
           seed: int | None) -> dict[str, str]:
    """One generation of ``loaded``, recorded as one trace; the served answer."""
    from rlhf_core.evaluation import sample_responses  # torch: in the scoring server only, once the model loads

    def generate(text: str, tokens: int, seed: int) -> str:
        return sample_responses(loaded.model, loaded.tokenizer, [text], max_new_tokens=tokens, batch_size=1,
                                seed=seed).responses[0]

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
    with mlflow.start_span(name=SPAN_NAME, span_type=SpanType.LLM) as span:
        span.set_inputs({"prompt": prompt, "max_new_tokens": max_new_tokens, "seed": seed})
        completion = generate(prompt, max_new_tokens, seed)
        span.set_outputs({"completion": completion})
        mlflow.update_current_trace(tags=tags, model_id=model_id)
        trace_id = span.trace_id
    mlflow.flush_trace_async_logging()  # stored before the answer leaves (a no-op when trace logging is synchronous)
    return completion, trace_id


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
