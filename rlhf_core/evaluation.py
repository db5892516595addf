"""Policy evaluation: sampling, gold/learned reward, KL to a reference, perplexity, win rate; for verifiable tasks
with n samples per problem, pass@k (unbiased), pass@1 and maj@k.

Pure-ish: models and texts in, numbers and texts out; no files, no trackers. ``B`` batch, ``T`` sequence,
``A`` response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from rlhf_core.core import sequence_logprobs
from rlhf_core.models.padding import pad_id_of
from rlhf_core.rewards.answers import parse_number
from rlhf_core.rewards.verifiers import verify
from rlhf_core.trainers.experience import build_causal_batch
from rlhf_core.trainers.forward import response_forward
from rlhf_core.trainers.generation import sample_completions


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


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 20, batch_size: int = 64,
                     seed: int = 0, should_stop: Callable[[], bool] | None = None) -> Samples:
    """Pure sampling (no top-k/top-p) of up to ``max_new_tokens`` per prompt, cut after the first EOS, through the
    trainers' one sampling path (``generation.sample_completions``: static KV cache, CUDA graphs and the bf16
    sampling copy on a GPU; the same tokens as ``generate`` on the CPU).

    Seeded, so two policies are compared on the same random stream (the caller's stream is restored). The pad token
    is never sampled; an empty response becomes a lone EOS. ``should_stop`` (optional) is asked after each new
    token: True ends the generation there (a server cancelling a request that ran past its time; the caller knows the
    answers are then cut short). It is a ``generate`` stopping criterion, so such a call samples through ``generate``
    (counted in ``DECODE_STATS``).
    """
    model.eval()
    eos = tokenizer.eos_token_id
    extra = {} if should_stop is None else {"stopping_criteria": _stopping_criteria(should_stop)}
    device = next(model.parameters()).device
    query_ids = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        completions = sample_completions(model, tokenizer, query_ids, device=device, batch_size=batch_size,
                                         do_sample=True, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                         eos_token_id=eos, **extra)
    finally:
        torch.random.set_rng_state(generator_state)
    response_ids = [r.cpu() if len(r) else torch.tensor([eos]) for r in completions.responses]
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
    """Sum of log p(response token | prefix) per sample under ``model``, through the trainers' one forward
    (``forward.response_forward``: log-softmax in chunks, never the fp32 (B, T, V) logits): returns (N,)."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(query_ids), batch_size):
        qs = [q.to(device) for q in query_ids[start:start + batch_size]]
        rs = [r.to(device) for r in response_ids[start:start + batch_size]]
        batch = build_causal_batch(qs, rs, pad_id, left_pad=False)
        scored = response_forward(model, batch)  # (B, A)
        out.append(sequence_logprobs(scored.logprobs, batch.response_mask).cpu())  # (B,)
    return torch.cat(out)


def kl_to_reference(policy, reference, samples: Samples, pad_id: int, batch_size: int = 64) -> float:
    """Monte-Carlo KL(policy || reference) per response: mean over policy samples of sum_t (log p - log q)."""
    logp = response_logprobs(policy, samples.query_ids, samples.response_ids, pad_id, batch_size)  # (N,)
    logq = response_logprobs(reference, samples.query_ids, samples.response_ids, pad_id, batch_size)  # (N,)
    return float((logp - logq).mean())


@torch.no_grad()
def perplexity(model, tokenizer, texts: Sequence[str], batch_size: int = 64, max_length: int = 128) -> float:
    """exp(mean token negative log-likelihood) over ``texts`` (EOS appended, the first token not scored), through
    the same forward as :func:`response_logprobs` (each text's first token is the prompt, the rest is scored)."""
    rows = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids[0]
        if tokenizer.eos_token_id is not None:
            ids = torch.cat([ids, torch.tensor([tokenizer.eos_token_id])])
        rows.append(ids[:max_length])
    scored = [r for r in rows if len(r) > 1]  # a one-token text has nothing to score
    if not scored:
        return 1.0
    total = response_logprobs(model, [r[:1] for r in scored], [r[1:] for r in scored], pad_id_of(tokenizer),
                              batch_size)  # (N,)
    tokens = sum(len(r) - 1 for r in scored)
    return math.exp(-float(total.double().sum()) / tokens)


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


# ---- verifiable tasks: n samples per problem, c of them correct


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from ``n`` samples of which ``c`` are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): the chance that ``k`` samples drawn without replacement from the ``n``
    hold at least one correct one, ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    # exact rational arithmetic, rounded once: the nearest float on every machine. comb(n - c, k) is 0 when
    # n - c < k (every k-subset holds a correct sample): pass@k = 1.
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
    """pass@k averaged over problems, each given as ``(n, c)``; with ``k = 1`` it is pass@1, the mean of c / n."""
    if not counts:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return math.fsum(pass_at_k(n, c, k) for n, c in counts) / len(counts)


def pass_at_1(counts: Sequence[tuple[int, int]]) -> float:
    """The mean over problems of c / n (``(n, c)`` per problem): the expected accuracy of one sample."""
    return mean_pass_at_k(counts, 1)


