"""``prepare`` for the arithmetic task (``task.name: arithmetic``): generated problems in the six datasets, no
held-out problem trained on, the same files from the same params; the sentiment task's prepare is untouched."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf_core.rewards import accuracy_reward
from tasks.spec.param_rules import ParamsError


@pytest.fixture
def project(stage_project):
    return stage_project


def set_task(project, **task):
    """The task's keys, and what a verifiable task needs of the other sections (tasks.spec.task.task_problems)."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["task"].update(task)
    if params["task"]["name"] != "sentiment":
        params["registry"]["metric"] = "pass@1"  # the gate's metric of a verifiable task
    for stage in ("ppo", "grpo", "rloo"):
        params[stage]["reward"] = "verifier"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def rows(project, name):
    return [json.loads(line) for line in (project / "data" / f"{name}.jsonl").read_text().splitlines()]


def test_prepare_writes_the_arithmetic_task_from_params(project):
    from tasks.run.stage_task import run_stage

    set_task(project, name="arithmetic", num_train=60, num_eval=20, operations="+-*", steps=2, answer_format="hashes")
    metrics = run_stage("prepare", str(project))
    assert (metrics["task"], metrics["num_train"], metrics["num_prompts_eval"]) == ("arithmetic", 60, 20)
    train, held_out = rows(project, "prompts_train"), rows(project, "prompts_eval")
    assert len(train) == 60 and len(held_out) == 20 and set(train[0]) == {"id", "query", "solution"}
    assert not {r["query"] for r in train} & {r["query"] for r in held_out}  # nothing held out is trained on
    sft = [r["text"] for r in rows(project, "sft_train")]
    assert all(t.startswith(r["query"]) and "####" in t for t, r in zip(sft, train))
    # the worked solutions are what the verifier calls correct
    completions = [t[len(r["query"]):] for t, r in zip(sft, train)]
    assert accuracy_reward(completions, [r["solution"] for r in train]) == [1.0] * 60
    assert rows(project, "preferences") == [] and rows(project, "ratings") == []
    first = (project / "data" / "prompts_eval.jsonl").read_bytes()
    run_stage("prepare", str(project))
    assert (project / "data" / "prompts_eval.jsonl").read_bytes() == first  # seeded: the same bytes again
    plot = (project / "plots" / "prepare.csv").read_text().splitlines()
    assert plot[0] == "gold_bin,count" and sum(int(line.split(",")[1]) for line in plot[1:]) == 60
    # no reward model for a verifiable task: its stage writes placeholders, as a disabled stage does
    from tasks.store.placeholders import is_placeholder

    assert run_stage("reward_model", str(project)) == {"enabled": False}
    assert is_placeholder(project / "models" / "reward_model")


def test_a_bad_task_is_refused_naming_the_key(project):
    from tasks.stages import load_params

    for bad, match in ((dict(name="chess"), "task.name"), (dict(operations="+/"), "task.operations"),
                       (dict(min_digits=3, max_digits=2), "min_digits"), (dict(steps=0), "task.steps")):
        set_task(project, name="arithmetic", min_digits=1, max_digits=2, operations="+-", steps=1)
        set_task(project, **bad)
        with pytest.raises(ParamsError, match=match):
            load_params(project / "params.yaml")
    set_task(project, name="arithmetic", min_digits=1, max_digits=2, operations="+-", steps=1)
    load_params(project / "params.yaml")  # valid again
    params = yaml.safe_load((project / "params.yaml").read_text())
    for stage in ("dpo", "kto"):  # they train on the label stage's verifier-labelled samples of SFT
        (project / "params.yaml").write_text(yaml.safe_dump({**params, stage: {**params[stage], "enabled": True}},
                                                            sort_keys=False))
        assert load_params(project / "params.yaml").section(stage).enabled
    broken = {**params, "grpo": {**params["grpo"], "reward": "gold"}}
    (project / "params.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))
    with pytest.raises(ParamsError, match="grpo.reward must be verifier"):
        load_params(project / "params.yaml")


def test_prepare_reads_a_users_problems_file(project):
    from tasks.run.stage_task import run_stage

    lines = [{"question": f"{i} + {i} =", "answer": str(2 * i), **({"worked": f" {i} + {i} = {2 * i} #### {2 * i}"}
                                                                   if i % 2 else {})} for i in range(20)]
    (project / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    set_task(project, name="problems", prompt_field="question", answer_field="answer", completion_field="worked",
             answer_format="tag")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["prepare"].update(source="mine.jsonl", eval_fraction=0.25)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    metrics = run_stage("prepare", str(project))
    assert (metrics["num_train"], metrics["num_prompts_eval"]) == (15, 5)
    train = rows(project, "prompts_train")
    assert {r["id"] for r in train + rows(project, "prompts_eval")} == {f"mine.jsonl:{i}" for i in range(1, 21)}
    texts = [r["text"] for r in rows(project, "sft_train")]
    completions = [t[len(r["query"]):] for t, r in zip(texts, train)]
    assert accuracy_reward(completions, [r["solution"] for r in train]) == [1.0] * 15  # worked or stated answers
    assert any("<answer>" in c for c in completions) and any("####" in c for c in completions)


def test_a_bad_users_file_is_refused_naming_file_row_and_column_and_nothing_is_written(project):
    from tasks.run.stage_task import run_stage

    (project / "mine.jsonl").write_text('{"prompt": "1 + 1 =", "solution": "2"}\n{"prompt": "2 + 2 ="}\n')
    set_task(project, name="problems")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["prepare"]["source"] = "mine.jsonl"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(Exception, match=r"prepare.source: .*mine.jsonl:2: no column 'solution'"):
        run_stage("prepare", str(project))
    assert not (project / "data" / "prompts_train.jsonl").exists()
