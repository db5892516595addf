"""A registered policy version as an MLflow Model: its weights (a plain causal LM, its tokenizer and model card) are
the artifact ``policy`` of a pyfunc that answers with them and records each generation as an MLflow trace tagged
with the version (``tasks/serving/answer.py``).

So the typed ``mlflow models serve -m models:/rlhf-policy@champion --env-manager local`` (from the project's venv,
in the project's folder: MLflow's default store is ``./mlflow.db``, the project's) serves the champion with a trace
per answer in the project's experiment. MLflow resolves the alias once, when the server starts: this server stays
on that version (a promotion is served after a restart; ``make serve-model``, ``tasks/serving/alias_server.py``, follows
the alias without one). ``mlflow.pyfunc.load_model("models:/rlhf-policy@champion").predict(["This movie was"])``
answers the same way in a Python session (and sets the active experiment to the project's, where its traces go).

The pyfunc's code is this project (``tasks.registry.policy_pyfunc``, loaded as "models from code": no pickle): serving a
version needs the project installed (``make setup``, or ``pip install -e .`` at the version's ``lineage.git_commit``).
The weights alone need nothing of it: ``tasks.serving.answer.load_weights`` or ``AutoModelForCausalLM.from_pretrained`` on
the downloaded ``artifacts/policy``.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import mlflow
from mlflow.exceptions import INVALID_PARAMETER_VALUE, MlflowException
from mlflow.models import Model
from mlflow.pyfunc import PythonModel

from tasks.stages.common.scoring import load_policy
from tasks.serving.answer import (WEIGHTS_ARTIFACT, LoadedVersion, RequestError, answer, check_request, load_pretrained,
                           request_prompts, signature, synchronous_traces)

FORMAT_TAG, FORMAT = "rlhf.format", "policy-pyfunc"
"""Tag of the MLflow Models this module logs (versions registered before it are MLflow's transformers flavour)."""
PREFERRED_ALIAS = "champion"
"""When one MLflow Model is registered as several versions (the same weights scored on two evaluation sets), traces
name the version holding this alias, else the newest."""

log = logging.getLogger("rlhf_pipeline.serving")


class RegisteredPolicy(PythonModel):
    """One registered version, answering with its own weights (see the module docstring). MLflow calls
    :meth:`load_context` once when the model loads and :meth:`predict` per request (one generation at a time)."""

    _skip_type_hint_validation = True  # as PolicyServer: the signature declares the request params

    def load_context(self, context) -> None:
        config = context.model_config or {}
        self.model_name = config.get("model_name", "")
        synchronous_traces()
        folder = context.artifacts[WEIGHTS_ARTIFACT]
        model, tokenizer = load_pretrained(folder)
        model_id = _own_model_id(Path(folder))
        version = _trace_destination(self.model_name, model_id)
        self.loaded = LoadedVersion(version, model_id, config.get("policy", ""), model, tokenizer)
        self._lock = threading.Lock()
        log.info("serving: %s v%s (policy %s), fixed to these weights", self.model_name, version or "?",
                 self.loaded.policy)

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[dict[str, str]]:
        prompts = request_prompts(model_input)
        try:
            tokens, seed, alias = check_request(prompts, params or {})
            if alias:
                raise RequestError(f"params.model_alias: {alias!r}: a registered version answers with its own weights;"
                                   " `make serve-model` serves any alias of the model")
            with self._lock:
                return [answer(self.loaded, self.model_name, None, p, tokens, seed) for p in prompts]
        except RequestError as error:
            raise MlflowException(str(error), error_code=INVALID_PARAMETER_VALUE) from None


def _own_model_id(folder: Path) -> str | None:
    """The MLflow Model id in the ``MLmodel`` file above the weights artifact (None for a model saved, not logged)."""
    for parent in folder.parents[:3]:
        if (parent / "MLmodel").is_file():
            return Model.load(str(parent)).model_id
    return None


def _trace_destination(model_name: str, model_id: str | None) -> str:
    """Point traces at the experiment the model was logged in, and return the registered version these weights are
    ('' when the active store does not know them: the traces then go to the active experiment, untagged by version)."""
    if not model_id:
        return ""
    client = mlflow.MlflowClient()
    try:
        mlflow.set_experiment(experiment_id=client.get_logged_model(model_id).experiment_id)
        found = [client.get_model_version(model_name, v.version)
                 for v in client.search_model_versions(f"name = '{model_name}'")
                 if v.source == f"models:/{model_id}"]
    except MlflowException as error:
        log.warning("serving: MLflow Model %s is not in the store %s (%s): traces go to the active experiment "
                    "without a version", model_id, mlflow.get_tracking_uri(), error.message)
        return ""
    found.sort(key=lambda v: (PREFERRED_ALIAS in v.aliases, int(v.version)))
    return str(found[-1].version) if found else ""


def log_policy_model(policy: str, weights: Path, card, model_name: str, requirements: list[str]) -> tuple[str, str]:
    """Log the policy of ``weights`` (plain causal LM, tokenizer, ``card``) as a :class:`RegisteredPolicy` MLflow
    Model in the active run or experiment; (model uri, model id)."""
    from transformers import AutoTokenizer  # transformers: only when a model is logged

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / WEIGHTS_ARTIFACT
        load_policy(weights).save_pretrained(folder)  # a PPO checkpoint's value head is not part of the served model
        AutoTokenizer.from_pretrained(str(weights)).save_pretrained(folder)
        card.save(folder / "README.md")
        with warnings.catch_warnings():  # "no input example": the signature says what a request holds
            warnings.filterwarnings("ignore", message=".*input example was not provided", category=UserWarning)
            info = mlflow.pyfunc.log_model(
                name=f"rlhf-{policy}", python_model=str(Path(__file__).with_name("model_code.py")),
                artifacts={WEIGHTS_ARTIFACT: str(folder)}, model_config={"model_name": model_name, "policy": policy},
                signature=signature(), pip_requirements=requirements, metadata={"rlhf.policy": policy},
                tags={"rlhf.policy": policy, FORMAT_TAG: FORMAT})
    return info.model_uri, info.model_id


def is_policy_model(client, model_id: str) -> bool:
    """Whether the MLflow Model ``model_id`` was logged by :func:`log_policy_model`."""
    try:
        return client.get_logged_model(model_id).tags.get(FORMAT_TAG) == FORMAT
    except MlflowException:
        return False
