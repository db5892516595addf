"""The registry rule, and the registry step against a temporary MLflow store."""

from __future__ import annotations

import json

import pytest
from _pipeline_project import make_project, mlflow_client

from tasks.params import RegistryParams
from tasks.registry import Decision, decide, pick_challenger, registry_task

RULE = RegistryParams(model_name="rlhf-policy", candidates=["ppo", "dpo"], metric="gold_reward",
                      min_improvement=0.05, max_kl=10.0)


def m(gold, kl=1.0):
    return {"gold_reward": gold, "rm_reward": 0.0, "kl": kl, "perplexity": 3.0, "win_rate": 0.5}


def test_pick_challenger_by_metric():
    assert pick_challenger({"sft": m(0.9), "ppo": m(0.4), "dpo": m(0.6)}, RULE) == "dpo"
    assert pick_challenger({"ppo": m(0.5), "dpo": m(0.5)}, RULE) == "ppo"  # tie: first listed


@pytest.mark.parametrize("challenger, champion, promote, words", [
    (m(0.5), None, True, "no champion yet"),
    (m(0.56), m(0.5), True, "beats champion"),
    (m(0.55), m(0.5), True, "beats champion"),       # exactly min_improvement
    (m(0.54), m(0.5), False, "< min_improvement"),
    (m(0.2), m(0.5), False, "< min_improvement"),
    (m(0.9, kl=11.0), m(0.5), False, "exceeds registry.max_kl"),
    (m(0.9, kl=11.0), None, False, "exceeds registry.max_kl"),
])
def test_decide(challenger, champion, promote, words):
    decision = decide(challenger, champion, RULE)
    assert isinstance(decision, Decision) and decision.promote is promote
    assert words in decision.reason


def _evaluation(root, ppo_gold, dpo_gold):
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / "evaluate.json").write_text(json.dumps({"sft": m(0.0), "ppo": m(ppo_gold), "dpo": m(dpo_gold)}))


def test_registry_step_moves_champion_only_when_challenger_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = make_project(tmp_path / "proj", {"registry.min_improvement": 0.05}, git_dvc=False)
    for policy in ("ppo", "dpo"):
        (root / "models" / policy).mkdir(parents=True)
        (root / "models" / policy / "config.json").write_text(json.dumps({"policy": policy}))
    client = mlflow_client(root)

    _evaluation(root, 0.30, 0.40)
    first = registry_task.fn(str(root))
    assert first["registered"] and first["policy"] == "dpo" and first["decision"] == "promote"
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == first["version"]

    again = registry_task.fn(str(root))  # same evaluation: nothing new
    assert again["registered"] is False
    assert len(client.search_model_versions("name='rlhf-policy'")) == 1

    _evaluation(root, 0.42, 0.10)  # better, but by less than min_improvement
    weak = registry_task.fn(str(root))
    assert weak["registered"] and weak["decision"] == "keep" and "< min_improvement" in weak["reason"]
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == first["version"]
    assert client.get_model_version_by_alias("rlhf-policy", "challenger").version == weak["version"]

    _evaluation(root, 0.60, 0.10)  # wins
    strong = registry_task.fn(str(root))
    assert strong["decision"] == "promote" and strong["previous_champion"] == first["version"]
    champion = client.get_model_version_by_alias("rlhf-policy", "champion")
    assert champion.version == strong["version"]
    assert champion.tags["policy"] == "ppo" and float(champion.tags["metric.gold_reward"]) == 0.60
    assert "beats champion" in champion.tags["reason"]
    files = {a.path for a in mlflow_client(root).list_artifacts(champion.run_id, "policy")}
    assert "policy/config.json" in files


def test_registry_without_evaluation_fails_cleanly(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    root = make_project(tmp_path / "proj", git_dvc=False)
    with pytest.raises(FileNotFoundError, match="run the evaluate stage"):
        registry_task.fn(str(root))
