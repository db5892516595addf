"""The served policy (tasks/serving.py) in process: a trace per generation tagged with its version, the alias followed
when it moves, a version that cannot be loaded never stops the service, bad requests named."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tasks.serving import MAX_NEW_TOKENS, RequestError, ServerConfig, check_request

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
    """A store with two registered tiny policies: v1 holds champion, v2 challenger."""
    tokenizer = make_tokenizer()
    import mlflow
    import torch
    from mlflow.models import infer_signature

    from rlhf_core.models.tiny import tiny_causal_lm
    from tasks.registry import GENERATION, INPUT_EXAMPLE, pinned_requirements

    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment("rlhf-pipeline").experiment_id
    client = mlflow.MlflowClient()
    client.create_registered_model(NAME)
    for seed in (1, 2):
        torch.manual_seed(seed)
        info = mlflow.transformers.log_model(
            {"model": tiny_causal_lm(tokenizer, num_layers=1), "tokenizer": tokenizer}, name=f"p{seed}",
            task="text-generation", signature=infer_signature(INPUT_EXAMPLE, ["x"], params=GENERATION),
            pip_requirements=pinned_requirements())
        client.create_model_version(NAME, source=info.model_uri, model_id=info.model_id, tags={"policy": f"p{seed}"})
    client.set_registered_model_alias(NAME, "champion", "1")
    client.set_registered_model_alias(NAME, "challenger", "2")
    return {"root": root, "uri": uri, "experiment": experiment}


@pytest.fixture()
def server(registry, tmp_path, monkeypatch):
    """The served model saved as `make serve-model` saves it, loaded as MLflow's scoring server loads it."""
    import mlflow

    from tasks.registry import pinned_requirements
    from tasks.serving import save_server

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
