"""rlhf_core.rewards.contract: TRL 1.16's reward call (sync and async together, None, every column), and a
function that raises or hangs costing only its samples, never the run."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from rlhf_core.rewards import call_reward_funcs, is_async

KWARGS = dict(prompts=["p0", "p1", "p2"], completions=["a", "bb", "ccc"], completion_ids=[[1], [1, 2], [1, 2, 3]],
              solution=["1", "2", "3"], trainer_state=None)


def nan_equal(left, right):
    return all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(left, right, strict=True))


def length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def test_every_column_is_a_keyword_and_none_means_not_applicable():
    seen = {}

    def record(prompts, completions, completion_ids, solution, **kwargs):
        seen.update(prompts=prompts, solution=solution, extra=sorted(kwargs))
        return [None, 1, 2.5]

    call = call_reward_funcs([record, length], ["record", "length"], KWARGS, 3)
    assert seen == {"prompts": ["p0", "p1", "p2"], "solution": ["1", "2", "3"], "extra": ["trainer_state"]}
    assert nan_equal(call.values[0], [math.nan, 1.0, 2.5]) and call.values[1] == [1.0, 2.0, 3.0]
    assert call.failures == [0, 0] and call.errors == [None, None]


def test_async_functions_are_awaited_together():
    started = []

    async def slow_a(completions, **kwargs):
        started.append(time.monotonic())
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        started.append(time.monotonic())
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    assert is_async(slow_a) and not is_async(length)
    begin = time.monotonic()
    call = call_reward_funcs([slow_a, length, slow_b], ["a", "length", "b"], KWARGS, 3, timeout=5)
    elapsed = time.monotonic() - begin
    assert call.values == [[1.0] * 3, [1.0, 2.0, 3.0], [2.0] * 3]
    # together: about 0.3 s, not 0.6 (the bound leaves room for a loaded machine)
    assert elapsed < 0.55 and max(started) - min(started) < 0.2


def test_a_raising_function_costs_only_the_samples_it_fails_on():
    def fails_on_bb(completions, **kwargs):
        if "bb" in completions:
            raise ZeroDivisionError("bad sample")
        return [1.0] * len(completions)

    call = call_reward_funcs([fails_on_bb, length], ["fails_on_bb", "length"], KWARGS, 3)
    assert nan_equal(call.values[0], [1.0, math.nan, 1.0]) and call.values[1] == [1.0, 2.0, 3.0]
    assert call.failures == [1, 0] and call.errors[0] == "ZeroDivisionError: bad sample"


def test_a_hanging_function_is_abandoned_after_the_time_limit():
    release = threading.Event()

    def hangs_on_ccc(completions, **kwargs):
        if "ccc" in completions:
            release.wait(30)  # a hung verifier (released at the end so the thread ends)
        return [5.0] * len(completions)

    async def async_hangs(completions, **kwargs):
        if "ccc" in completions:
            await asyncio.sleep(30)
        return [6.0] * len(completions)

    begin = time.monotonic()
    call = call_reward_funcs([hangs_on_ccc, async_hangs], ["sync", "async"], KWARGS, 3, timeout=0.2)
    elapsed = time.monotonic() - begin
    release.set()
    assert nan_equal(call.values[0], [5.0, 5.0, math.nan]) and nan_equal(call.values[1], [6.0, 6.0, math.nan])
    assert call.failures == [1, 1] and "TimeoutError" in call.errors[0] and "TimeoutError" in call.errors[1]
    # the batch call, then one shared deadline for the per-sample calls: about 2 x 0.2 s per function
    assert elapsed < 3.0


def test_a_contract_breach_is_an_error_naming_the_function():
    with pytest.raises(ValueError, match="'short' returned 2 rewards for 3 completions"):
        call_reward_funcs([lambda **kw: [1.0, 2.0]], ["short"], KWARGS, 3)
    with pytest.raises(ValueError, match="'texty' returned 'x', not a number or None"):
        call_reward_funcs([lambda **kw: ["x", 1.0, 2.0]], ["texty"], KWARGS, 3)
    with pytest.raises(ValueError, match="'scalar' returned float"):
        call_reward_funcs([lambda **kw: 1.0], ["scalar"], KWARGS, 3)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        call_reward_funcs([length], ["length"], KWARGS, 3, timeout=0)
