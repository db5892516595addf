"""A user's own preference pairs (``prepare.source: pairs:<file>``; JSONL, CSV or Parquet of prompt/chosen/rejected,
plain or conversational) as the reward model's and DPO's data: read, checked, refused naming file, row and column
with nothing written, and split into the six datasets."""

from __future__ import annotations

import json

import pytest
import yaml

from rlhf_core.data import DataFormatError
from rlhf_core.models.chat_format import CHATML_TEMPLATE
from rlhf_core.user_pairs import read_pairs
from tasks.stages.common.pair_source import as_text, chat_renderer, pair_datasets, plain_render, sft_row

USER = [{"role": "user", "content": "Rate the film."}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plain_csv_and_conversational_pairs_are_read(tmp_path):
    (tmp_path / "p.csv").write_text('prompt,chosen,rejected\nThe film was," great."," dull."\n')
    assert read_pairs(tmp_path / "p.csv") == [{"id": "p.csv:2", "prompt": "The film was", "chosen": " great.",
                                               "rejected": " dull."}]
    chat = {"prompt": USER, "chosen": [{"role": "assistant", "content": "Great."}],
            "rejected": [{"role": "assistant", "content": "Dull."}]}
    assert read_pairs(write_jsonl(tmp_path / "c.jsonl", [chat]))[0]["chosen"] == chat["chosen"]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "x", "chosen": "a"}, r"bad.jsonl:2: no column 'rejected'; a preference pair has"),
    ({"prompt": "x", "chosen": "  ", "rejected": "b"}, r"bad.jsonl:2: column 'chosen': the answer is empty"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, r"bad.jsonl:2: column 'prompt': the prompt is empty"),
    ({"prompt": "x", "chosen": "a", "rejected": "a"}, r"bad.jsonl:2: columns 'chosen' and 'rejected': the same answer"),
    ({"prompt": USER, "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     r"bad.jsonl:2: column 'chosen': the conversation has no assistant turn"),
    ({"prompt": [{"role": "assistant", "content": "a"}], "chosen": "a", "rejected": "b"},
     r"bad.jsonl:2: column 'prompt': a prompt conversation must end with a user turn"),
    ({"prompt": "x", "chosen": None, "rejected": "b"}, r"bad.jsonl:2: column 'chosen': no answer \(null\)"),
])
def test_a_bad_row_is_refused_naming_file_row_and_column(tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(DataFormatError, match=message):
        read_pairs(path)


def test_a_conversational_pair_is_written_as_the_plain_templates_text():
    pair = {"prompt": USER, "chosen": [{"role": "assistant", "content": "Great."}], "rejected": "Dull."}
    assert as_text(pair) == {"prompt": "User: Rate the film.\n\nAssistant:", "chosen": " Great.", "rejected": " Dull."}
    assert as_text({"prompt": "a", "chosen": "b", "rejected": "c", "id": "f:1"}) == {"prompt": "a", "chosen": "b",
                                                                                      "rejected": "c"}


def test_a_conversational_pair_is_rendered_with_the_chat_template_of_a_local_sft_model(tmp_path, make_tokenizer):
    from _local_models import save_local_qwen2
    from tasks.stages.common.chat_prompts import completion_only_rows

    save_local_qwen2(tmp_path / "my-qwen2")
    pair = {"prompt": USER, "chosen": [{"role": "assistant", "content": "Great."}], "rejected": "Dull."}
    render = chat_renderer(str(tmp_path / "my-qwen2"), [pair])
    assert as_text(pair, render) == {"prompt": "<|im_start|>user\nRate the film.<|im_end|>\n<|im_start|>assistant\n",
                                     "chosen": "Great.<|im_end|>", "rejected": "Dull.<|im_end|>"}
    # no model named, or no conversation: the plain template, nothing loaded; a model without a template: plain too
    assert chat_renderer("", [pair]) is plain_render
    assert chat_renderer(str(tmp_path / "missing"), [{"prompt": "a", "chosen": "b", "rejected": "c"}]) is plain_render
    make_tokenizer().save_pretrained(tmp_path / "no-template")
    assert chat_renderer(str(tmp_path / "no-template"), [pair]) is plain_render
    with pytest.raises(ValueError, match=r"sft.model_name: '.*missing': its tokenizer, whose chat template renders"):
        chat_renderer(str(tmp_path / "missing"), [pair])
    # SFT's row of the pair: its loss on the assistant's turn only, rendered by the same template
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "my-qwen2")
    [tokens] = completion_only_rows(tokenizer, [sft_row(pair)], 512, "data/sft_train.jsonl")
    learned = [t for t in tokens["labels"] if t != -100]
    assert tokenizer.decode(learned[:-1]) == "Great.<|im_end|>\n" and learned[-1] == tokenizer.eos_token_id


