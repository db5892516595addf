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
