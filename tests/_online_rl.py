"""Shared setup of the GRPO/RLOO trainer tests: tiny models, a toy reward, a prompt dataset."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset

from rlhf_core.models.tiny import build_tokenizer

LOGGED_KEYS = ["loss", "grad_norm", "reward", "reward_std", "rewards/count_e/mean", "rewards/count_e/std",
               "frac_reward_zero_std", "completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
               "policy_loss", "entropy", "skipped_updates",
               # TRL 1.16's other names
               "num_tokens", "step_time", "completions/mean_terminated_length", "completions/min_terminated_length",
               "completions/max_terminated_length", "clip_ratio/low_min", "clip_ratio/high_max"]
"""What GRPO and RLOO log every step with the ``count_e`` reward (plus ``kl`` when beta > 0)."""

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


def toy_reward_curve(trainer_cls, config_cls, tokenizer, tmp_path) -> tuple[float, float]:
    """Mean reward of the first and of the last 5 of 40 steps training a tiny model on ``count_e`` (beta 0)."""
    from rlhf_core.models.tiny import tiny_causal_lm

    args = online_args(config_cls, tmp_path, max_steps=40, learning_rate=3e-3, per_device_train_batch_size=16,
                       num_generations=8, max_completion_length=8, beta=0.0)
    trainer = trainer_cls(tiny_causal_lm(tokenizer), count_e, args=args, train_dataset=prompt_dataset(64),
                          processing_class=tokenizer)
    trainer.train()
    rewards = [h["reward"] for h in train_logs(trainer)]
    return sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer of rlhf_core.models.tiny (import this fixture into a test module to use it)."""
    return build_tokenizer()
