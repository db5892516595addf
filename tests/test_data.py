"""rlhf_core.data sources and shaping, rlhf_core.rewards gold judge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_core.data import (
    DataFormatError,
    cut_prompt,
    generate_reviews,
    make_preference_pairs,
    make_prompts,
    read_text_records,
    split_train_eval,
)
from rlhf_core.rewards import GoldJudge

RT_POLARITY = Path(__file__).resolve().parents[2] / "shared" / "data" / "rt-polarity"


@pytest.fixture(scope="module")
def judge():
    return GoldJudge()


def test_synthetic_reviews_are_deterministic_and_mixed(judge):
    a, b = generate_reviews(400, seed=3), generate_reviews(400, seed=3)
    assert a == b and a != generate_reviews(400, seed=4)
    scores = judge(a)
    positive = sum(s > 0.05 for s in scores) / len(scores)
    negative = sum(s < -0.05 for s in scores) / len(scores)
    # a mix: the SFT model must have room to improve, and the judge must see both signs
    assert 0.25 < positive < 0.75 and 0.25 < negative < 0.75
    assert len({r.split()[0] for r in a}) > 5


def test_gold_judge_orders_obvious_cases(judge):
    good, bad = judge(["This movie was wonderful and I loved it.", "This movie was awful and boring."])
    assert -1.0 <= bad < 0 < good <= 1.0


def test_cut_prompt_keeps_the_join():
    prompt, rest = cut_prompt("This movie was really good.", 3)
    assert (prompt, rest) == ("This movie was", " really good.")
    assert prompt + rest == "This movie was really good."
    assert cut_prompt("Two words", 5) == ("Two", " words")  # always leaves a continuation


def test_split_and_prompts():
    texts = [f"review number {i} is here" for i in range(20)]
    train, held = split_train_eval(texts, 0.25, seed=0)
    assert len(held) == 5 and sorted(train + held) == sorted(texts)
    prompts = make_prompts(texts, 2, 3, seed=0)
    assert len(prompts) == 20 and all(2 <= len(p.split()) <= 3 for p in prompts)


def test_preference_pairs_follow_the_judge(judge):
    texts = generate_reviews(300, seed=1)
    pairs = make_preference_pairs(texts, judge, 2, 4, pairs_per_review=1, min_margin=0.3, seed=0)
    assert len(pairs) > 100
    for pair in pairs[:50]:
        assert pair["chosen"] != pair["rejected"] and pair["chosen"].startswith(" ")
        assert pair["chosen_score"] - pair["rejected_score"] >= 0.3
        c, r = judge([pair["prompt"] + pair["chosen"], pair["prompt"] + pair["rejected"]])
        assert c == pytest.approx(pair["chosen_score"]) and r == pytest.approx(pair["rejected_score"])


def test_local_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first review\n\nsecond review\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "third"}) + "\n")
    (tmp_path / "c.csv").write_text('text,label\n"fourth, with comma",1\n')
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["fifth"]}), tmp_path / "d.parquet")
    (tmp_path / "notes.md").write_text("ignored")
    assert read_text_records(tmp_path) == ["first review", "second review", "third", "fourth, with comma", "fifth"]
    assert read_text_records(tmp_path, limit=2) == ["first review", "second review"]


@pytest.mark.parametrize(
    "name, content, line, message",
    [
        ("bad.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n', 3, "invalid JSON"),
        ("bad.jsonl", '{"text": "ok"}\n["a list"]\n', 2, "expected a JSON object"),
        ("bad.jsonl", '{"text": "ok"}\n{"body": "no text"}\n', 2, "missing field 'text'"),
        ("bad.jsonl", '{"text": ""}\n', 1, "non-empty string"),
        ("bad.csv", "text,label\nok,1\ntoo,many,fields\n", 3, "expected 2 fields, got 3"),
    ],
)
def test_malformed_files_name_file_and_line(tmp_path, name, content, line, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataFormatError, match=message) as err:
        read_text_records(path)
    assert str(err.value).startswith(f"{path}:{line}:")
    assert err.value.line == line


@pytest.mark.parametrize("name, content", [
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n'),
    ("bad.csv", b"text,label\nok,1\ncaf\xe9,0\n"),
    ("bad.txt", b"first review\r\nsecond\n\xff\xfe broken\n"),
])
def test_invalid_utf8_names_file_and_line(tmp_path, name, content):
    # Latin-1 bytes where UTF-8 is expected: always on line 3, even though the decoder reads in buffered chunks
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataFormatError, match="not UTF-8 text") as err:
        read_text_records(path)
    assert str(err.value).startswith(f"{path}:3:")


def test_unsupported_and_missing_paths(tmp_path):
    (tmp_path / "x.docx").write_text("?")
    with pytest.raises(DataFormatError, match="unsupported file type"):
        read_text_records(tmp_path / "x.docx")
    with pytest.raises(FileNotFoundError):
        read_text_records(tmp_path / "absent.jsonl")


@pytest.mark.skipif(not RT_POLARITY.is_dir(), reason="../shared/data/rt-polarity not present")
def test_rt_polarity_reads_through_the_same_code(judge):
    texts = read_text_records(RT_POLARITY)
    assert len(texts) == 10662
    sample = texts[:: len(texts) // 200]
    pairs = make_preference_pairs(sample, judge, 2, 4, min_margin=0.3, seed=0)
    assert pairs and all(p["chosen_score"] > p["rejected_score"] for p in pairs)
