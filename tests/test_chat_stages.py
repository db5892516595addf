"""A user's conversational problems through the stages (prompts rendered with the policy's chat template where a
stage samples; SFT's loss on the assistant turn only), and a local model folder as ``sft.model_name``: a tiny
Qwen2 saved to a temp folder with a tokenizer carrying a chat template (built offline, no hub)."""

from __future__ import annotations

import json

import pytest
import yaml

from _local_models import save_local_qwen2
from rlhf_core.models.chat_format import CHATML_TEMPLATE
from tasks.stages.common.chat_prompts import completion_only_rows, render_queries, render_query
from tasks.stages.common.problems import user_datasets
from tasks.spec.task import TaskParams

CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture
def chat_tokenizer(make_tokenizer):
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def test_a_conversation_is_rendered_with_the_generation_prompt_and_text_stays_as_it_is(chat_tokenizer, tokenizer):
    assert render_query(chat_tokenizer, "2 + 3 =") == "2 + 3 ="
    assert render_query(chat_tokenizer, CHAT) == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                                  "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match=r"data/prompts_eval.jsonl: row 2: a conversational prompt, but the policy's "
                                         "tokenizer has no chat template"):
        render_queries(tokenizer, ["text", CHAT], "data/prompts_eval.jsonl")


def test_sft_learns_the_assistant_turn_only(chat_tokenizer):
    row = {"prompt": CHAT, "completion": [{"role": "assistant", "content": "<answer>5</answer>"}]}
    [tokens] = completion_only_rows(chat_tokenizer, [row], 512, "data/sft_train.jsonl")
    prompt_len = len(chat_tokenizer(render_query(chat_tokenizer, CHAT))["input_ids"])
    assert tokens["labels"][:prompt_len] == [-100] * prompt_len  # the system and user turns: no loss
    learned = tokens["labels"][prompt_len:]
    assert learned == tokens["input_ids"][prompt_len:] and learned[-1] == chat_tokenizer.eos_token_id
    assert chat_tokenizer.decode(learned[:-1]) == "<answer>5</answer><|im_end|>\n"
    [cut] = completion_only_rows(chat_tokenizer, [row], 5, "data/sft_train.jsonl")
    assert len(cut["input_ids"]) == len(cut["labels"]) == 5


def task(**values):
    base = dict(name="problems", min_digits=1, max_digits=2, operations="+-", steps=1, answer_format="tag",
                num_train=1, num_eval=1, samples_per_problem=2, pass_k=[1], prompt_field="prompt",
                answer_field="solution", completion_field="completion")
    return TaskParams(**{**base, **values})


def test_a_conversational_file_is_conversational_throughout():
    problems = [{"id": "f:1", "prompt": CHAT, "solution": "5", "completion": None},
                {"id": "f:2", "prompt": "1 + 1 =", "solution": "2", "completion": " <answer>2</answer>"}]
    data = user_datasets(problems, task(), eval_fraction=0.5, seed=0)
    rows = {r["id"]: r for r in data["prompts_train"] + data["prompts_eval"]}
    assert rows["f:1"]["query"] == CHAT and rows["f:2"]["query"] == [{"role": "user", "content": "1 + 1 ="}]
    sft = data["sft_train"] + data["heldout"]
    assert {json.dumps(r["completion"]) for r in sft} == {
        json.dumps([{"role": "assistant", "content": " <answer>5</answer>"}]),  # the answer stated in answer_format
        json.dumps([{"role": "assistant", "content": " <answer>2</answer>"}])}
    plain = user_datasets(problems[1:] * 2, task(), eval_fraction=0.5, seed=0)  # no conversation: text as before
    assert plain["sft_train"] == [{"text": "1 + 1 = <answer>2</answer>"}]


@pytest.fixture
def project(stage_project):
    return stage_project


