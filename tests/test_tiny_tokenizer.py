"""The built tokenizer's digit splitting (``sft.split_digits``, the arithmetic task's setting)."""

from __future__ import annotations

from rlhf_core.models.tiny import build_tokenizer

CORPUS = ["Q: 7 + 65 = ? A: 7 + 65 = 72 <answer>72</answer>", "Q: 40 - 13 = ? A: 40 - 13 = 27 <answer>27</answer>"] * 40


def test_split_digits_makes_every_digit_a_token_and_decodes_back():
    merged = build_tokenizer(CORPUS, vocab_size=300)
    split = build_tokenizer(CORPUS, vocab_size=300, split_digits=True)
    text = CORPUS[0]
    assert "Ġ65" in merged.convert_ids_to_tokens(merged.encode(text))  # BPE learned the number as one token
    tokens = split.convert_ids_to_tokens(split.encode(text))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["7", "6", "5", "7", "6", "5", "7", "2", "7", "2"]
    assert split.decode(split.encode(text)) == text == merged.decode(merged.encode(text))
    # a number never seen in the corpus is still its digits, not an unknown or a new merge
    assert split.convert_ids_to_tokens(split.encode(" 981"))[-3:] == ["9", "8", "1"]