def majority_answer(answers: Sequence[Any]) -> Any:
    """The most frequent answer that is not None (ties: the one seen first); None when every answer is None."""
    votes: dict[Any, int] = {}
    for answer in answers:
        if answer is not None:
            votes[answer] = votes.get(answer, 0) + 1
    return max(votes, key=votes.__getitem__) if votes else None  # max keeps the first of equal counts


def maj_at_k(answers: Sequence[Any], correct: Sequence[bool], k: int) -> float:
    """maj@k of one problem: 1.0 if the majority vote over the first ``k`` samples' (normalised, hashable) answers
    is a correct answer, else 0.0. ``answers[i]`` is sample i's answer (None: it stated none) and ``correct[i]``
    whether it is right; samples without an answer do not vote, and if none answers the vote is lost."""
    if len(answers) != len(correct) or not 1 <= k <= len(answers):
        raise ValueError(f"maj_at_k needs equal lists of at least k={k} samples, got {len(answers)} and {len(correct)}")
    winner = majority_answer(answers[:k])
    if winner is None:
        return 0.0
    return float(next(bool(ok) for a, ok in zip(answers[:k], correct[:k]) if a == winner))


@dataclass(frozen=True)
class VerifiedSamples:
    """A verifiable evaluation: ``n`` samples per problem judged by a verifier."""

    metrics: dict[str, float]
    """``pass@1``, ``pass@<k>`` and ``maj@<k>`` for each k, ``format_error_rate`` (share of samples stating no
    readable answer) and ``mean_length`` (completion tokens)."""
    per_problem: list[float]
    """Each problem's c / n in problem order: what the gate's paired bootstrap compares between two policies."""
    verdicts: list[dict[str, Any]]
    """One row per sample: ``problem_id``, ``sample``, ``solution``, ``completion``, ``answer`` (as written, or
    empty), ``correct``, ``format_ok`` and ``length``: the record a reviewer can open."""


def verify_samples(problem_ids: Sequence[str], solutions: Sequence[Any], completions: Sequence[Sequence[str]],
                   lengths: Sequence[Sequence[int]], ks: Sequence[int]) -> VerifiedSamples:
    """Judge ``completions[i]`` (the n samples of problem i, all problems with the same n) against
    ``solutions[i]`` with ``rlhf_core.rewards.verify``; pass@k (unbiased) and maj@k for every k in ``ks``.
    A problem whose solution has no readable number is an error: it cannot be scored."""
    sizes = {len(c) for c in completions}
    if len(sizes) != 1 or len(problem_ids) != len(solutions) or len(solutions) != len(completions):
        raise ValueError(f"verify_samples needs one list of n completions per problem (same n), got "
                         f"{len(problem_ids)} ids, {len(solutions)} solutions and sample counts {sorted(sizes)}")
    n = sizes.pop()
    if any(not 1 <= k <= n for k in ks):
        raise ValueError(f"every k must be in [1, n={n}], got {list(ks)}")
    counts, majority, rows = [], {k: [] for k in ks}, []
    for pid, solution, samples, sample_lengths in zip(problem_ids, solutions, completions, lengths):
        verdicts = [verify(text, solution) for text in samples]
        if verdicts[0].correct is None:
            raise ValueError(f"problem {pid!r}: its solution {solution!r} has no readable number")
        correct = [bool(v.correct) for v in verdicts]
        counts.append((n, sum(correct)))
        answers = [parse_number(v.answer) for v in verdicts]
        for k in ks:
            majority[k].append(maj_at_k(answers, correct, k))
        rows += [{"problem_id": pid, "sample": j, "solution": str(solution), "completion": text,
                  "answer": v.answer or "", "correct": v.correct, "format_ok": v.format_ok, "length": int(length)}
                 for j, (text, v, length) in enumerate(zip(samples, verdicts, sample_lengths))]
    metrics = {"pass@1": pass_at_1(counts), **{f"pass@{k}": mean_pass_at_k(counts, k) for k in ks if k != 1},
               **{f"maj@{k}": math.fsum(v) / len(v) for k, v in majority.items()},
               "format_error_rate": sum(not r["format_ok"] for r in rows) / len(rows),
               "mean_length": math.fsum(r["length"] for r in rows) / len(rows)}
    return VerifiedSamples(metrics=metrics, per_problem=[c / n for n, c in counts], verdicts=rows)


def evaluate_policy(policy, reference, tokenizer, prompts: Sequence[str], heldout_texts: Sequence[str],
                    gold: Callable[[list[str]], list[float]], learned: Callable[[list[str]], list[float]],
                    baseline_gold: Sequence[float] | None = None, max_new_tokens: int = 20, batch_size: int = 64,
                    seed: int = 0) -> tuple[dict[str, float], Samples, PromptScores]:
    """All metrics of one policy: (metrics, samples, per-prompt gold and reward-model scores).

    ``baseline_gold`` = the reference policy's per-sample gold scores on the same prompts (for the win
    rate); without it the policy is the baseline and its win rate is 0.5.
    """
    pad_id = pad_id_of(tokenizer)
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
