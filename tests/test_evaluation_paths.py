"""Issue 31: evaluation, sample windows and serving sample and score through the trainers' one path
(``generation.sample_completions`` and ``forward.response_forward``), and give what the eager path gave."""

from __future__ import annotations

import math

import torch

from rlhf_core import evaluation
from rlhf_core.core import sequence_logprobs, shifted_token_logprobs
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

TEXTS = ["this movie was great and I loved it", "a terrible boring film", "the acting was fine",
         "I would watch it again"] * 20
PROMPTS = ["this movie", "a terrible", "the acting was", "I"] * 4


def _model():
    tokenizer = build_tokenizer(TEXTS, vocab_size=300, padding_side="left")
    return tiny_causal_lm(tokenizer, arch="gpt2", hidden_size=32, num_layers=2, num_heads=2, max_positions=64,
                          seed=0), tokenizer


def _eager_samples(model, tokenizer, prompts, max_new_tokens, seed):
    """What evaluation sampled before: ``model.generate`` on left-padded prompts, cut after the first EOS."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    rows = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    torch.manual_seed(seed)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                         **({"suppress_tokens": [pad]} if pad != eos else {}))
    responses = []
    for row in out[:, width:]:
        hits = (row == eos).nonzero()
        row = row[: int(hits[0]) + 1] if len(hits) else row
        responses.append(row[row != pad] if pad != eos else row)
    return responses


def test_evaluation_samples_the_tokens_generate_samples_and_restores_the_rng():
    model, tokenizer = _model()
    before = torch.random.get_rng_state()
    samples = evaluation.sample_responses(model, tokenizer, PROMPTS, max_new_tokens=12, batch_size=64, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's stream is untouched
    eager = _eager_samples(model, tokenizer, PROMPTS, 12, seed=3)
    assert [r.tolist() for r in samples.response_ids] == [r.tolist() or [tokenizer.eos_token_id] for r in eager]


def test_response_logprobs_and_perplexity_match_the_full_logits_forward():
    """The chunked forward against the old full fp32 (B, T, V) log-softmax: equal to fp32 rounding (1e-4 on sums of
    ~12 token log-probs of a few units each); the perplexity is a sum of per-row sums, no longer a function of the
    batch size."""
    model, tokenizer = _model()
    samples = evaluation.sample_responses(model, tokenizer, PROMPTS, max_new_tokens=12, seed=1)
    pad = tokenizer.pad_token_id
    got = evaluation.response_logprobs(model, samples.query_ids, samples.response_ids, pad)
    for q, r, value in zip(samples.query_ids, samples.response_ids, got):
        ids = torch.cat([q, r])[None]
        with torch.no_grad():
            token_logprobs = shifted_token_logprobs(model(input_ids=ids).logits.float(), ids)  # (1, T-1)
        mask = torch.zeros_like(token_logprobs)
        mask[0, len(q) - 1:] = 1
        assert math.isclose(float(value), float(sequence_logprobs(token_logprobs, mask)[0]), abs_tol=1e-4)
    # per-row sums, so no batch-dependent accumulation (a GEMM's blocking may still move the last bit on some CPUs)
    assert math.isclose(evaluation.perplexity(model, tokenizer, TEXTS, batch_size=64),
                        evaluation.perplexity(model, tokenizer, TEXTS, batch_size=5), rel_tol=1e-6)
