"""Shared setup of the GRPO/RLOO trainer tests: tiny models, a toy reward, a prompt dataset."""

from __future__ import annotations

import math

import torch
from datasets import Dataset

PROMPTS = ["The film was", "I think the story", "A good", "This movie is", "The acting", "Overall it",
           "The music was", "My favourite part"]


def prompt_dataset(n: int = 8) -> Dataset:
    """``prompt`` plus an extra column that reward functions receive as a keyword."""
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)], "row_id": list(range(n))})


def count_e(prompts, completions, **kwargs):
    """Toy reward: how many 'e' characters the completion has (TRL 1.16 reward-function signature)."""
    return [float(c.count("e")) for c in completions]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def train_logs(trainer) -> list[dict]:
    """The per-step logs (not the final train summary)."""
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_finite_keys(logs: list[dict], keys: list[str]) -> None:
    for entry in logs:
        missing = [k for k in keys if k not in entry]
        assert not missing, f"missing {missing} in {sorted(entry)}"
        bad = {k: entry[k] for k in keys if not math.isfinite(entry[k])}
        assert not bad, bad


def online_args(config_cls, tmp_path, **overrides):
    """A small GRPO/RLOO config for the tests: 8 completions per step in groups of 4, 6 tokens, 2 steps."""
    values = dict(output_dir=str(tmp_path / "out"), report_to=[], per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no", seed=0)
    values.update(overrides)
    return config_cls(**values)