def test_the_pairs_split_by_prompt_into_the_six_datasets():
    pairs = [{"prompt": f"p{i % 4}", "chosen": f" good{i}", "rejected": f" bad{i % 2}"} for i in range(8)]
    data = pair_datasets(pairs, eval_fraction=0.25, seed=0)
    train_prompts = [r["query"] for r in data["prompts_train"]]
    [held] = [r["query"] for r in data["prompts_eval"]]  # one of the four distinct prompts is held out
    assert sorted(train_prompts + [held]) == ["p0", "p1", "p2", "p3"]
    assert [r["prompt"] for r in data["preferences"]] == [p["prompt"] for p in pairs if p["prompt"] != held]
    assert data["sft_train"] == [{"text": r["prompt"] + r["chosen"]} for r in data["preferences"]]
    assert data["heldout"] == [{"text": held + p["chosen"]} for p in pairs if p["prompt"] == held]
    # ratings: every distinct answer of a training prompt once (p0's " bad0" is the rejected answer of two pairs)
    ratings = {(r["prompt"], r["completion"]): r["label"] for r in data["ratings"]}
    assert len(ratings) == len(data["ratings"]) == 6 * 2 - 3 * 1  # 6 pairs, 3 repeated rejected answers
    assert all(ratings[(r["prompt"], r["chosen"])] and not ratings[(r["prompt"], r["rejected"])]
               for r in data["preferences"])
    with pytest.raises(ValueError, match="1 distinct prompts leave none to train on"):
        pair_datasets(pairs[:1], eval_fraction=0.25, seed=0)
    # a file with a conversation: SFT's rows keep the messages (a text prompt a user turn, a text answer the
    # assistant's), the other datasets are text
    source = pairs[:7] + [{"prompt": USER, "chosen": "Great.", "rejected": "Dull."}]
    chat = pair_datasets(source, 0.25, seed=0)
    held = {r["query"] for r in chat["prompts_eval"]}
    assert chat["sft_train"] == [sft_row(p) for p in source if as_text(p)["prompt"] not in held]
    assert sft_row(pairs[0]) == {"prompt": [{"role": "user", "content": "p0"}],
                                 "completion": [{"role": "assistant", "content": " good0"}]}
    assert len(chat["sft_train"]) == len(chat["preferences"]) and all("text" in r for r in chat["heldout"])


@pytest.fixture
def project(stage_project):
    return stage_project


