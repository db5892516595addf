"""A user's own problems file (JSONL, CSV, Parquet; plain or conversational): read, checked, and refused with the
file, row and column named."""

from __future__ import annotations

import json

import pytest

from rlhf_core.data import DataFormatError
from rlhf_core.rewards import accuracy_reward
from rlhf_core.user_problems import read_problems

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_plain_and_conversational_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [
        {"prompt": "1 + 1 =", "solution": 2, "completion": "1 + 1 = 2 #### 2"},
        {"prompt": CHAT, "solution": "#### 4",
         "completion": [{"role": "assistant", "content": "<answer>4</answer>"}]},
        {"prompt": "3 * 3 =", "solution": "9", "extra": "kept out"}])
    problems = read_problems(path)
    assert [p["id"] for p in problems] == ["mine.jsonl:1", "mine.jsonl:2", "mine.jsonl:3"]
    assert problems[1]["prompt"] == CHAT and problems[2]["completion"] is None
    completions = [p["completion"] for p in problems[:2]]
    assert accuracy_reward(completions, [p["solution"] for p in problems[:2]]) == [1.0, 1.0]


def test_csv_and_parquet_with_own_column_names(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "p.csv").write_text("question,answer\n12 - 5 =,7\n\"1,000 + 1 =\",\"1,001\"\n")
    rows = read_problems(tmp_path / "p.csv", prompt_field="question", answer_field="answer")
    assert [(r["prompt"], r["solution"]) for r in rows] == [("12 - 5 =", "7"), ("1,000 + 1 =", "1,001")]
    pq.write_table(pa.Table.from_pylist([{"prompt": CHAT, "solution": "4"}]), tmp_path / "p.parquet")
    assert read_problems(tmp_path / "p.parquet")[0]["prompt"] == CHAT


@pytest.mark.parametrize("rows, match", [
    ([{"prompt": "a", "solution": "1"}, {"prompt": "b"}], r"bad.jsonl:2: no column 'solution'"),
    ([{"prompt": "a", "solution": "seven"}], r"bad.jsonl:1: column 'solution': 'seven' has no number"),
    ([{"prompt": "a", "solution": None}], r"bad.jsonl:1: column 'solution': None"),
    ([{"question": "a", "solution": "1"}], r"bad.jsonl:1: no column 'prompt'"),
    ([{"prompt": "  ", "solution": "1"}], r"bad.jsonl:1: column 'prompt': the prompt is empty"),
    ([{"prompt": CHAT + [{"role": "assistant", "content": "4"}], "solution": "4"}],
     r"bad.jsonl:1: column 'prompt': a prompt conversation must end with a user turn"),
    ([{"prompt": CHAT, "solution": "4", "completion": [{"role": "user", "content": "4"}]}],
     r"bad.jsonl:1: column 'completion': the conversation has no assistant turn"),
    ([{"prompt": [{"role": "robot", "content": "x"}], "solution": "4"}],
     r"bad.jsonl:1: column 'prompt', message 0: unknown role 'robot'"),
    ([{"prompt": [{"role": "user", "content": 4}], "solution": "4"}],
     r"bad.jsonl:1: column 'prompt', message 0: content must be text"),
    ([], r"bad.jsonl: no problems"),
])
def test_bad_rows_are_refused_naming_file_row_and_column(tmp_path, rows, match):
    with pytest.raises(DataFormatError, match=match):
        read_problems(write_jsonl(tmp_path / "bad.jsonl", rows))


def test_a_csv_row_is_named_by_its_line(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,solution\na,1\nb,two\n")
    with pytest.raises(DataFormatError, match=r"p.csv:3: column 'solution': 'two'"):
        read_problems(tmp_path / "p.csv")


def test_a_dataset_named_hub_is_read_through_load_dataset_and_its_rows_named(tmp_path):
    # a dataset folder: datasets.load_dataset takes it as it takes a hub id (which needs a network), same code path
    folder = tmp_path / "my-problems"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"question": "1 + 1 =", "answer": 2}, {"question": "2 + 3 =", "answer": "5"}])
    write_jsonl(folder / "test.jsonl", [{"question": "4 - 1 =", "answer": 3},
                                        {"question": "9 - 1 =", "answer": "eight"}])
    rows = read_problems(f"hub:{folder}", prompt_field="question", answer_field="answer")
    assert [(r["id"], r["prompt"], r["solution"]) for r in rows] == [("my-problems[train]:1", "1 + 1 =", "2"),
                                                                     ("my-problems[train]:2", "2 + 3 =", "5")]
    with pytest.raises(DataFormatError, match=rf"hub:{folder}\[test\]:2: column 'answer': 'eight' has no number"):
        read_problems(f"hub:{folder}", prompt_field="question", answer_field="answer", split="test")
