"""The served models in process: a registered version (tasks/registry/policy_pyfunc.py) and the served policy of the loop
(tasks/serving/alias_server.py) each record a trace per generation tagged with its version; the served policy follows the
alias when it moves, a version that cannot be loaded never stops the service, bad requests are named, and versions
registered before (MLflow's transformers flavour) still load."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tasks.serving.alias_server import ServerConfig
from tasks.serving.answer import MAX_NEW_TOKENS, RequestError, check_request

NAME = "rlhf-policy"


@pytest.mark.parametrize("prompts, params, message", [
    ([], {}, "inputs: no prompt"),
    (["ok", "  "], {}, r"inputs\[1\]: a prompt must be a non-empty string"),
    (["x" * 20_001], {}, r"inputs\[0\]: 20001 characters \(limit 20000\)"),
    (["ok"], {"max_new_tokens": 0}, "params.max_new_tokens: 0"),
    (["ok"], {"max_new_tokens": MAX_NEW_TOKENS + 1}, "params.max_new_tokens"),
    (["ok"], {"seed": -2}, "params.seed: -2"),
    (["ok"], {"seed": 2**64}, r"params.seed: 18446744073709551616 \(an integer from 0 to 2\*\*63-1"),
    (["ok"], {"max_new_tokens": True}, "params.max_new_tokens: True"),
    (["ok", None], {}, r"inputs\[1\]: a prompt must be a non-empty string, got None"),
    (["ok"] * 17, {}, r"inputs: 17 prompts \(limit 16 per request\)"),
    (["ok"] * 8, {"max_new_tokens": 200}, r"8 prompts x 200 = 1600 new tokens \(limit 1024 per request\)"),
    (["ok"], {"model_alias": 3}, "params.model_alias: 3"),
])
def test_bad_requests_name_the_input_or_param(prompts, params, message):
    with pytest.raises(RequestError, match=message):
        check_request(prompts, params)


def test_a_null_prompt_stays_null_whatever_shape_mlflow_parsed():
    """A JSON null in a one-column frame was served (and traced) as the prompt "None"."""
    import pandas as pd

    from tasks.serving.answer import request_prompts

    prompts = request_prompts(pd.DataFrame({0: ["ok", None]}))
    assert prompts == ["ok", None]
    with pytest.raises(RequestError, match=r"inputs\[1\]"):
        check_request(prompts, {})


def test_a_request_gets_the_served_defaults():
    assert check_request(["ok"], {}) == (20, None, None)  # a fresh seed per prompt, the served alias
    assert check_request(["ok"], {"max_new_tokens": 5, "seed": 7, "model_alias": "challenger"}) == (5, 7, "challenger")


@pytest.fixture(scope="module")
def registry(tmp_path_factory, make_tokenizer):
    """A store with three registered tiny policies, as the registry step logs them: v1 holds champion, v2
    challenger; v3 is logged with MLflow's transformers flavour, as versions were before policy models."""
    tokenizer = make_tokenizer()
    import mlflow
    import torch
    from huggingface_hub import ModelCard

    from rlhf_core.models.tiny import tiny_causal_lm
    from tasks.registry.policy_pyfunc import log_policy_model
    from tasks.registry.gate import pinned_requirements

    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment("rlhf-pipeline").experiment_id
    client = mlflow.MlflowClient()
    client.create_registered_model(NAME)
    for seed in (1, 2):
        torch.manual_seed(seed)
        weights = root / f"p{seed}"
        tiny_causal_lm(tokenizer, num_layers=1).save_pretrained(weights)
        tokenizer.save_pretrained(weights)
        source, model_id = log_policy_model(f"p{seed}", weights, ModelCard(f"# p{seed}"), NAME, pinned_requirements())
        client.create_model_version(NAME, source=source, model_id=model_id, tags={"policy": f"p{seed}"})
    torch.manual_seed(3)
    info = mlflow.transformers.log_model({"model": tiny_causal_lm(tokenizer, num_layers=1), "tokenizer": tokenizer},
                                         name="p3", task="text-generation", pip_requirements=pinned_requirements())
    client.create_model_version(NAME, source=info.model_uri, model_id=info.model_id, tags={"policy": "p3"})
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "2")
    return {"root": root, "uri": uri, "experiment": experiment}


