"""Sample windows along training (tasks/stages/common/samples.py) and the reward-KL frontier evaluate assembles (tasks/evaluate.py)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from rlhf_core.tracking import MemoryTracker
from tasks.stages.common.scoring import FRONTIER_COLUMNS, frontier_rows
from tasks.stages.common.samples import WindowLog, WindowScorer, is_window_step, step_hook, window_callback

PROMPTS = ["the movie was", "i think", "a truly", "what a"]


def test_window_steps_every_n_and_the_last():
    assert [s for s in range(0, 8) if is_window_step(s, 3, 7)] == [3, 6, 7]
    assert [s for s in range(0, 8) if is_window_step(s, 10, 7)] == [7]  # fewer steps than one window: the last only
    assert [s for s in range(0, 8) if is_window_step(s, 0, 7)] == []  # 0: off


def test_frontier_rows_sft_then_checkpoints_in_step_order_then_final():
    final = {"sft": {"gold_reward": 0.1, "kl": 0.0}, "ppo": {"gold_reward": 0.7, "kl": 3.4},
             "grpo": {"gold_reward": 0.6, "kl": 2.0}}
    windows = {"ppo": [{"step": "10", "kl": "1.5", "gold_reward": "0.5"}, {"step": "5", "kl": "0.5", "gold_reward": "0.3"}]}
    assert frontier_rows(final, windows) == [
        {"policy": "sft", "step": 0, "kl": 0.0, "gold_reward": 0.1, "kind": "reference"},
        {"policy": "ppo", "step": 5, "kl": 0.5, "gold_reward": 0.3, "kind": "checkpoint"},
        {"policy": "ppo", "step": 10, "kl": 1.5, "gold_reward": 0.5, "kind": "checkpoint"},
        {"policy": "ppo", "step": 10, "kl": 3.4, "gold_reward": 0.7, "kind": "final"},
        {"policy": "grpo", "step": "", "kl": 2.0, "gold_reward": 0.6, "kind": "final"},  # no windows: final only
    ]


def _judge(texts):
    """A deterministic stand-in for the gold judge: word count / 10."""
    return [len(t.split()) / 10 for t in texts]


def _naive_sequence_logprob(model, query: torch.Tensor, response: torch.Tensor) -> float:
    """sum_t log p(response_t | query, response_<t), one unpadded sequence at a time, in float64."""
    ids = torch.cat([query, response])[None]  # (1, T)
    logits = model(input_ids=ids).logits[0].double()  # (T, V)
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(query) + i - 1, int(tok)]) for i, tok in enumerate(response))


@pytest.fixture(scope="module")
def models(make_tokenizer):
    tokenizer = make_tokenizer()
    from rlhf_core.models.tiny import tiny_causal_lm

    reference = tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=0).eval()
    policy = tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, seed=1)
    return policy, reference


def test_window_scorer_measures_what_evaluate_reports(tokenizer, models):
    """Gold reward and KL of the window's samples: the same numbers ``evaluate_policy`` gives on the same prompts,
    and the KL equals a naive float64 per-sequence loop."""
    from rlhf_core.evaluation import evaluate_policy, sample_responses

    policy, reference = models
    judge = lambda samples: _judge(samples.texts)  # noqa: E731 - the scorer's judge takes the samples
    scorer = WindowScorer(PROMPTS, reference, tokenizer, judge, max_new_tokens=6, seed=3)
    policy.train()
    responses, gold, point = scorer(policy)
    assert policy.training  # restored after sampling in eval mode
    metrics, samples, eval_gold = evaluate_policy(policy, reference, tokenizer, PROMPTS, ["some held out text"],
                                                  _judge, _judge, max_new_tokens=6, batch_size=64, seed=3)
    assert responses == samples.responses and gold == eval_gold.gold
    assert point["gold_reward"] == pytest.approx(metrics["gold_reward"])
    assert point["kl"] == pytest.approx(metrics["kl"], abs=1e-6)
    again = sample_responses(policy, tokenizer, PROMPTS, 6, seed=3)
    with torch.no_grad():
        naive = [_naive_sequence_logprob(policy, q, r) - _naive_sequence_logprob(reference, q, r)
                 for q, r in zip(again.query_ids, again.response_ids)]
    assert point["kl"] == pytest.approx(sum(naive) / len(naive), abs=1e-4)
    assert scorer(reference)[2]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference itself: no divergence


def test_a_verifiable_tasks_windows_score_with_its_verifier():
    """Under a verifiable task the window's gold judge is the verifier of each problem's solution (1 when the answer
    is right, 0 when wrong or absent); under sentiment it is the gold judge of prompt + response."""
    from tasks.stages.common.samples import gold_judge

    rows = [{"query": "Q: 1 + 2 = ?", "solution": "3"}, {"query": "Q: 5 - 1 = ?", "solution": "4"},
            {"query": "Q: 2 + 2 = ?", "solution": "4"}]
    samples = SimpleNamespace(responses=["<answer>3</answer>", "<answer>5</answer>", "four"],
                              texts=["Q: 1 + 2 = ?<answer>3</answer>", "", ""])
    assert gold_judge("arithmetic", rows, "data/prompts_eval.jsonl")(samples) == [1.0, 0.0, 0.0]
    sentiment = gold_judge("sentiment", rows, "data/prompts_eval.jsonl")(SimpleNamespace(texts=["a wonderful film"]))
    assert len(sentiment) == 1 and sentiment[0] > 0.3
    with pytest.raises(ValueError, match="data/prompts_eval.jsonl"):  # a problem without its solution: named
        gold_judge("arithmetic", [{"query": "Q: 1 + 1 = ?"}], "data/prompts_eval.jsonl")


class _FixedScorer:
    """A scorer whose KL is the number of calls so far (shows which call produced which point)."""

    prompts = ["p1", "p2"]

    def __init__(self):
        self.calls = 0

    def __call__(self, policy):
        self.calls += 1
        return ["r1", "r2"], [0.5, -0.25], {"kl": float(self.calls), "gold_reward": 0.125}


def test_window_log_logs_a_table_per_window_and_keeps_points_across_a_resume(tmp_path):
    tracker = MemoryTracker()
    state = tmp_path / "ck" / "sample_windows.json"
    log = WindowLog("dpo", _FixedScorer(), tracker, state, table="game_log")
    for step in (4, 2):
        log.score(None, step)
    assert tracker.tables == [("game_log", ["query", "response", "reward"], [["p1", "r1", 0.5], ["p2", "r2", -0.25]], 4),
                              ("game_log", ["query", "response", "reward"], [["p1", "r1", 0.5], ["p2", "r2", -0.25]], 2)]
    assert (4, {"samples/gold_reward": 0.125, "samples/kl": 1.0}) in tracker.metrics
    assert json.loads(state.read_text()) == [{"step": 2, "kl": 2.0, "gold_reward": 0.125},
                                             {"step": 4, "kl": 1.0, "gold_reward": 0.125}]
    resumed = WindowLog("dpo", _FixedScorer(), MemoryTracker(), state, table="game_log")
    resumed.resume(3)  # continues from step 3: the point after it will be scored again
    assert resumed.points == [{"step": 2, "kl": 2.0, "gold_reward": 0.125}]
    from tasks.spec.params import PathsParams
    from tasks.spec.stage import StageResult
    from tasks.run.stage_task import write_result
    from tasks.stages import BY_NAME

    paths = PathsParams("data", "models", "metrics", "plots", "incoming", allow_outside=False)
    write_result(BY_NAME["dpo"], tmp_path, BY_NAME["dpo"].io(paths), StageResult({}, [], windows=resumed.points))
    assert (tmp_path / "plots" / "dpo_windows.csv").read_text() == "step,kl,gold_reward\n2,2.0,0.125\n"


def test_trainer_callback_and_ppo_hook_score_at_the_window_steps(tmp_path):
    scorer = _FixedScorer()
    log = WindowLog("kto", scorer, MemoryTracker(), tmp_path / "w.json", table="game_log")
    callback = window_callback(log, every=2)
    state = SimpleNamespace(global_step=0, max_steps=5)
    callback.on_train_begin(None, state, None)
    wrapped = SimpleNamespace(module=torch.nn.Linear(1, 1))  # a DDP-like wrapper: the module is scored
    for step in range(1, 6):
        state.global_step = step
        callback.on_step_end(None, state, None, model=wrapped)
    assert [p["step"] for p in log.points] == [2, 4, 5]

    seen = []
    ppo_log = WindowLog("ppo", _FixedScorer(), MemoryTracker(), tmp_path / "p.json", table="heldout_samples")
    hook = step_hook(ppo_log, lambda: "policy", every=2, total_steps=3, on_step=seen.append)
    for step in range(3):  # run_ppo's 0-based steps
        hook({"step": step})
    assert [r["step"] for r in seen] == [0, 1, 2] and [p["step"] for p in ppo_log.points] == [2, 3]

    idle = WindowLog("ppo", None, MemoryTracker(), tmp_path / "i.json", table="t")  # sample_every 0 / other ranks
    step_hook(idle, lambda: "policy", every=1, total_steps=2, on_step=seen.append)({"step": 0})
    assert idle.points == [] and not (tmp_path / "i.json").exists()


def test_stages_write_windows_and_evaluate_draws_the_frontier(tmp_path, monkeypatch):
    """dpo and ppo score held-out samples every sample_every steps (tables under PPO's naming scheme); a disabled
    kto writes a header-only windows file; evaluate joins them with its final scores into plots/frontier.csv and
    logs the PNG."""
    import mlflow
    from _pipeline_project import make_project, write_params

    from tasks.run.stage_task import run_stage
    from tasks.store.mlflow_runs import mlflow_setup

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    project = make_project(tmp_path / "proj", git_dvc=False)
    write_params(project, {"grpo.enabled": False, "rloo.enabled": False, "kto.enabled": False,
                           "dpo.sample_every": 3, "dpo.sample_prompts": 4, "ppo.sample_every": 1,
                           "ppo.sample_prompts": 4})
    for stage in ("prepare", "sft", "reward_model", "ppo", "dpo", "kto"):
        run_stage(stage, str(project))
    steps = json.loads((project / "metrics" / "dpo.json").read_text())["steps"]
    dpo_windows = list(csv.DictReader((project / "plots" / "dpo_windows.csv").open()))
    assert [int(r["step"]) for r in dpo_windows] == [s for s in range(1, steps + 1) if s % 3 == 0 or s == steps]
    ppo_windows = list(csv.DictReader((project / "plots" / "ppo_windows.csv").open()))
    assert [int(r["step"]) for r in ppo_windows] == [1, 2]  # ppo.total_steps 2 in the tiny profile
    assert (project / "plots" / "kto_windows.csv").read_text() == "step,kl,gold_reward\n"
    assert not list((project / ".checkpoints").glob("*.samples.json"))  # the resumable copy is removed

    results = run_stage("evaluate", str(project))
    frontier = list(csv.DictReader((project / "plots" / "frontier.csv").open()))
    assert list(frontier[0]) == list(FRONTIER_COLUMNS)
    assert [(r["policy"], r["kind"]) for r in frontier] == [
        ("sft", "reference"), *[("ppo", "checkpoint")] * 2, ("ppo", "final"),
        *[("dpo", "checkpoint")] * len(dpo_windows), ("dpo", "final")]
    final = {r["policy"]: r for r in frontier if r["kind"] == "final"}
    for name in ("ppo", "dpo"):
        assert float(final[name]["kl"]) == results[name]["kl"]
        assert float(final[name]["gold_reward"]) == results[name]["gold_reward"]
    assert [float(r["kl"]) for r in frontier if r["policy"] == "dpo" and r["kind"] == "checkpoint"] == \
        [float(r["kl"]) for r in dpo_windows]

    client = mlflow.MlflowClient()
    experiment = mlflow_setup(project)
    (dpo_run,) = client.search_runs([experiment], "tags.`rlhf.stage` = 'dpo'")
    tables = sorted(a.path for a in client.list_artifacts(dpo_run.info.run_id, "tables"))
    assert tables == [f"tables/game_log_step{int(r['step']):06d}.json" for r in dpo_windows]
    (ppo_run,) = client.search_runs([experiment], "tags.`rlhf.stage` = 'ppo'")
    ppo_tables = [a.path for a in client.list_artifacts(ppo_run.info.run_id, "tables")]
    assert {"tables/heldout_samples_step000001.json", "tables/heldout_samples_step000002.json"} <= set(ppo_tables)
    (eval_run,) = client.search_runs([experiment], "tags.`rlhf.stage` = 'evaluate'")
    assert "plots/frontier.png" in [a.path for a in client.list_artifacts(eval_run.info.run_id, "plots")]
