"""The ``label`` stage: verifier-labelled samples of the SFT policy as DPO pairs and KTO ratings on a verifiable
task (the pairing rule exactly, on small cases), placeholders under sentiment, and dpo/kto training on its output."""

from __future__ import annotations

import json

import pytest
import yaml

from tasks.stages.common.verified_pairs import preference_pairs, ratings, split_by_verdict
from tasks.stages.label import label_rows, summary_metrics


def pairs_of(completions, verdicts, max_pairs=10):
    return [(p["chosen"], p["rejected"]) for p in
            preference_pairs("Q", split_by_verdict(completions, verdicts), max_pairs)]


def test_the_kth_correct_pairs_with_the_kth_incorrect_the_shorter_list_cycled():
    # correct: a, c; incorrect: b, d, e (sample order) -> 3 pairs, the correct list cycled
    assert pairs_of(["a", "b", "c", "d", "e"], [True, False, True, False, False]) == [("a", "b"), ("c", "d"),
                                                                                       ("a", "e")]
    assert pairs_of(["a", "b", "c"], [False, True, True]) == [("b", "a"), ("c", "a")]
    assert pairs_of(["a", "b", "c", "d", "e"], [True, False, True, False, False], max_pairs=2) == [("a", "b"),
                                                                                                   ("c", "d")]


def test_no_correct_or_no_incorrect_sample_gives_no_pair_but_still_ratings():
    for verdicts in ([True, True], [False, False], [None, None]):
        labelled = split_by_verdict(["a", "b"], verdicts)
        assert preference_pairs("Q", labelled, 4) == [] and not labelled.has_both
    assert [r["label"] for r in ratings("Q", split_by_verdict(["a", "b"], [True, True]))] == [True, True]
    assert ratings("Q", split_by_verdict(["a", "b"], [None, None])) == []  # not applicable labels nothing


def test_a_completion_sampled_twice_is_one_completion():
    # the tie: "a" twice (correct both times) is one chosen text; "b" twice one rejected text: one pair, two ratings
    assert pairs_of(["a", "b", "a", "b"], [True, False, True, False]) == [("a", "b")]
    labelled = split_by_verdict(["a", "b", "a", "b"], [True, False, True, False])
    assert ratings("Q", labelled, problem_id="7") == [
        {"prompt": "Q", "completion": "a", "label": True, "problem_id": "7"},
        {"prompt": "Q", "completion": "b", "label": False, "problem_id": "7"}]
    with pytest.raises(ValueError, match="2 completions but 1 verdicts"):
        split_by_verdict(["a", "b"], [True])
    with pytest.raises(ValueError, match="max_pairs must be >= 1"):
        preference_pairs("Q", labelled, 0)


def test_label_rows_verify_each_sample_against_its_problems_solution():
    rows = [{"id": "p1", "query": "1 + 1 ="}, {"id": "p2", "query": "2 + 2 ="}, {"id": "p3", "query": "3 + 3 ="}]
    completions = [[" <answer>2</answer>", " <answer>3</answer>", " no answer"],  # correct, wrong, unformatted
                   [" <answer>4</answer>", " <answer>4</answer>", " #### 4"],     # all correct
                   [" <answer>5</answer>", " 7", " <answer>1</answer>"]]           # none correct
    files, counts = label_rows(rows, ["2", "4", "6"], completions, max_pairs=4)
    assert counts == [1, 3, 0]
    assert [(p["problem_id"], p["chosen"], p["rejected"]) for p in files["preferences.jsonl"]] == [
        ("p1", " <answer>2</answer>", " <answer>3</answer>"), ("p1", " <answer>2</answer>", " no answer")]
    assert [(r["problem_id"], r["label"]) for r in files["ratings.jsonl"]] == [
        ("p1", True), ("p1", False), ("p1", False), ("p2", True), ("p2", True),
        ("p3", False), ("p3", False), ("p3", False)]  # p2's two equal texts are one rating
    assert [v["answer"] for v in files["verdicts.jsonl"][:3]] == ["2", "3", None]
    assert summary_metrics(files, counts, 3) == {
        "problems": 3, "samples": 9, "correct_rate": round(4 / 9, 6), "problems_with_both": 1,
        "problems_all_correct": 1, "problems_none_correct": 1, "pairs": 2, "ratings": 8, "desirable": 3}


@pytest.fixture
def project(stage_project):
    return stage_project