def test_a_registered_version_answers_with_its_weights_and_a_trace(registry, monkeypatch):
    """What `mlflow models serve -m models:/rlhf-policy@champion` loads: the version the alias holds, a trace per
    answer in the project's experiment, tagged with that version; another alias is refused, naming the param."""
    import mlflow
    from mlflow.exceptions import MlflowException

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry["uri"])
    mlflow.set_experiment("Default")  # loading points traces at the experiment the model was logged in
    model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
    answers = model.predict(["The film", "I think"], params={"max_new_tokens": 4, "seed": 3})
    assert [a["model_version"] for a in answers] == ["1", "1"]
    client = mlflow.MlflowClient(registry["uri"])
    trace = client.get_trace(answers[0]["trace_id"])
    assert trace.info.experiment_id == registry["experiment"]
    assert {k: v for k, v in trace.info.tags.items() if k.startswith("rlhf.")} == {
        "rlhf.served": "true", "rlhf.model_name": NAME, "rlhf.model_version": "1", "rlhf.policy": "p1"}
    assert trace.info.trace_metadata["mlflow.modelId"] == client.get_model_version(NAME, "1").source.removeprefix("models:/")
    with pytest.raises(MlflowException, match="params.model_alias: 'challenger'"):
        model.predict(["The film"], params={"model_alias": "challenger"})


def test_weights_load_from_either_kind_of_version(registry, monkeypatch):
    import mlflow

    from tasks.serving.answer import load_weights

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry["uri"])
    mlflow.set_tracking_uri(registry["uri"])
    new, _ = load_weights(f"models:/{NAME}/1")
    old, tokenizer = load_weights(f"models:/{NAME}/3")  # MLflow's transformers flavour
    assert type(new).__name__ == type(old).__name__ == "GPT2LMHeadModel" and not new.training and not old.training
    assert tokenizer.eos_token_id is not None
    with pytest.raises(ValueError, match="neither a transformers model nor a policy"):
        load_weights(str(_plain_pyfunc(registry["root"])))


def test_only_policy_models_are_reused_for_the_same_weights(registry):
    """The registry re-uses a logged model for weights scored again on another set only when it is a policy model
    (a transformers-flavour one would serve without traces)."""
    import mlflow

    from tasks.registry.policy_pyfunc import is_policy_model

    client = mlflow.MlflowClient(registry["uri"])
    ids = [client.get_model_version(NAME, v).source.removeprefix("models:/") for v in ("1", "2", "3")]
    assert [is_policy_model(client, i) for i in ids] == [True, True, False]
    assert is_policy_model(client, "m-0123456789abcdef0123456789abcdef") is False


def _plain_pyfunc(root: Path) -> Path:
    """An MLflow pyfunc that is no policy (for the refusal's message)."""
    import mlflow

    class Echo(mlflow.pyfunc.PythonModel):
        _skip_type_hint_validation = True

        def predict(self, context, model_input, params=None):
            return model_input

    path = root / "plain"
    if not path.exists():
        mlflow.pyfunc.save_model(str(path), python_model=Echo(), pip_requirements=[])
    return path


@pytest.fixture()
def server(registry, tmp_path, monkeypatch):
    """The served model saved as `make serve-model` saves it, loaded as MLflow's scoring server loads it."""
    import mlflow

    from tasks.serving.alias_server import save_server
    from tasks.registry.gate import pinned_requirements

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry["uri"])
    mlflow.MlflowClient(registry["uri"]).set_registered_model_alias(NAME, "champion", "1")
    save_server(tmp_path / "server", ServerConfig(NAME, "champion", registry["experiment"], registry["uri"], 0.0),
                pinned_requirements())
    return mlflow.pyfunc.load_model(str(tmp_path / "server"))


