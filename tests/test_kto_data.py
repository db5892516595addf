"""Unpaired ratings (issue 14.4): corpus + judge -> (prompt, completion, label) rows, and their reader/validator."""

from __future__ import annotations

import json

import pytest

from rlhf_core.data import (
    DataFormatError,
    check_rating,
    cut_prompt,
    generate_reviews,
    make_unpaired_ratings,
    read_ratings,
    write_jsonl,
)


def judge_by_table(table):
    """A judge that scores a text by the first key it contains."""
    def judge(texts):
        return [next(score for key, score in table.items() if key in text) for text in texts]
    return judge


def test_ratings_label_by_threshold_and_drop_ambiguous_rows():
    texts = ["one two three good", "one two three bad", "one two three meh", "single"]
    judge = judge_by_table({"good": 0.6, "bad": -0.4, "meh": 0.05})
    rows = make_unpaired_ratings(texts, judge, min_words=3, max_words=3, threshold=0.0, min_margin=0.1)
    # "meh" scores 0.05, within 0.1 of the threshold: dropped; "single" has no continuation
    assert rows == [
        {"prompt": "one two three", "completion": " good", "label": True, "score": 0.6},
        {"prompt": "one two three", "completion": " bad", "label": False, "score": -0.4},
    ]
    assert all(isinstance(r["label"], bool) for r in rows)


def test_a_score_equal_to_the_threshold_is_dropped():
    rows = make_unpaired_ratings(["a b"], lambda texts: [0.0] * len(texts), 1, 1)
    assert rows == []


def test_ratings_from_the_default_corpus_and_gold_judge():
    from rlhf_core.rewards import GoldJudge

    texts = generate_reviews(60, seed=1)
    judge = GoldJudge()
    rows = make_unpaired_ratings(texts, judge, min_words=2, max_words=4, seed=3)
    assert rows == make_unpaired_ratings(texts, judge, min_words=2, max_words=4, seed=3)  # deterministic
    labels = [r["label"] for r in rows]
    assert 0.2 < sum(labels) / len(labels) < 0.8  # both kinds of feedback
    for row in rows:
        assert row["label"] == (judge([row["prompt"] + row["completion"]])[0] > 0)
        assert any(cut_prompt(t, len(row["prompt"].split())) == (row["prompt"], row["completion"]) for t in texts)


def test_check_rating_accepts_good_rows_and_names_file_and_line():
    good = {"prompt": "The film was", "completion": " great", "label": True, "score": 0.6}
    assert check_rating("r.jsonl", 3, good) == {"prompt": "The film was", "completion": " great", "label": True}
    for bad, match in [
        ({"prompt": "p", "completion": " c", "label": 1}, "'label' must be true or false"),
        ({"prompt": "p", "completion": " c", "label": "true"}, "'label' must be true or false"),
        ({"prompt": "p", "completion": "  ", "label": False}, "'completion' must be a non-empty string"),
        ({"prompt": "p", "completion": " c"}, "missing field 'label'"),
        ({"completion": " c", "label": True}, "missing field 'prompt'"),
    ]:
        with pytest.raises(DataFormatError, match=match) as info:
            check_rating("r.jsonl", 7, bad)
        assert str(info.value).startswith("r.jsonl:7:")


def test_read_ratings_round_trips_and_reports_the_bad_line(tmp_path):
    rows = [{"prompt": "a", "completion": " b", "label": True}, {"prompt": "c", "completion": " d", "label": False}]
    path = tmp_path / "ratings.jsonl"
    write_jsonl(rows, path)
    assert read_ratings(path) == rows
    assert read_ratings(tmp_path) == rows  # a directory of .jsonl files
    path.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "label": 0}) + "\n")
    with pytest.raises(DataFormatError, match=r"ratings.jsonl:2: field 'label' must be true or false"):
        read_ratings(path)
    path.write_text("{not json\n")
    with pytest.raises(DataFormatError, match=r"ratings.jsonl:1: invalid JSON"):
        read_ratings(path)
    with pytest.raises(FileNotFoundError, match="missing"):
        read_ratings(tmp_path / "missing.jsonl")
