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
])
def test_bad_requests_name_the_input_or_param(prompts, params, message):
    with pytest.raises(RequestError, match=message):
        check_request(prompts, params)


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
    with pytest.raises(MlflowException, match="rlhf-policy@nope: no such version"):
        server.predict(["The film"], params={"model_alias": "nope"})