def test_each_generation_is_a_trace_tagged_with_its_version(server, registry):
    import mlflow

    answers = server.predict(["The film", "I think"], params={"max_new_tokens": 4, "seed": 3})
    assert [a["model_version"] for a in answers] == ["1", "1"]
    assert all(a["text"] == p + a["completion"] for a, p in zip(answers, ["The film", "I think"]))
    client = mlflow.MlflowClient(registry["uri"])
    trace = client.get_trace(answers[0]["trace_id"])
    assert trace.info.experiment_id == registry["experiment"]
    assert {k: v for k, v in trace.info.tags.items() if k.startswith("rlhf.")} == {
        "rlhf.served": "true", "rlhf.model_name": NAME, "rlhf.model_version": "1", "rlhf.model_alias": "champion",
        "rlhf.policy": "p1"}
    version = client.get_model_version(NAME, "1")
    assert trace.info.trace_metadata["mlflow.modelId"] == version.source.removeprefix("models:/")  # the MLflow Model
    (span,) = trace.data.spans
    assert span.inputs == {"prompt": "The film", "max_new_tokens": 4, "seed": 3}
    assert span.outputs == {"completion": answers[0]["completion"]}
    again = server.predict(["The film"], params={"max_new_tokens": 4, "seed": 3})
    assert again[0]["completion"] == answers[0]["completion"]  # version + prompt + seed: the same answer
    other = server.predict(["The film"], params={"max_new_tokens": 4, "seed": 3, "model_alias": "challenger"})
    assert other[0]["model_version"] == "2"


def test_the_served_model_follows_the_alias(server, registry, caplog):
    import mlflow

    client = mlflow.MlflowClient(registry["uri"])
    assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "1"
    client.set_registered_model_alias(NAME, "champion", "2")  # a promotion
    with caplog.at_level(logging.INFO, logger="rlhf_pipeline.serving"):
        assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "2"
    assert "rlhf-policy@champion moved from v1 to v2" in caplog.text
    client.set_registered_model_alias(NAME, "champion", "3")  # a version registered with the transformers flavour
    assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "3"


def test_a_version_that_cannot_be_loaded_leaves_the_old_one_answering(server, registry, caplog):
    import mlflow

    client = mlflow.MlflowClient(registry["uri"])
    broken = client.create_model_version(NAME, source=str(Path(registry["root"]) / "nothing-here"))
    client.set_registered_model_alias(NAME, "champion", broken.version)
    try:
        with caplog.at_level(logging.ERROR, logger="rlhf_pipeline.serving"):
            answer = server.predict(["The film"], params={"max_new_tokens": 2})
        assert answer[0]["model_version"] == "1"
        assert f"v{broken.version} cannot be loaded" in caplog.text and "still answering with v1" in caplog.text
    finally:
        client.delete_model_version(NAME, broken.version)


def test_a_bad_request_is_refused_naming_it(server):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match=r"params.max_new_tokens: 999") as error:
        server.predict(["The film"], params={"max_new_tokens": 999})
    assert error.value.error_code == "INVALID_PARAMETER_VALUE"  # HTTP 400 from the scoring server
    with pytest.raises(MlflowException, match="rlhf-policy@nope: no version holds the alias") as error:
        server.predict(["The film"], params={"model_alias": "nope"})
    assert error.value.error_code == "TEMPORARILY_UNAVAILABLE"  # HTTP 503


def test_prompt_plus_new_tokens_past_the_context_is_refused_naming_both(server):
    """60 words + 256 new tokens once failed inside the model: HTTP 400 with a stack trace and the server's paths."""
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException, match=r"inputs\[0\]: \d+ prompt tokens \+ params.max_new_tokens 120 = \d+ "
                                              r"exceeds the model's context of 128 positions") as error:
        server.predict(["word " * 60], params={"max_new_tokens": 120})
    assert error.value.error_code == "INVALID_PARAMETER_VALUE"