def use_file(project, lines, **sections):
    (project / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["task"].update(name="problems")
    params["registry"]["metric"] = "pass@1"
    params["dpo"]["enabled"] = params["kto"]["enabled"] = False
    params["prepare"].update(source="chat.jsonl", eval_fraction=0.25)
    for stage in ("ppo", "grpo", "rloo"):
        params[stage]["reward"] = "verifier"
    for section, values in sections.items():
        params[section].update(values)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_conversational_problems_through_prepare_sft_and_label_on_a_local_qwen2(project, tmp_path):
    from tasks.run.stage_task import run_stage

    save_local_qwen2(tmp_path / "my-qwen2")
    lines = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "solution": 2 * i,
              **({"completion": [{"role": "assistant", "content": f"{i} + {i} = {2 * i} #### {2 * i}"}]}
                 if i % 2 else {})} for i in range(8)]
    use_file(project, lines, sft={"model_name": str(tmp_path / "my-qwen2"), "per_device_train_batch_size": 4},
             label={"num_problems": 3, "samples_per_problem": 2, "max_new_tokens": 4, "batch_size": 8},
             task={"samples_per_problem": 2, "pass_k": [1, 2]})
    run_stage("prepare", str(project))
    sft_rows = [json.loads(x) for x in (project / "data" / "sft_train.jsonl").read_text().splitlines()]
    assert len(sft_rows) == 6 and all(set(r) == {"prompt", "completion"} for r in sft_rows)
    metrics = run_stage("sft", str(project))
    assert metrics["num_texts"] == 6 and metrics["steps"] == 2
    saved = (project / "models" / "sft" / "config.json").read_text()
    assert '"model_type": "qwen2"' in saved  # the user's architecture, fine-tuned
    run_stage("label", str(project))
    verdicts = [json.loads(x) for x in (project / "data" / "labelled" / "verdicts.jsonl").read_text().splitlines()]
    assert len(verdicts) == 6
    ratings = [json.loads(x) for x in (project / "data" / "labelled" / "ratings.jsonl").read_text().splitlines()]
    assert ratings and all(r["prompt"].startswith("<|im_start|>user\nWhat is") and
                           r["prompt"].endswith("<|im_start|>assistant\n") for r in ratings)  # the model's template
    assert run_stage("grpo", str(project))["steps"] == 2  # GRPOTrainer renders the conversations itself
    run_stage("evaluate", str(project))
    results = json.loads((project / "metrics" / "evaluate.json").read_text())
    assert set(results) == {"sft", "grpo", "scored"} and 0 <= results["grpo"]["pass@1"] <= 1


def test_a_conversation_without_an_assistant_turn_is_refused_naming_file_row_and_column(project):
    from tasks.run.stage_task import run_stage

    lines = [{"prompt": "1 + 1 =", "solution": 2},
             {"prompt": "2 + 2 =", "solution": 4, "completion": [{"role": "user", "content": "4"}]}]
    use_file(project, lines)
    with pytest.raises(Exception, match=r"chat.jsonl:2: column 'completion': the conversation has no assistant turn"):
        run_stage("prepare", str(project))
    assert not (project / "data" / "prompts_train.jsonl").exists()


def test_a_dataset_source_is_read_by_prepare_and_a_bad_row_named_with_nothing_written(project, tmp_path):
    from tasks.run.stage_task import run_stage

    folder = tmp_path / "my-problems"  # loaded by datasets.load_dataset, as a hub id is where a network is reachable
    folder.mkdir()
    good = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": i + 1} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good))
    lacking = {"prompt": good[0]["prompt"]}  # no solution
    (folder / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in good[:2] + [lacking]))
    use_file(project, [], prepare={"source": f"hub:{folder}", "split": "test"})
    with pytest.raises(Exception, match=rf"prepare.source: hub:{folder}\[test\]:3: column 'solution': None has no"):
        run_stage("prepare", str(project))  # a column a row lacks is None in a dataset
    use_file(project, [], prepare={"source": f"hub:{folder}", "split": "validation"})
    with pytest.raises(Exception, match=rf"prepare.source: hub:{folder}\[validation\]: the dataset cannot be loaded"):
        run_stage("prepare", str(project))
    assert not (project / "data" / "prompts_train.jsonl").exists()
    use_file(project, [], prepare={"source": f"hub:{folder}", "split": "train"})
    assert run_stage("prepare", str(project))["num_prompts_train"] == 6
    rows = [json.loads(x) for x in (project / "data" / "prompts_train.jsonl").read_text().splitlines()]
    assert all(r["id"].startswith("my-problems[train]:") and isinstance(r["query"], list) for r in rows)