def set_source(project, source):
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["prepare"].update(source=source, eval_fraction=0.25)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_prepare_reads_a_users_pairs_and_refuses_a_bad_file_writing_nothing(project):
    from tasks.run.stage_task import run_stage
    from tasks.stages.common.source import source_fingerprint

    rows = [{"prompt": f"Film {i} was", "chosen": " wonderful and moving.", "rejected": " awful and boring."}
            for i in range(8)]
    write_jsonl(project / "bad.jsonl", rows[:3] + [{"prompt": "x", "chosen": "a", "rejected": ""}])
    set_source(project, "pairs:bad.jsonl")
    with pytest.raises(DataFormatError, match=r"prepare.source: .*bad.jsonl:4: column 'rejected': the answer is empty"):
        run_stage("prepare", str(project))
    assert not (project / "data" / "preferences.jsonl").exists()

    write_jsonl(project / "mine.jsonl", rows)
    set_source(project, "pairs:mine.jsonl")
    metrics = run_stage("prepare", str(project))
    assert (metrics["num_pairs"], metrics["num_prompts_train"], metrics["num_prompts_eval"]) == (6, 6, 2)
    assert metrics["num_ratings"] == 12 and metrics["num_desirable"] == 6
    pairs = [json.loads(x) for x in (project / "data" / "preferences.jsonl").read_text().splitlines()]
    assert {(p["chosen"], p["rejected"]) for p in pairs} == {(" wonderful and moving.", " awful and boring.")}
    section = type("Prepare", (), {"source": "pairs:mine.jsonl"})()
    assert source_fingerprint(section, project)["md5"]  # the file is fingerprinted: an edit makes prepare stale


def test_conversational_pairs_through_prepare_sft_reward_model_and_dpo_on_a_local_qwen2(project, tmp_path):
    from transformers import AutoTokenizer

    from _local_models import save_local_qwen2
    from tasks.run.stage_task import run_stage

    save_local_qwen2(tmp_path / "my-qwen2")
    rows = [{"prompt": [{"role": "user", "content": f"How was film {i}?"}],
             "chosen": [{"role": "assistant", "content": "Wonderful and moving."}],
             "rejected": [{"role": "assistant", "content": "Awful and boring."}]} for i in range(8)]
    write_jsonl(project / "chat.jsonl", rows)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["prepare"].update(source="pairs:chat.jsonl", eval_fraction=0.25)
    params["sft"].update(model_name=str(tmp_path / "my-qwen2"), per_device_train_batch_size=4)
    params["reward_model"].update(per_device_train_batch_size=4)
    params["dpo"].update(per_device_train_batch_size=4)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    def read(name):
        return [json.loads(x) for x in (project / "data" / f"{name}.jsonl").read_text().splitlines()]

    run_stage("prepare", str(project))
    pairs = read("preferences")
    assert len(pairs) == 6 and all(p["prompt"].startswith("<|im_start|>user\nHow was film ") and
                                   p["prompt"].endswith("<|im_end|>\n<|im_start|>assistant\n") and
                                   p["chosen"] == "Wonderful and moving.<|im_end|>" for p in pairs)  # Qwen2's template
    assert read("sft_train") == [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows
                                 if any(p["prompt"].startswith(f"<|im_start|>user\n{r['prompt'][0]['content']}")
                                        for p in pairs)]  # messages: SFT renders them, learns the assistant's turn
    assert run_stage("sft", str(project))["num_texts"] == 6
    assert '"model_type": "qwen2"' in (project / "models" / "sft" / "config.json").read_text()
    assert AutoTokenizer.from_pretrained(project / "models" / "sft").chat_template == CHATML_TEMPLATE  # kept
    run_stage("label", str(project))  # the sentiment task's placeholders
    run_stage("reward_model", str(project))
    assert run_stage("dpo", str(project))["steps"] >= 1


def test_pairs_from_a_dataset_source(project, tmp_path):
    from tasks.run.stage_task import run_stage

    folder = tmp_path / "my-pairs"  # loaded by datasets.load_dataset, as a hub id is where a network is reachable
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"prompt": f"Film {i} was", "chosen": " moving.", "rejected": " dull."}
                                         for i in range(8)])
    set_source(project, f"pairs:hub:{folder}")
    metrics = run_stage("prepare", str(project))
    assert (metrics["num_pairs"], metrics["num_prompts_eval"]) == (6, 2)
    write_jsonl(folder / "train.jsonl", [{"prompt": "Film was", "chosen": " moving.", "rejected": " moving."}])
    with pytest.raises(DataFormatError, match=rf"prepare.source: hub:{folder}\[train\]:1: columns 'chosen' and "
                                              "'rejected': the same answer"):
        run_stage("prepare", str(project))