def set_params(project, **sections):
    params = yaml.safe_load((project / "params.yaml").read_text())
    for section, values in sections.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def save_tiny_sft(project):
    """A tiny random causal LM and the project's tiny tokenizer as ``models/sft`` (no SFT run: fast)."""
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    tokenizer = build_tokenizer(vocab_size=300)
    model = tiny_causal_lm(tokenizer, hidden_size=16, num_layers=1, num_heads=2, max_positions=96)
    model.save_pretrained(project / "models" / "sft")
    tokenizer.save_pretrained(project / "models" / "sft")


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_label_writes_placeholders_under_sentiment_and_dpo_keeps_prepares_pairs(project):
    from tasks.run.stage_task import run_stage
    from tasks.stages.common.labelled_data import preference_file
    from tasks.store.placeholders import is_placeholder

    assert run_stage("label", str(project)) == {"enabled": False}
    assert is_placeholder(project / "data" / "labelled")
    assert (project / "plots" / "label.csv").read_text() == "correct_samples,problems\n"

    class Ctx:  # what preference_file reads of a StageContext
        io = type("IO", (), {"deps": {"preferences": "data/preferences.jsonl", "labelled": "data/labelled"}})()

        def dep(self, name):
            return project / self.io.deps[name]

    assert preference_file(Ctx(), "preferences", "preferences.jsonl") == (project / "data" / "preferences.jsonl",
                                                                           "data/preferences.jsonl")


def test_label_samples_the_sft_policy_and_verifies_every_sample(project):
    from tasks.run.stage_task import run_stage

    set_params(project, task={"name": "arithmetic", "num_train": 12, "num_eval": 4},
               ppo={"reward": "verifier"}, grpo={"reward": "verifier"}, rloo={"reward": "verifier"},
               registry={"metric": "pass@1"},
               label={"num_problems": 5, "samples_per_problem": 3, "max_new_tokens": 6, "batch_size": 8})
    run_stage("prepare", str(project))
    save_tiny_sft(project)
    metrics = run_stage("label", str(project))
    verdicts = read(project / "data" / "labelled" / "verdicts.jsonl")
    problems = read(project / "data" / "prompts_train.jsonl")[:5]
    assert (metrics["problems"], metrics["samples"], len(verdicts)) == (5, 15, 15)
    assert [v["problem_id"] for v in verdicts] == [p["id"] for p in problems for _ in range(3)]
    assert metrics["pairs"] == len(read(project / "data" / "labelled" / "preferences.jsonl"))
    assert metrics["ratings"] == len(read(project / "data" / "labelled" / "ratings.jsonl"))
    curve = (project / "plots" / "label.csv").read_text().splitlines()
    assert curve[0] == "correct_samples,problems" and sum(int(line.split(",")[1]) for line in curve[1:]) == 5
    first = (project / "data" / "labelled" / "verdicts.jsonl").read_bytes()
    run_stage("label", str(project))
    assert (project / "data" / "labelled" / "verdicts.jsonl").read_bytes() == first  # seeded: the same samples


def test_dpo_and_kto_train_on_the_labelled_samples(project, monkeypatch):
    """The sampler replaced by one whose verdicts are known (sample 0 states the solution, the others a wrong
    number): every problem gives pairs, and dpo and kto train on label's files rather than prepare's (empty) ones."""
    from rlhf_core.evaluation import Samples
    from tasks.run.stage_task import run_stage
    from tasks.stages import label

    set_params(project, task={"name": "arithmetic", "num_train": 8, "num_eval": 4},
               ppo={"reward": "verifier"}, grpo={"reward": "verifier"}, rloo={"reward": "verifier"},
               registry={"metric": "pass@1"},
               label={"num_problems": 8, "samples_per_problem": 3, "max_pairs_per_problem": 2},
               dpo={"enabled": True, "sample_every": 0, "per_device_train_batch_size": 8, "max_length": 48},
               kto={"enabled": True, "sample_every": 0, "per_device_train_batch_size": 8, "max_length": 48})
    run_stage("prepare", str(project))
    save_tiny_sft(project)
    problems = read(project / "data" / "prompts_train.jsonl")
    solution = {p["query"]: p["solution"] for p in problems}

    def known_samples(policy, tokenizer, prompts, *args):
        responses = [f" <answer>{solution[q]}</answer>" if i % 3 == 0 else f" <answer>{1000 + i}</answer>"
                     for i, q in enumerate(prompts)]
        return Samples(list(prompts), [], [], responses)

    monkeypatch.setattr(label, "sample_responses", known_samples)
    metrics = run_stage("label", str(project))
    assert (metrics["pairs"], metrics["problems_with_both"], metrics["ratings"], metrics["desirable"]) == (16, 8, 24, 8)
    pairs = read(project / "data" / "labelled" / "preferences.jsonl")
    assert pairs[0] == {"prompt": problems[0]["query"], "chosen": f" <answer>{problems[0]['solution']}</answer>",
                        "rejected": " <answer>1001</answer>", "problem_id": problems[0]["id"]}
    dpo = run_stage("dpo", str(project))
    assert dpo["num_pairs"] == 16 and dpo["steps"] == 2
    kto = run_stage("kto", str(project))
    assert (kto["num_ratings"], kto["num_desirable"]) == (24, 8)
