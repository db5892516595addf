"""Offline stand-ins for the hub checkpoints the spec's examples download.

``tiny_checkpoint()`` writes (once) a tiny GPT-2-shaped model and its tokenizer to a local
directory, so ``from_pretrained(path)`` works exactly as ``from_pretrained("gpt2")`` does online.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm, tiny_reward_model

CACHE = Path(os.environ.get("RLHF_CORE_EXAMPLES_CACHE", Path(__file__).resolve().parent.parent / ".cache" / "examples"))


def tiny_checkpoint(kind: str = "causal") -> str:
    """Path of a local tiny checkpoint: ``causal`` (a policy) or ``classifier`` (a 2-label sentiment model)."""
    path = CACHE / f"tiny-{kind}"
    if not (path / "config.json").exists():
        tokenizer = build_tokenizer()
        if kind == "causal":
            model = tiny_causal_lm(tokenizer, hidden_size=64, num_layers=2)
        else:
            model = tiny_reward_model(tokenizer)
            model.config.num_labels = 2
            model.score = type(model.score)(model.config.n_embd, 2, bias=False)
            model.config.id2label, model.config.label2id = {0: "NEGATIVE", 1: "POSITIVE"}, {"NEGATIVE": 0, "POSITIVE": 1}
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(path)
    return str(path)
