"""Pure tensor helpers: masked ops against the plain op on the unmasked slice, small exact cases."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rlhf_core import core


def _values_and_mask():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -50.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1]])
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 7.0])
    return values, mask, kept


def test_masked_mean_equals_plain_mean_of_unmasked_slice():
    values, mask, kept = _values_and_mask()
    assert torch.isclose(core.masked_mean(values, mask), kept.mean())
    # per row: (1+2+3)/3 = 2, (4+5+7)/3 = 16/3
    assert torch.allclose(core.masked_mean(values, mask, axis=1), torch.tensor([2.0, 16.0 / 3.0]))


def test_masked_var_equals_plain_var_of_unmasked_slice():
    values, mask, kept = _values_and_mask()
    assert torch.isclose(core.masked_var(values, mask), kept.var(unbiased=True))
    assert torch.isclose(core.masked_var(values, mask, unbiased=False), kept.var(unbiased=False))


def test_masked_var_without_the_host_check_gives_nan_for_an_empty_mask_and_the_same_values_otherwise():
    values, mask = torch.tensor([1.0, 4.0, 2.0, 8.0]), torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert torch.equal(core.masked_var(values, mask, check=False), core.masked_var(values, mask))
    assert torch.equal(core.masked_var(values, torch.tensor([0, 1, 0, 0]), check=False), torch.tensor(0.0))
    assert torch.isnan(core.masked_var(values, torch.zeros(4), check=False))


def test_masked_var_edge_cases():
    with pytest.raises(ValueError, match="all-zero mask"):
        core.masked_var(torch.ones(3), torch.zeros(3))
    # a single value has zero spread (no division by zero)
    assert core.masked_var(torch.tensor([5.0, 9.0]), torch.tensor([1, 0])) == 0


def test_masked_whiten_matches_plain_whitening_on_slice():
    values, mask, kept = _values_and_mask()
    whitened = core.masked_whiten(values, mask)
    expected = (kept - kept.mean()) / torch.sqrt(kept.var() + 1e-8)
    assert torch.allclose(whitened[mask.bool()], expected, atol=1e-6)
    unshifted = core.masked_whiten(values, mask, shift_mean=False)
    assert torch.allclose(unshifted[mask.bool()], expected + kept.mean(), atol=1e-5)
    assert torch.equal(values, _values_and_mask()[0])  # input untouched


def test_whiten():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # mean 2.5, unbiased var 5/3
    assert torch.allclose(core.whiten(x), (x - 2.5) / math.sqrt(5 / 3 + 1e-8))
    assert torch.allclose(core.whiten(x, shift_mean=False), (x - 2.5) / math.sqrt(5 / 3 + 1e-8) + 2.5)


def test_logprobs_and_entropy_from_logits():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # probs [0.25, 0.75] and [0.5, 0.5]
    labels = torch.tensor([[1, 0]])
    assert torch.allclose(core.logprobs_from_logits(logits, labels), torch.log(torch.tensor([[0.75, 0.5]])))
    full = core.logprobs_from_logits(logits, None, gather=False)
    assert full.shape == (1, 2, 2) and torch.allclose(full.exp().sum(-1), torch.ones(1, 2))
    entropy = core.entropy_from_logits(logits)
    expected = torch.tensor([[-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]])
    assert torch.allclose(entropy, expected, atol=1e-6)


def test_entropy_matches_float64_for_large_logits():
    # Logits of magnitude ~300 over a GPT-2-sized vocabulary: logsumexp(l) - sum(softmax(l) * l) subtracts two
    # numbers near 300 in fp32 (error 1.1e-3 here); the shifted form keeps every term small (1e-7).
    g = torch.Generator().manual_seed(0)
    logits = 300.0 + 3.0 * torch.randn(4, 50257, generator=g)
    probs = torch.softmax(logits.double(), -1)
    expected = -(probs * torch.log_softmax(logits.double(), -1)).sum(-1)  # the definition, in float64
    assert (core.entropy_from_logits(logits).double() - expected).abs().max() < 1e-5
    assert core.entropy_from_logits(logits).dtype == torch.float32


def _scored_rows(dtype, seed=0, n=12, vocab=37, slots=15):
    """Logits (n, V) of ``dtype``, slot rows (slots,), tokens (slots,), upstream grads (slots,): as the trainers
    score them, each row once except padding slots, which repeat the row they were clamped to and get no gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(n, vocab, generator=g)).to(dtype)
    real = slots - 3
    rows = torch.cat([torch.randperm(n, generator=g).repeat(real // n + 1)[:real], torch.full((3,), n - 1)])
    tokens = torch.randint(0, vocab, (slots,), generator=g)
    grad = torch.randn(slots, generator=g)
    grad[real:] = 0.0  # the masked padding slots
    return logits, rows, tokens, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_chunked_token_logprobs_are_the_unchunked_numbers_bit_for_bit(dtype, chunk_rows):
    """Chunks only split rows: every row runs the same kernels on the same values as the unchunked ops (gather
    the rows, upcast, log_softmax, gather the token; and their backward), so forward and gradient are equal exactly.
    The row-wise kernels reduce each row by itself, whatever rows surround it, on every CPU kind."""
    logits, rows, tokens, grad = _scored_rows(dtype)
    plain = logits.clone().requires_grad_()
    expected = core.logprobs_from_logits(plain[rows], tokens)
    (expected * grad).sum().backward()
    chunked = logits.clone().requires_grad_()
    got = core.token_logprobs(chunked, rows, tokens, chunk_rows=chunk_rows)
    (got * grad).sum().backward()
    assert got.dtype == torch.float32 and chunked.grad.dtype == dtype
    assert torch.equal(got, expected) and torch.equal(chunked.grad, plain.grad)
    stats = core.rowwise_logit_stats(logits, rows, entropy=True, mean=True, chunk_rows=chunk_rows)
    assert torch.equal(stats["entropy"], core.entropy_from_logits(logits[rows]))
    assert torch.equal(stats["mean"], logits[rows].float().mean(-1))


def test_token_logprobs_against_a_float64_loop():
    logits, rows, tokens, grad = _scored_rows(torch.float64, seed=1)
    x = logits.clone().requires_grad_()
    out = core.token_logprobs(x, rows, tokens, chunk_rows=5)
    (out * grad).sum().backward()
    expected_grad = torch.zeros_like(logits)
    for s in range(len(rows)):  # d/dx_v of log softmax(x)_t = [v == t] - softmax(x)_v
        row = logits[rows[s]]
        log_z = math.log(sum(math.exp(float(v)) for v in row))
        assert abs(float(out[s]) - (float(row[tokens[s]]) - log_z)) < 1e-12
        probs = torch.tensor([math.exp(float(v) - log_z) for v in row], dtype=torch.float64)
        expected_grad[rows[s]] += grad[s] * (torch.nn.functional.one_hot(tokens[s], len(row)) - probs)
    torch.testing.assert_close(x.grad, expected_grad, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda t: core.token_logprobs(t, rows, tokens, 4), (logits.clone().requires_grad_(),))


def test_logit_chunk_rows_fits_the_byte_budget():
    assert core.logit_chunk_rows(50257) == core.LOGIT_CHUNK_BYTES // (4 * 50257)  # 1335 GPT-2 rows in 256 MiB
    assert core.logit_chunk_rows(1000, chunk_bytes=4000 * 3 + 5) == 3 and core.logit_chunk_rows(10**12) == 1


def test_logprobs_from_logits_is_fp32_for_half_inputs():
    logits = torch.randn(2, 3, 5).to(torch.bfloat16)
    assert core.logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float32


def test_sequence_logprobs_and_last_token_helpers():
    token_logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(core.sequence_logprobs(token_logprobs, mask), torch.tensor([-6.0, -1.0]))
    assert torch.allclose(core.sequence_logprobs(token_logprobs, mask, average=True), torch.tensor([-2.0, -0.5]))
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert core.last_token_index(right).tolist() == [1, 3]
    assert core.last_token_index(left).tolist() == [3, 3]
    scores = torch.tensor([[10.0, 11.0, 12.0, 13.0], [20.0, 21.0, 22.0, 23.0]])
    assert core.gather_last_token(scores, right).tolist() == [11.0, 23.0]
    assert core.gather_last_token(scores, left).tolist() == [13.0, 23.0]


def test_position_ids_ignore_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert core.position_ids_from_attention_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_clip_by_value_with_tensor_bounds():
    x = torch.tensor([-2.0, 0.5, 3.0])
    clipped = core.clip_by_value(x, torch.tensor([-1.0, 0.0, 0.0]), torch.tensor([1.0, 0.25, 5.0]))
    assert clipped.tolist() == [-1.0, 0.25, 3.0]


def test_flatten_stack_and_numpy_stats():
    assert core.flatten_dict({"a": {"b": 1, "c": {"d": 2}}, "e": 3}) == {"a/b": 1, "a/c/d": 2, "e": 3}
    stacked = core.stack_dicts([{"x": torch.tensor([1.0, 2.0])}, {"x": torch.tensor([3.0])}])
    assert stacked["x"].tolist() == [[1.0, 2.0], [3.0, core.WANDB_PADDING]]
    as_np = core.stats_to_np({"t": torch.tensor(2.0, dtype=torch.bfloat16), "v": torch.ones(2), "f": np.float32(1.5)})
    assert as_np["t"] == 2.0 and isinstance(as_np["t"], float)
    assert isinstance(as_np["v"], np.ndarray) and as_np["f"] == 1.5
    assert core.convert_to_scalar({"a": np.array([4.0]), "b": np.ones(3)})["a"] == 4.0


def test_length_sampler_stays_in_range():
    sampler = core.LengthSampler(2, 5)
    assert {sampler() for _ in range(200)} == {2, 3, 4}
    with pytest.raises(ValueError, match="min_value < max_value"):
        core.LengthSampler(5, 5)


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = core.top_k_top_p_filtering(logits, top_k=2)
    assert torch.isinf(top2[0, 2:]).all() and torch.isfinite(top2[0, :2]).all()
    # nucleus 0.7: 0.5 < 0.7, 0.5 + 0.3 crosses it, so the first two tokens stay
    nucleus = core.top_k_top_p_filtering(logits, top_p=0.7)
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()


def test_respond_to_batch_samples_the_requested_length(tokenizer):
    from rlhf_core.models.tiny import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    queries = torch.tensor([[5, 6, 7], [8, 9, 10]])
    torch.manual_seed(0)
    out = core.respond_to_batch(model, queries, txt_len=4)
    assert out.shape == (2, 4) and out.dtype == torch.long


def test_set_seed_reproduces_torch_and_numpy():
    core.set_seed(3)
    a = (torch.rand(2), np.random.rand(2))
    core.set_seed(3)
    b = (torch.rand(2), np.random.rand(2))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert F.softmax(torch.zeros(2), dim=0).sum() == 1  # sanity: torch still importable alongside numpy
