"""The registry rule, and the registry step against a temporary MLflow store with real tiny policies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _pipeline_project import make_project, mlflow_client

from rlhf_core.evaluation import PairedTest, PromptScores
from tasks.spec.params import RegistryParams
from tasks.registry.gate import Decision, WeightsMismatchError, decide, pick_challenger, prompt_values, registry_task
from tasks.serving.answer import load_weights

RULE = RegistryParams(model_name="rlhf-policy", candidates=["ppo", "dpo"], metric="gold_reward",
                      min_improvement=0.05, max_kl=10.0, max_kl_increase=5.0, significance=0.05,
                      bootstrap_samples=2000, seed=0)
CLEAR = PairedTest(n=400, gain=0.06, low=0.03, high=0.09, p_value=0.0005)
NOISE = PairedTest(n=400, gain=0.06, low=-0.02, high=0.14, p_value=0.09)
NAME = "rlhf-policy"


def m(gold, kl=1.0):
    return {"gold_reward": gold, "rm_reward": 0.0, "kl": kl, "perplexity": 3.0, "win_rate": 0.5}


def test_pick_challenger_by_metric():
    assert pick_challenger({"sft": m(0.9), "ppo": m(0.4), "dpo": m(0.6)}, RULE) == "dpo"
    assert pick_challenger({"ppo": m(0.5), "dpo": m(0.5)}, RULE) == "ppo"  # tie: first listed


@pytest.mark.parametrize("challenger, champion, test, promote, words", [
    (m(0.5), None, None, True, "no champion yet"),
    (m(0.56), m(0.5), CLEAR, True, "p=0.0005"),
    (m(0.55), m(0.5), CLEAR, True, ">= min_improvement"),       # exactly min_improvement
    (m(0.56), m(0.5), NOISE, False, "not beyond the evaluation's noise"),  # a big enough mean, but noise
    (m(0.54), m(0.5), CLEAR, False, "< min_improvement"),
    (m(0.2), m(0.5), None, False, "< min_improvement"),
    (m(0.9, kl=11.0), m(0.5), CLEAR, False, "exceeds registry.max_kl"),
    (m(0.9, kl=11.0), None, None, False, "exceeds registry.max_kl"),
    # issue 33: a KL jump from 3.8 to 9.3 (within max_kl) was promoted without a word
    (m(0.9, kl=9.3), m(0.5, kl=3.8), CLEAR, False,
     "KL 9.300 vs champion 3.800: +5.500 (limit +5) exceeds registry.max_kl_increase 5.0"),
    (m(0.56, kl=4.8), m(0.5, kl=3.8), CLEAR, True, "KL 4.800 vs champion 3.800: +1.000 (limit +5)"),  # reported
])
def test_decide(challenger, champion, test, promote, words):
    decision = decide(challenger, champion, RULE, test)
    assert isinstance(decision, Decision) and decision.promote is promote
    assert words in decision.reason


def test_decide_needs_the_paired_test_for_a_win():
    with pytest.raises(ValueError, match="paired test"):
        decide(m(0.6), m(0.5), RULE)


def test_prompt_values_per_metric():
    scores = PromptScores(gold=[0.5, -0.2, 0.1], rm=[2.0, 1.0, 0.0])
    assert prompt_values("gold_reward", scores, [0.0, 0.0, 0.1]) == [0.5, -0.2, 0.1]
    assert prompt_values("rm_reward", scores, [0.0, 0.0, 0.1]) == [2.0, 1.0, 0.0]
    assert prompt_values("win_rate", scores, [0.0, 0.0, 0.1]) == [1.0, 0.0, 0.5]  # beats, loses, ties SFT
    with pytest.raises(ValueError, match="kl"):
        prompt_values("kl", scores, [0.0, 0.0, 0.1])


# --------------------------------------------------------------------------------------------
# the registry step on a tiny project: sft, reward model, a PPO checkpoint with a value head, a DPO policy
# --------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _perturbed(model, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def _save_policy(root: Path, name: str, tokenizer, seed: int, value_head: bool = False) -> None:
    from rlhf_core import AutoModelForCausalLMWithValueHead
    from rlhf_core.models.tiny import tiny_causal_lm

    out = root / "models" / name
    model = _perturbed(tiny_causal_lm(tokenizer, num_layers=1), seed)
    (AutoModelForCausalLMWithValueHead.from_pretrained(model) if value_head else model).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(f"---\nlibrary_name: rlhf_core\n---\n# rlhf-{name}\n\nA test policy.\n")


@pytest.fixture()
def project(tmp_path, monkeypatch, tokenizer):
    """A project with prompts, held-out text and tiny models (PPO saved with its value head), evaluated."""
    from rlhf_core.models.tiny import tiny_causal_lm, tiny_reward_model
    from tasks.run.stage_task import run_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    root = make_project(tmp_path / "proj", {"registry.min_improvement": 0.05, "registry.candidates": ["ppo"],
                                            "evaluate.num_prompts": 6, "evaluate.max_new_tokens": 4,
                                            "evaluate.batch_size": 6}, git_dvc=False)
    _write_jsonl(root / "data" / "prompts_eval.jsonl", [{"query": q} for q in
                                                        ("The film", "This movie", "I think", "Acting was", "A", "It")])
    _write_jsonl(root / "data" / "heldout.jsonl", [{"text": "The movie was good."}, {"text": "I did not like it."}])
    tiny_causal_lm(tokenizer, num_layers=1).save_pretrained(root / "models" / "sft")
    tokenizer.save_pretrained(root / "models" / "sft")
    tiny_reward_model(tokenizer, num_layers=1).save_pretrained(root / "models" / "reward_model")
    tokenizer.save_pretrained(root / "models" / "reward_model")
    _save_policy(root, "ppo", tokenizer, seed=1, value_head=True)
    _save_policy(root, "dpo", tokenizer, seed=2)
    run_stage("evaluate", str(root))
    return root


def _evaluation(root: Path) -> dict:
    return json.loads((root / "metrics" / "evaluate.json").read_text())


PROMPTS_FILE = Path("data") / "evaluate_prompts.csv"


def _set_scores(root: Path, **gold: list[float]) -> None:
    """Pretend evaluate gave these per-prompt gold scores (and their mean) to the current weights (hashes
    recomputed from disk), in evaluate.json and data/evaluate_prompts.csv."""
    from tasks.stages.common.scoring import content_md5, read_prompt_scores, write_prompt_scores

    evaluation, scores = _evaluation(root), read_prompt_scores(root / PROMPTS_FILE)
    for policy, values in gold.items():
        evaluation[policy]["gold_reward"] = round(sum(values) / len(values), 4)
        evaluation["scored"]["policies"][policy] = content_md5(root / "models" / policy)
        scores[policy] = PromptScores(gold=list(values), rm=scores[policy].rm)
    (root / "metrics" / "evaluate.json").write_text(json.dumps(evaluation))
    write_prompt_scores(root / PROMPTS_FILE, scores)


def _rescored_as(monkeypatch, gold: list[float]) -> list[int]:
    """Make re-scoring the champion return these per-prompt gold scores; returns the list of calls."""
    from tasks.registry import gate as registry

    calls = []

    def fake(policy, evaluation):
        calls.append(1)
        return (m(round(sum(gold) / len(gold), 4)), PromptScores(gold=list(gold), rm=[0.0] * len(gold)))

    monkeypatch.setattr(registry, "rescore", fake)
    return calls


def test_evaluate_records_what_it_scored(project):
    from tasks.registry.gate import current_evaluation_set
    from tasks.stages.common.scoring import content_md5
    from tasks.stages import load_params

    def load_evaluation_set(root):
        return current_evaluation_set(root, load_params(root / "params.yaml"))

    scored = _evaluation(project)["scored"]
    assert scored["policies"] == {p: content_md5(project / "models" / p) for p in ("sft", "ppo", "dpo")}
    assert all(h.endswith(".dir") for h in scored["policies"].values())
    evaluation_set = load_evaluation_set(project)
    assert scored["evaluation_set"] == evaluation_set.md5
    assert set(evaluation_set.inputs) == {"data/prompts_eval.jsonl", "data/heldout.jsonl", "models/sft",
                                          "models/reward_model"}
    (project / "data" / "heldout.jsonl").write_text('{"text": "Other held-out text."}\n')  # another set
    assert load_evaluation_set(project).md5 != evaluation_set.md5


def test_registers_a_loadable_mlflow_model_with_lineage(project, capfd):
    import mlflow

    from tasks.stages.common.scoring import content_md5

    client = mlflow_client(project)
    capfd.readouterr()
    first = registry_task.fn(str(project))
    assert "UNEXPECTED" not in "".join(capfd.readouterr())  # the PPO value head is dropped quietly
    assert first["registered"] and first["policy"] == "ppo" and first["decision"] == "promote"
    version = client.get_model_version_by_alias(NAME, "champion")
    assert version.version == first["version"]
    assert client.get_model_version_by_alias(NAME, "challenger").version == first["version"]
    tags = version.tags
    experiment = client.get_run(version.run_id).info.experiment_id
    (evaluate_run,) = client.search_runs([experiment], "tags.`rlhf.stage` = 'evaluate'")
    assert tags["lineage.weights_md5"] == content_md5(project / "models" / "ppo")
    assert tags["evaluation.set_md5"] == _evaluation(project)["scored"]["evaluation_set"]
    assert tags["evaluation.run_id"] == evaluate_run.info.run_id
    assert tags["dvc.data/prompts_eval.jsonl"] == content_md5(project / "data" / "prompts_eval.jsonl")
    assert tags["dvc.data/prompts_train.jsonl"] == "missing"  # (PPO's training prompts: not in this tiny project)
    assert tags["dvc.models/reward_model"] == content_md5(project / "models" / "reward_model")
    assert tags["lineage.git_commit"] and tags["registry.state"] == "complete"
    assert float(tags["metric.gold_reward"]) == _evaluation(project)["ppo"]["gold_reward"]
    assert version.source.startswith("models:/m-")  # a LoggedModel (MLflow 3), not a folder of artifacts
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.name == "rlhf-ppo" and json.loads(logged.tags["mlflow.modelVersions"]) == [
        {"name": NAME, "version": first["version"]}]  # the UI shows it as registered, linked to the version
    assert version.description.startswith("ppo: promoted to champion. no champion yet")
    assert tags["lineage.weights_md5"] in version.description and evaluate_run.info.run_id in version.description

    model, _ = load_weights(f"models:/{NAME}@champion")
    assert type(model).__name__ == "GPT2LMHeadModel" and not model.training
    assert not any(k.startswith("v_head") for k in model.state_dict())
    pyfunc = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")  # what `mlflow models serve -m` loads
    (out,) = pyfunc.predict(["The film"], params={"max_new_tokens": 3, "seed": 0})
    assert out["text"] == "The film" + out["completion"] and out["model_version"] == str(first["version"])
    trace = client.get_trace(out["trace_id"])  # each answer is a trace in the project's experiment, with its version
    assert trace.info.experiment_id == experiment and trace.info.tags["rlhf.model_version"] == str(first["version"])
    assert trace.info.tags["rlhf.policy"] == "ppo" and trace.info.trace_metadata["mlflow.modelId"] == logged.model_id
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{NAME}@champion"))
    mlmodel = (local / "MLmodel").read_text()
    assert "python_function" in mlmodel and "signature" in mlmodel and "model_code.py" in mlmodel
    card = (local / "artifacts" / "policy" / "README.md").read_text()
    assert "# rlhf-ppo" in card and "lineage.weights_md5" in card
    requirements = (local / "requirements.txt").read_text().split()
    assert any(r.startswith("mlflow==") for r in requirements) and any(r.startswith("torch==") for r in requirements)

    again = registry_task.fn(str(project))  # same weights, same evaluation: nothing new
    assert again["registered"] is False and again["version"] == first["version"]
    assert len(client.search_model_versions(f"name='{NAME}'")) == 1


def test_refuses_weights_that_evaluate_did_not_score(project):
    client = mlflow_client(project)
    shutil.rmtree(project / "models" / "ppo")
    shutil.copytree(project / "models" / "sft", project / "models" / "ppo")  # the "sft copied into ppo"
    with pytest.raises(WeightsMismatchError, match="models/ppo: its content hash .* is not the .* that evaluate scored"):
        registry_task.fn(str(project))
    assert client.search_registered_models() == [] or client.search_model_versions(f"name='{NAME}'") == []


def test_champion_moves_only_on_a_win_beyond_the_noise(project, tokenizer, monkeypatch):
    client = mlflow_client(project)
    base = [0.3, 0.1, 0.5, 0.2, 0.4, 0.3]  # six evaluation prompts
    _set_scores(project, ppo=base)
    first = registry_task.fn(str(project))
    assert first["decision"] == "promote"
    calls = _rescored_as(monkeypatch, base)  # new ppo weights: the champion's are no longer on disk

    _save_policy(project, "ppo", tokenizer, seed=3, value_head=True)
    _set_scores(project, ppo=[v + 0.04 for v in base])  # better on every prompt, by less than min_improvement
    weak = registry_task.fn(str(project))
    assert weak["registered"] and weak["decision"] == "keep" and "< min_improvement" in weak["reason"]
    assert client.get_model_version_by_alias(NAME, "champion").version == first["version"]
    assert client.get_model_version_by_alias(NAME, "challenger").version == weak["version"]
    tags = client.get_model_version(NAME, weak["version"]).tags
    assert tags["champion.version"] == str(first["version"]) and tags["champion.rescored"] == "true" and calls
    assert float(tags["champion.metric.gold_reward"]) == 0.3 and float(tags["metric.gold_reward"]) == 0.34

    _save_policy(project, "ppo", tokenizer, seed=4, value_head=True)
    _set_scores(project, ppo=[v + d for v, d in zip(base, (0.9, -0.7, 0.8, -0.8, 0.6, -0.44))])  # mean +0.06: noise
    noisy = registry_task.fn(str(project))
    assert noisy["decision"] == "keep" and "not beyond the evaluation's noise" in noisy["reason"]
    tags = client.get_model_version(NAME, noisy["version"]).tags
    assert float(tags["test.p_value"]) >= 0.05 and tags["test.prompts"] == "6" and tags["test.metric"] == "gold_reward"
    assert float(tags["test.ci95_low"]) < 0 < float(tags["test.ci95_high"])

    _save_policy(project, "ppo", tokenizer, seed=5, value_head=True)
    _set_scores(project, ppo=[v + 0.1 for v in base])  # wins on every prompt
    strong = registry_task.fn(str(project))
    assert strong["decision"] == "promote" and strong["previous_champion"] == first["version"]
    champion = client.get_model_version_by_alias(NAME, "champion")
    assert champion.version == strong["version"] and "p=0.0001" in champion.tags["reason"]  # 1 / (1 + 10000)
    assert "| paired test (gold_reward, 6 prompts) | gain +0.1000" in champion.description
    run_tags = client.get_run(champion.run_id).data.tags
    assert run_tags["registry.test.p_value"] == champion.tags["test.p_value"]


def test_a_champion_this_evaluation_scored_is_compared_on_its_own_scores(project, monkeypatch):
    """The champion's weights are still among the evaluated policies: no re-scoring, this run's per-prompt scores."""
    from tasks.spec.params import apply_overrides, read_raw

    import yaml

    client = mlflow_client(project)
    first = registry_task.fn(str(project))  # ppo, the only candidate
    raw = apply_overrides(read_raw(project / "params.yaml"), {"registry.candidates": ["ppo", "dpo"]})
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    calls = _rescored_as(monkeypatch, [0.0] * 6)
    champion_scores = [0.1] * 6
    _set_scores(project, ppo=champion_scores, dpo=[0.3] * 6)
    second = registry_task.fn(str(project))
    assert second["policy"] == "dpo" and second["decision"] == "promote" and not calls
    tags = client.get_model_version(NAME, second["version"]).tags
    assert tags["champion.rescored"] == "false" and float(tags["test.gain"]) == pytest.approx(0.2)
    assert tags["champion.version"] == str(first["version"])


def test_champion_scored_on_other_data_is_rescored_before_comparing(project):
    from tasks.run.stage_task import run_stage

    client = mlflow_client(project)
    first = registry_task.fn(str(project))
    old_set = _evaluation(project)["scored"]["evaluation_set"]
    _write_jsonl(project / "data" / "prompts_eval.jsonl", [{"query": q} for q in
                                                           ("Bad", "Good", "The plot", "Music", "Why", "So")])
    run_stage("evaluate", str(project))  # same weights, new evaluation set
    evaluation = _evaluation(project)
    assert evaluation["scored"]["evaluation_set"] != old_set
    second = registry_task.fn(str(project))
    assert second["registered"] and second["version"] != first["version"]
    tags = client.get_model_version(NAME, second["version"]).tags
    # the champion (these same weights, loaded from the registry) scored on the new prompts: exactly evaluate's numbers
    assert tags["champion.rescored"] == "true" and tags["champion.version"] == str(first["version"])
    description = client.get_model_version(NAME, second["version"]).description
    assert "champion v1 (re-scored now on this evaluation set)" in description
    assert f"| **gold_reward** | {evaluation['ppo']['gold_reward']} | {evaluation['ppo']['gold_reward']} |" in description
    assert float(tags["champion.metric.gold_reward"]) == evaluation["ppo"]["gold_reward"]
    assert float(tags["champion.metric.kl"]) == evaluation["ppo"]["kl"]
    assert second["decision"] == "keep" and "gain +0.0000" in second["reason"]
    assert float(tags["test.p_value"]) == 1.0 and float(tags["test.gain"]) == 0.0  # the same samples, prompt by prompt
    assert client.get_model_version_by_alias(NAME, "champion").version == first["version"]
    # the same weights are one MLflow Model, registered under two evaluations
    assert client.get_model_version(NAME, second["version"]).source == client.get_model_version(
        NAME, first["version"]).source


def test_retry_after_a_failed_alias_call_completes_the_promotion(project, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = mlflow_client(project)
    real = MlflowClient.set_registered_model_alias
    failures = []

    def fail_champion_once(self, name, alias, version):
        if alias == "champion" and not failures:
            failures.append(version)
            raise MlflowException("injected: alias call failed")
        return real(self, name, alias, version)

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", fail_champion_once)
    with pytest.raises(MlflowException, match="injected"):
        registry_task.fn(str(project))
    (pending,) = client.search_model_versions(f"name='{NAME}'")
    assert pending.tags["decision"] == "promote" and pending.tags["registry.state"] == "pending"
    with pytest.raises(MlflowException):
        client.get_model_version_by_alias(NAME, "champion")

    retried = registry_task.fn(str(project))  # what Prefect's retry runs
    assert retried["registered"] and retried["decision"] == "promote" and retried["version"] == pending.version
    assert client.get_model_version_by_alias(NAME, "champion").version == pending.version
    assert client.get_model_version_by_alias(NAME, "challenger").version == pending.version
    (done,) = client.search_model_versions(f"name='{NAME}'")  # no second version for the same weights
    assert done.tags["registry.state"] == "complete" and done.tags["decision"] == "promote"
    assert registry_task.fn(str(project))["registered"] is False


def test_a_store_that_vanished_registers_nothing_and_says_which_store(project, caplog):
    """The registry lives in the store: with the local store gone it registers nothing and names the store (it said
    "tracking server unreachable" of a local file before)."""
    import logging

    mlflow_client(project)  # the store exists, and is recorded as the project's
    (project / "mlflow.db").unlink()
    with caplog.at_level(logging.WARNING):
        record = registry_task.fn(str(project))
    assert record == {"registered": False, "reason": "tracking store unavailable"}
    assert "registry: nothing registered: the MLflow store " in caplog.text and "is gone: deleted or moved" in caplog.text
    assert not (project / "mlflow.db").exists()  # not replaced by a new, empty store


def test_registry_without_evaluation_fails_cleanly(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = make_project(tmp_path / "proj", git_dvc=False)
    with pytest.raises(FileNotFoundError, match="run the evaluate stage"):
        registry_task.fn(str(root))


def test_registry_refuses_an_evaluation_without_hashes(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = make_project(tmp_path / "proj", git_dvc=False)
    (root / "metrics").mkdir()
    (root / "metrics" / "evaluate.json").write_text(json.dumps({"sft": m(0.0), "ppo": m(0.3), "dpo": m(0.2)}))
    with pytest.raises(ValueError, match="evaluate.json: no `scored` hashes"):
        registry_task.fn(str(root))


def test_a_record_of_nothing_registered_never_states_an_earlier_decision():
    """Issue 33: a retrain whose weights were already registered recorded "decision: promote" (the earlier run's)
    while nothing was registered. The record and the retrain commit say what happened."""
    from types import SimpleNamespace

    from tasks.registry.gate import _record
    from tasks.run.worktree import outcome

    version = SimpleNamespace(version="3", tags={"policy": "ppo", "decision": "promote", "reason": "won",
                                                 "metric.gold_reward": "0.5"})
    again = _record(RULE, version, False, "already registered for this evaluation")
    assert again["decision"] == "none" and again["earlier_decision"] == "promote" and not again["registered"]
    assert outcome(again) == ("nothing registered: already registered for this evaluation; v3 holds these weights "
                              "(decided promote then)")
    fresh = _record(RULE, version, True)
    assert fresh["decision"] == "promote" and outcome(fresh) == "registered rlhf-policy v3: promote"
    assert outcome({"registered": False, "reason": "tracking store unavailable"}) == (
        "nothing registered: tracking store unavailable")
