"""The registry's paired bootstrap test (rlhf_core.evaluation.paired_bootstrap) against a naive float64 loop."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf_core.evaluation import paired_bootstrap


def naive(scores, baseline, samples, seed, confidence=0.95):
    """Resample prompt indices (the same PCG64 stream), average the differences one resample at a time."""
    rng = np.random.default_rng(seed)
    n = len(scores)
    rows = rng.integers(0, n, size=(samples, n))
    means = []
    for row in rows:
        total = 0.0
        for i in row:
            total += float(scores[i]) - float(baseline[i])
        means.append(total / n)
    not_better = sum(1 for mean in means if mean <= 0)
    tail = (1 - confidence) / 2
    low, high = np.quantile(np.array(means), [tail, 1 - tail])
    gain = sum(a - b for a, b in zip(scores, baseline)) / n
    return gain, low, high, (1 + not_better) / (1 + samples)


def test_matches_a_naive_loop():
    rng = np.random.default_rng(7)
    scores, baseline = rng.normal(0.1, 0.5, 40).tolist(), rng.normal(0.0, 0.5, 40).tolist()
    test = paired_bootstrap(scores, baseline, samples=500, seed=3)
    gain, low, high, p = naive(scores, baseline, 500, 3)
    assert test.n == 40
    assert test.gain == pytest.approx(gain, abs=1e-12)
    assert (test.low, test.high) == pytest.approx((low, high), abs=1e-12)  # float64 sums in another order only
    assert test.p_value == p


def test_identical_policies_never_win_and_a_consistent_gain_always_does():
    same = paired_bootstrap([0.3, -0.2, 0.5], [0.3, -0.2, 0.5], samples=99)
    assert same.p_value == 1.0 and same.gain == 0.0 and same.low == same.high == 0.0
    better = paired_bootstrap([0.4, -0.1, 0.6], [0.3, -0.2, 0.5], samples=99)
    assert better.p_value == pytest.approx(1 / 100)  # (1 + 0) / (1 + 99): never zero
    assert better.gain == pytest.approx(0.1) and better.low == pytest.approx(0.1)


def test_a_few_thousandths_on_four_hundred_noisy_prompts_is_noise():
    """The issue's case: policies 0.001-0.007 apart in mean gold reward over 400 prompts."""
    rng = np.random.default_rng(0)
    baseline = rng.uniform(-1, 1, 400)
    scores = baseline + rng.normal(0.005, 0.4, 400)  # per-prompt spread of sampled responses
    test = paired_bootstrap(scores.tolist(), baseline.tolist(), samples=2000)
    assert abs(test.gain) < 0.05 and test.p_value > 0.05 and test.low < 0 < test.high


def test_same_seed_same_answer_and_bad_input_is_named():
    a, b = [0.1, 0.4, -0.3, 0.2], [0.0, 0.5, -0.4, 0.1]
    assert paired_bootstrap(a, b, seed=5) == paired_bootstrap(a, b, seed=5)
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_bootstrap([0.1, 0.2], [0.1])
    with pytest.raises(ValueError, match="samples=0"):
        paired_bootstrap(a, b, samples=0)