def test_a_deleted_alias_stops_being_served_until_one_is_set(server, registry):
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(registry["uri"])
    assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "1"
    client.delete_registered_model_alias(NAME, "champion")
    try:
        with pytest.raises(MlflowException, match="rlhf-policy@champion: no version holds the alias") as error:
            server.predict(["The film"], params={"max_new_tokens": 2})
        assert error.value.error_code == "TEMPORARILY_UNAVAILABLE"
        assert server.unwrap_python_model()._loaded == {}  # the version it held is no longer kept in memory
    finally:
        client.set_registered_model_alias(NAME, "champion", "1")
    assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "1"


def _served_trace_ids(registry) -> set[str]:
    import mlflow

    client = mlflow.MlflowClient(registry["uri"])
    traces = client.search_traces(locations=[registry["experiment"]], filter_string="tags.`rlhf.served` = 'true'",
                                  max_results=500)
    return {t.info.trace_id for t in traces}


def test_a_request_past_its_time_is_cancelled_and_its_answers_are_not_offered(server, registry, monkeypatch):
    """1,000 prompts once kept the model busy for minutes after the 504, and every unreturned answer landed in the
    review list. Here the third generation runs past the deadline: it stops at its first token, the request fails
    with DEADLINE_EXCEEDED (504), the two answers already traced are deleted, and the model answers the next one."""
    import time

    from mlflow.exceptions import MlflowException

    import tasks.serving.alias_server as policy_server

    real, calls, traced = policy_server.answer, [], []

    def third_runs_late(*args):
        calls.append(args[3])
        late = time.monotonic() - 1 if len(calls) == 3 else args[-1]  # the third: its deadline has passed
        result = real(*args[:-1], late)
        traced.append(result["trace_id"])
        return result

    monkeypatch.setattr(policy_server, "answer", third_runs_late)
    before = _served_trace_ids(registry)
    with pytest.raises(MlflowException, match="ran past its time and was cancelled") as error:
        server.predict(["a", "b", "c", "d"], params={"max_new_tokens": 8, "seed": 1})
    assert error.value.error_code == "DEADLINE_EXCEEDED"
    assert calls == ["a", "b", "c"] and len(traced) == 2  # "d" never started
    assert _served_trace_ids(registry) == before  # neither the two answered nor the cancelled one is offered
    monkeypatch.setattr(policy_server, "answer", real)
    assert server.predict(["The film"], params={"max_new_tokens": 2})[0]["model_version"] == "1"  # the lock is free


def test_a_busy_model_refuses_at_once_or_after_the_request_time(server):
    from mlflow.exceptions import MlflowException

    model = server.unwrap_python_model()
    model._admitted = model.config.max_waiting + 1  # as many requests as allowed are generating or waiting
    try:
        with pytest.raises(MlflowException, match="busy: 5 requests are generating or waiting") as error:
            server.predict(["The film"], params={"max_new_tokens": 2})
        assert error.value.error_code == "TEMPORARILY_UNAVAILABLE"  # 503 with Retry-After (tasks/serving/http_app.py)
    finally:
        model._admitted = 0
    model.config = ServerConfig(**{**model.config.to_dict(), "request_timeout_s": 0.2})
    with model._lock:  # another request is generating
        with pytest.raises(MlflowException, match="busy: the model was generating") as error:
            server.predict(["The film"], params={"max_new_tokens": 2})
    assert model._admitted == 0


def test_sampling_stops_when_asked(tokenizer):
    from rlhf_core.evaluation import sample_responses
    from rlhf_core.models.tiny import tiny_causal_lm

    model = tiny_causal_lm(tokenizer, num_layers=1)
    full = sample_responses(model, tokenizer, ["The film"], max_new_tokens=12, seed=1)
    cut = sample_responses(model, tokenizer, ["The film"], max_new_tokens=12, seed=1, should_stop=lambda: True)
    assert len(cut.response_ids[0]) == 1 and cut.response_ids[0][0] == full.response_ids[0][0]
