"""Pushing a PPO policy to the Hugging Face Hub, and classic TRL's ``push_to_hub_if_best_kwargs``: push the
model whenever a step's mean score beats the best so far (compared every ``compare_steps`` steps).

Functions over the trainer (its ``config``, ``accelerator``, ``model``, ``tokenizer`` and the push state below);
``PPOTrainer.push_to_hub`` delegates here. The state stays on the trainer under classic TRL's attribute names
(``push_to_hub_kwargs``, ``compare_step``, ``highest_reward``) so that scripts reading them keep working.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rlhf_core.trainers.ppo.config import PPOConfig


def init_push_if_best(trainer, config: PPOConfig) -> None:
    """Set the trainer's push state from ``push_to_hub_if_best_kwargs``; raise ``ValueError`` without a repo_id."""
    trainer.push_to_hub_kwargs = dict(config.push_to_hub_if_best_kwargs)
    if trainer.push_to_hub_kwargs and "repo_id" not in trainer.push_to_hub_kwargs:
        raise ValueError("push_to_hub_if_best_kwargs must name the repo_id to push the best model to")
    trainer.compare_step = 0
    trainer.highest_reward = torch.tensor(-float("inf"))


def push_if_best(trainer, scores: torch.Tensor) -> None:
    """Every ``compare_steps`` steps, push the model if the batch's mean (processed) score (B,) is the best yet."""
    if not trainer.push_to_hub_kwargs:
        return
    if trainer.compare_step % trainer.config.compare_steps == 0:
        mean = scores.mean().cpu()
        if mean > trainer.highest_reward:
            trainer.highest_reward = mean
            trainer.push_to_hub(**trainer.push_to_hub_kwargs)  # the method: subclasses and tests may replace it
    trainer.compare_step += 1


def push_to_hub(trainer, repo_id: str, **kwargs: Any) -> Any:
    """Push the policy (value head included) and tokenizer to the Hub repo ``repo_id`` (needs a network)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(f"cannot push to the Hub repo {repo_id!r}: HF_HUB_OFFLINE is set (no network). Unset "
                           "it, or drop push_to_hub_if_best_kwargs from the PPOConfig")
    if not trainer.accelerator.is_main_process:
        return None
    trainer.tokenizer.push_to_hub(repo_id, **kwargs)
    return trainer.accelerator.unwrap_model(trainer.model).push_to_hub(repo_id, **kwargs)
