"""Policy evaluation: sampling, gold/learned reward, KL to a reference, perplexity, win rate.

Pure-ish: models and texts in, numbers and texts out; no files, no trackers. ``B`` batch, ``T`` sequence,
``A`` response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rlhf_core.core import sequence_logprobs, shifted_token_logprobs


@dataclass
class Samples:
    """Sampled continuations of ``prompts``: token ids (query and response, no padding) and decoded text."""

    prompts: list[str]
    query_ids: list[torch.Tensor]
    response_ids: list[torch.Tensor]
    responses: list[str]

    @property
    def texts(self) -> list[str]:
        """Prompt + response: what a judge scores."""
        return [p + r for p, r in zip(self.prompts, self.responses)]


def _pad_left(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def _pad_right(rows: Sequence[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    return ids, mask


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 20, batch_size: int = 64,
                     seed: int = 0, should_stop: Callable[[], bool] | None = None) -> Samples:
    """Pure sampling (no top-k/top-p) of up to ``max_new_tokens`` per prompt, cut after the first EOS.

    Seeded, so two policies are compared on the same random stream. The pad token is never sampled.
    ``should_stop`` (optional) is asked after each new token: True ends the generation there (a server cancelling a
    request that ran past its time); the caller knows the answers are then cut short.
    """
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    extra = {"suppress_tokens": [pad_id]} if pad_id != eos else {}
    if should_stop is not None:
        extra["stopping_criteria"] = _stopping_criteria(should_stop)
    device = next(model.parameters()).device
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    query_ids, response_ids = [], []
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts[start:start + batch_size]]
            ids, mask = _pad_left(chunk, pad_id)  # (B, T)
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True, top_k=0,
                                 top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos, **extra)
            for q, row in zip(chunk, out[:, ids.shape[1]:].cpu()):  # row: (A,)
                hits = (row == eos).nonzero()
                row = row[: int(hits[0]) + 1] if len(hits) else row
                row = row[row != pad_id] if pad_id != eos else row
                query_ids.append(q)
                response_ids.append(row if len(row) else torch.tensor([eos]))
    finally:
        torch.random.set_rng_state(generator_state)
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return Samples(list(prompts), query_ids, response_ids, responses)


def _stopping_criteria(ask: Callable[[], bool]):
    """transformers' stopping criteria that end every sequence once ``ask()`` says so (asked once per new token)."""
    from transformers import StoppingCriteria, StoppingCriteriaList  # only when a caller may stop sampling

    class AskStop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            return torch.full((input_ids.shape[0],), bool(ask()), dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([AskStop()])


@torch.no_grad()
def response_logprobs(model, query_ids: Sequence[torch.Tensor], response_ids: Sequence[torch.Tensor], pad_id: int,
                      batch_size: int = 64) -> torch.Tensor:
    """Sum of log p(response token | prefix) per sample under ``model``: returns (N,)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(query_ids), batch_size):
        qs, rs = query_ids[start:start + batch_size], response_ids[start:start + batch_size]
        ids, mask = _pad_right([torch.cat([q, r]) for q, r in zip(qs, rs)], pad_id)  # (B, T)
        response_mask = torch.zeros_like(ids)  # (B, T): 1 on response tokens
        for i, (q, r) in enumerate(zip(qs, rs)):
            response_mask[i, len(q): len(q) + len(r)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()  # (B, T, V)
        token_logprobs = shifted_token_logprobs(logits, ids)  # (B, T-1): scores token t+1
        out.append(sequence_logprobs(token_logprobs, response_mask[:, 1:]))  # (B,)
    return torch.cat(out)


def kl_to_reference(policy, reference, samples: Samples, pad_id: int, batch_size: int = 64) -> float:
    """Monte-Carlo KL(policy || reference) per response: mean over policy samples of sum_t (log p - log q)."""
    logp = response_logprobs(policy, samples.query_ids, samples.response_ids, pad_id, batch_size)  # (N,)
    logq = response_logprobs(reference, samples.query_ids, samples.response_ids, pad_id, batch_size)  # (N,)
    return float((logp - logq).mean())


@torch.no_grad()
def perplexity(model, tokenizer, texts: Sequence[str], batch_size: int = 64, max_length: int = 128) -> float:
    """exp(mean token negative log-likelihood) over ``texts`` (EOS appended, the first token not scored)."""
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(texts), batch_size):
        rows = []
        for text in texts[start:start + batch_size]:
            ids = tokenizer(text, return_tensors="pt").input_ids[0]
            if tokenizer.eos_token_id is not None:
                ids = torch.cat([ids, torch.tensor([tokenizer.eos_token_id])])
            rows.append(ids[:max_length])
        ids, mask = _pad_right(rows, pad_id)  # (B, T)
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float().cpu()  # (B, T, V)
        token_logprobs = shifted_token_logprobs(logits, ids)  # (B, T-1)
        scored = mask[:, 1:].float()  # (B, T-1)
        total_nll -= float((token_logprobs * scored).sum())
        total_tokens += int(scored.sum())
    return math.exp(total_nll / max(total_tokens, 1))


def win_rate(scores: Sequence[float], baseline: Sequence[float]) -> float:
    """Share of paired samples where ``scores`` beats ``baseline`` (ties count one half)."""
    if len(scores) != len(baseline) or not scores:
        raise ValueError(f"win_rate needs two equal, non-empty lists, got {len(scores)} and {len(baseline)}")
    return sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in zip(scores, baseline)) / len(scores)


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


@dataclass(frozen=True)
class PromptScores:
    """Per-prompt scores of one policy's samples, in prompt order (what a paired comparison of two policies on the
    same prompts needs; the means are ``gold_reward`` and ``rm_reward``)."""

    gold: list[float]
    """Gold-judge score of each prompt's sample."""
    rm: list[float]
    """Learned reward-model score of each prompt's sample."""


