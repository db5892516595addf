"""The pad-token rules, in one place: a tokenizer without a pad token pads with its EOS (as TRL does), and the id
queries are padded with is the pad token's, else EOS's."""

from __future__ import annotations

from typing import Any


def ensure_pad_token(tokenizer: Any) -> Any:
    """``tokenizer`` with ``pad_token = eos_token`` when it has no pad token (changed in place; returned)."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def pad_id_of(tokenizer: Any) -> int | None:
    """The id used to pad: the tokenizer's pad token, else its EOS (None when it has neither)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


__all__ = ["ensure_pad_token", "pad_id_of"]
