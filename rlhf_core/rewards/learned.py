"""Learned and judged rewards: texts in, one float per text out (the sentiment task's rewards).

- :class:`GoldJudge`: VADER's compound sentiment (-1..1), a lexicon judge that ships inside the
  ``vaderSentiment`` package and works offline. The pipeline's "human" labeller and its gold metric.
- :class:`PipelineReward`: a hub text-classification model (e.g. ``lvwerra/distilbert-imdb``) through a
  transformers pipeline; the score is the raw logit of ``positive_label`` (classic TRL IMDB example).
- :class:`RewardModelScorer`: a learned reward model (sequence classifier with one output) from a path.

:func:`make_reward` builds one from the pipeline's ``ppo.reward`` spelling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GoldJudge:
    """VADER compound sentiment in [-1, 1] (about 0.03 ms per short text)."""

    name = "gold"

    def __init__(self) -> None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("the gold judge needs vaderSentiment: pip install vaderSentiment==3.3.2") from err
        self._analyzer = SentimentIntensityAnalyzer()

    def __call__(self, texts: Sequence[str]) -> list[float]:
        return [float(self._analyzer.polarity_scores(t)["compound"]) for t in texts]


class PipelineReward:
    """Score = logit of ``positive_label`` from a text-classification pipeline (hub model or local path)."""

    def __init__(self, model: str, positive_label: str = "POSITIVE", batch_size: int = 16, device: int | str = -1,
                 trust_remote_code: bool = False) -> None:
        from transformers import pipeline

        self.name = f"pipeline:{model}"
        self.positive_label = positive_label
        self.batch_size = batch_size
        self._pipe = pipeline("text-classification", model=model, device=device, trust_remote_code=trust_remote_code)

    def __call__(self, texts: Sequence[str]) -> list[float]:
        outputs = self._pipe(list(texts), top_k=None, function_to_apply="none", batch_size=self.batch_size,
                             truncation=True)
        scores = []
        for out in outputs:
            by_label = {o["label"]: o["score"] for o in out}
            if self.positive_label not in by_label:
                raise ValueError(f"{self.name}: no label {self.positive_label!r} (labels: {sorted(by_label)})")
            scores.append(float(by_label[self.positive_label]))
        return scores


class RewardModelScorer:
    """A learned reward model: ``AutoModelForSequenceClassification`` with ``num_labels=1``."""

    name = "reward_model"

    def __init__(self, model_or_path, tokenizer=None, batch_size: int = 64, max_length: int = 128,
                 device: str | torch.device = "cpu") -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if isinstance(model_or_path, (str, bytes)) or hasattr(model_or_path, "__fspath__"):
            model = AutoModelForSequenceClassification.from_pretrained(str(model_or_path))
            tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(model_or_path))
        else:
            model = model_or_path
        if tokenizer is None:
            raise ValueError("RewardModelScorer needs a tokenizer when given a model object")
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model has one output, this one has num_labels={model.config.num_labels}")
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> list[float]:
        from rlhf_core.models.reward_model import sequence_rewards

        scores: list[float] = []
        eos = self.tokenizer.eos_token or ""  # the reward trainer scores texts ending in EOS
        padding_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = "right"
        try:
            for start in range(0, len(texts), self.batch_size):
                chunk = [t + eos for t in texts[start:start + self.batch_size]]
                enc = self.tokenizer(chunk, return_tensors="pt", padding=True, truncation=True,
                                     max_length=self.max_length).to(self.device)
                rewards = sequence_rewards(self.model, enc["input_ids"], enc["attention_mask"])  # (B,)
                scores.extend(rewards.float().tolist())
        finally:
            self.tokenizer.padding_side = padding_side
        return scores


def make_reward(spec: str, reward_model_path: str | None = None, **kwargs):
    """``gold`` -> :class:`GoldJudge`; ``reward_model`` -> :class:`RewardModelScorer` on ``reward_model_path``;
    ``pipeline:<model>`` -> :class:`PipelineReward`."""
    if spec == "gold":
        return GoldJudge()
    if spec == "reward_model":
        if not reward_model_path:
            raise ValueError("reward 'reward_model' needs reward_model_path")
        return RewardModelScorer(reward_model_path, **kwargs)
    if spec.startswith("pipeline:"):
        return PipelineReward(spec.split(":", 1)[1], **kwargs)
    raise ValueError(f"unknown reward {spec!r}: use gold, reward_model or pipeline:<model>")