@dataclass(frozen=True)
class PairedTest:
    """Paired bootstrap test (Koehn 2004, "Statistical significance tests for machine translation evaluation") of
    ``mean(scores - baseline) > 0`` over the same prompts."""

    n: int
    """Prompts compared."""
    gain: float
    """Mean per-prompt difference, scores - baseline."""
    low: float
    """Lower end of the two-sided ``confidence`` interval of the gain (bootstrap percentiles)."""
    high: float
    """Upper end of that interval."""
    p_value: float
    """One-sided: the share of resamples in which the scores do not win, ``(1 + #{mean <= 0}) / (1 + samples)``."""


def paired_bootstrap(scores: Sequence[float], baseline: Sequence[float], samples: int = 10_000, seed: int = 0,
                     confidence: float = 0.95) -> PairedTest:
    """Resample the prompts with replacement ``samples`` times (numpy PCG64 seeded with ``seed``: the same
    resamples on every machine) and count how often the mean difference fails to be positive.

    ``scores`` and ``baseline`` are paired per prompt (N,). A small p-value says the gain is larger than what
    the choice of prompts alone would produce; identical lists give p = 1."""
    import numpy as np

    diff = np.asarray(scores, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)  # (N,)
    if diff.ndim != 1 or len(diff) == 0 or len(scores) != len(baseline):
        raise ValueError(f"paired_bootstrap needs two equal, non-empty lists, got {len(scores)} and {len(baseline)}")
    if samples < 1 or not 0 < confidence < 1:
        raise ValueError(f"paired_bootstrap: samples={samples} must be >= 1, confidence={confidence} in (0, 1)")
    rows = np.random.default_rng(seed).integers(0, len(diff), size=(samples, len(diff)))  # (S, N) prompt indices
    means = diff[rows].mean(axis=1)  # (S,)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairedTest(n=len(diff), gain=float(diff.mean()), low=float(low), high=float(high),
                      p_value=float((1 + np.count_nonzero(means <= 0)) / (1 + samples)))


def evaluate_policy(policy, reference, tokenizer, prompts: Sequence[str], heldout_texts: Sequence[str],
                    gold: Callable[[list[str]], list[float]], learned: Callable[[list[str]], list[float]],
                    baseline_gold: Sequence[float] | None = None, max_new_tokens: int = 20, batch_size: int = 64,
                    seed: int = 0) -> tuple[dict[str, float], Samples, PromptScores]:
    """All metrics of one policy: (metrics, samples, per-prompt gold and reward-model scores).

    ``baseline_gold`` = the reference policy's per-sample gold scores on the same prompts (for the win
    rate); without it the policy is the baseline and its win rate is 0.5.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    samples = sample_responses(policy, tokenizer, prompts, max_new_tokens, batch_size, seed)
    scores = PromptScores(gold=[float(g) for g in gold(samples.texts)], rm=[float(r) for r in learned(samples.texts)])
    gold_scores = scores.gold
    metrics = {
        "gold_reward": mean(gold_scores),
        "rm_reward": mean(scores.rm),
        "kl": 0.0 if policy is reference else kl_to_reference(policy, reference, samples, pad_id, batch_size),
        "perplexity": perplexity(policy, tokenizer, heldout_texts, batch_size),
        "win_rate": 0.5 if baseline_gold is None else win_rate(gold_scores, baseline_gold),
    }
    return metrics, samples, scores
