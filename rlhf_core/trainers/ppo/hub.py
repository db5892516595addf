"""Pushing a PPO policy to the Hugging Face Hub, and classic TRL's ``push_to_hub_if_best_kwargs``: push the
model whenever a step's mean score beats the best so far (compared every ``compare_steps`` steps).

``PushIfBest`` owns that state; ``PPOTrainer`` holds one (``trainer.push_if_best``) and shows its fields under
classic TRL's attribute names (``push_to_hub_kwargs``, ``compare_step``, ``highest_reward``: ``ClassicName``)
so that scripts reading them keep working. ``push_to_hub`` is what ``PPOTrainer.push_to_hub`` runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from rlhf_core.trainers.ppo.config import PPOConfig


class PushIfBest:
    """When to push: every ``compare_steps`` steps, if the batch's mean score is the best yet."""

    def __init__(self, config: PPOConfig) -> None:
        """Read ``push_to_hub_if_best_kwargs``; raise ``ValueError`` when they do not name a repo_id."""
        self.config = config  # ``compare_steps`` is read at each step, as classic TRL reads it
        self.push_to_hub_kwargs = dict(config.push_to_hub_if_best_kwargs)  # empty: never push
        if self.push_to_hub_kwargs and "repo_id" not in self.push_to_hub_kwargs:
            raise ValueError("push_to_hub_if_best_kwargs must name the repo_id to push the best model to")
        self.compare_step = 0  # steps seen: a step is compared when this is a multiple of compare_steps
        self.highest_reward = torch.tensor(-float("inf"))  # () the best mean score compared so far

    def update(self, scores: torch.Tensor, push: Callable[..., Any]) -> None:
        """After a step's scores (B,) are known: ``push(**push_to_hub_kwargs)`` if it is due and the best yet."""
        if not self.push_to_hub_kwargs:
            return
        if self.compare_step % self.config.compare_steps == 0:
            mean = scores.mean().cpu()
            if mean > self.highest_reward:
                self.highest_reward = mean
                push(**self.push_to_hub_kwargs)
        self.compare_step += 1


class ClassicName:
    """A ``PPOTrainer`` attribute under classic TRL's name whose value lives on its ``push_if_best`` object
    (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: type | None = None) -> Any:
        return self if trainer is None else getattr(trainer.push_if_best, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.push_if_best, self.name, value)


def push_to_hub(trainer, repo_id: str, **kwargs: Any) -> Any:
    """Push the policy (value head included) and tokenizer to the Hub repo ``repo_id`` (needs a network)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise RuntimeError(f"cannot push to the Hub repo {repo_id!r}: HF_HUB_OFFLINE is set (no network). Unset "
                           "it, or drop push_to_hub_if_best_kwargs from the PPOConfig")
    if not trainer.accelerator.is_main_process:
        return None
    trainer.tokenizer.push_to_hub(repo_id, **kwargs)
    return trainer.accelerator.unwrap_model(trainer.model).push_to_hub(repo_id, **kwargs)
