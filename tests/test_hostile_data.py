"""Issue 12.3: hostile data fails in ``prepare`` with a clear error or is bounded there, never crashes later."""

from __future__ import annotations

import json
import os
import time

import pytest

from rlhf_core.data import (
    MAX_WORD_BYTES,
    DataFormatError,
    bound_reviews,
    check_preference_pair,
    pairs_with_margin,
    prompt_token_budget,
    review_overlong,
)
from rlhf_core.models.tiny import DEFAULT_CORPUS, _bounded_runs, build_tokenizer

LONG_WORD = "a" * 400  # the review that became a 190-token prompt for a 96-position model


def test_a_review_with_an_overlong_word_or_prompt_is_dropped_with_the_reason():
    normal = "This movie was wonderful and the acting was great"
    wide = "Überraschend schöne Bildgestaltungsmöglichkeiten überall gesehen heute"  # first 4 words: 60 bytes > 48
    kept, dropped = bound_reviews([normal, f"{LONG_WORD} was bad", wide, "x" * MAX_WORD_BYTES + " ok"], 4)
    assert kept == [normal, "x" * MAX_WORD_BYTES + " ok"]
    assert dropped == [f"a 400-byte word (limit {MAX_WORD_BYTES})", "a 60-byte prompt (limit 48)"]
    assert review_overlong("é" * 21 + " b", 4) == "a 42-byte word (limit 40)"  # bytes, not characters


def test_a_kept_prompt_fits_its_token_budget_with_any_byte_level_tokenizer():
    tokenizer = build_tokenizer(vocab_size=300)
    for prompt in ("This movie was great", "🎬🎬🎬🎬🎬🎬 is 🙂🙂", "ÄÖÜ ßßß ąęł ???"):
        if review_overlong(prompt, 4) is None:
            assert len(tokenizer(prompt).input_ids) <= len(prompt.encode()) <= prompt_token_budget(4)


def test_identical_chosen_and_rejected_is_an_error_naming_file_and_line(tmp_path):
    good = {"prompt": "The film", "chosen": " was fine.", "rejected": " was bad."}
    same = {"prompt": "The film", "chosen": " was fine.", "rejected": "was fine.  "}
    (tmp_path / "pairs.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(same) + "\n")
    from rlhf_core.feedback import validate_batch  # the feedback intake's check (nothing is ingested on failure)

    with pytest.raises(DataFormatError, match=rf"^{tmp_path / 'pairs.jsonl'}:2: 'chosen' and 'rejected' are the same"):
        validate_batch(tmp_path / "pairs.jsonl")
    assert check_preference_pair(good, "f", 1) is good


def test_incoming_pairs_need_the_judges_agreement_by_the_margin():
    pairs = [{"prompt": "p", "chosen": f" c{i}", "rejected": f" r{i}"} for i in range(4)]
    kept, dropped = pairs_with_margin(pairs, [0.9, 0.5, 0.1, 0.4], [0.1, 0.4, 0.6, 0.1], min_margin=0.3)
    # gaps: 0.8 kept, 0.1 too close, -0.5 reversed, 0.3 kept (>= margin)
    assert [p["chosen"] for p in kept] == [" c0", " c3"] and dropped == 2
    assert kept[0]["chosen_score"] == 0.9 and kept[0]["rejected_score"] == 0.1


def test_tokenizer_training_is_linear_in_a_one_megabyte_single_token_line():
    assert _bounded_runs("a normal line, with words.") == "a normal line, with words."
    started = time.monotonic()
    build_tokenizer(list(DEFAULT_CORPUS) + ["x" * 1_000_000], vocab_size=300)
    assert time.monotonic() - started < 30  # was > 200 s


@pytest.fixture
def project(stage_project):
    return stage_project


def test_prepare_bounds_hostile_reviews_and_counts_them(project):
    """Hostile reviews in ``prepare.source`` are dropped and counted; none reaches a dataset."""
    import yaml

    from tasks.run.stage_task import run_stage

    hostile = [f"{LONG_WORD} movie was terrible and long", "y" * 1_000_000 + " was a film",
               "Unbelievably overcomplicated incomprehensibilities notwithstanding, fine"]
    normal = [f"This movie number {i} was {'great' if i % 2 else 'awful'} and the acting was fine" for i in range(300)]
    source = project / "reviews.txt"
    source.write_text("\n".join(hostile + normal) + "\n")  # first: prepare reads the first num_reviews
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["prepare"]["source"] = "reviews.txt"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    metrics = run_stage("prepare", str(project))
    assert metrics["num_dropped_overlong"] == 3
    assert json.loads((project / "metrics" / "prepare.json").read_text())["num_dropped_overlong"] == 3
    for name in ("sft_train", "heldout", "prompts_train", "prompts_eval", "preferences"):
        text = (project / "data" / f"{name}.jsonl").read_text()
        assert "aaaaaaaaaa" not in text and "yyyyyyyyyy" not in text
    for line in (project / "data" / "prompts_train.jsonl").read_text().splitlines():
        assert len(json.loads(line)["query"].encode()) <= prompt_token_budget(4)


def test_incoming_ratings_need_the_judge_to_give_the_same_label_outside_the_band():
    from rlhf_core.data import ratings_with_margin

    ratings = [{"prompt": "p", "completion": f" c{i}", "label": label}
               for i, label in enumerate([True, True, False, False, True])]
    kept, dropped = ratings_with_margin(ratings, [0.6, 0.02, 0.3, -0.4, 0.0], threshold=0.0, min_margin=0.05)
    # 0.6 good and labelled good: kept; 0.02 inside the band; 0.3 says good, labelled bad; -0.4 bad and bad: kept;
    # 0.0 exactly the threshold (no label either way)
    assert [r["completion"] for r in kept] == [" c0", " c3"] and dropped == 3
    assert kept[1] == {"prompt": "p", "completion": " c3", "label": False, "score": -0.4}
