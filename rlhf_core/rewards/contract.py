"""Calling reward functions as TRL 1.16 does, without letting one of them end the run.

:func:`call_reward_funcs` calls every function with the same keyword arguments (``prompts``, ``completions``,
``completion_ids``, every dataset column, and what the trainer adds: ``trainer_state``, ``log_extra``,
``log_metric``). Plain functions run one after another; ``async def`` functions run together on one event loop
(``asyncio.gather``), as TRL 1.16 awaits them. ``None`` from a function means "not applicable" and becomes NaN.

A function that raises, or does not answer within ``timeout`` seconds, is called again on each sample alone, so
only the samples it fails on are lost (NaN, counted per function in :class:`RewardCall`). A function that
breaks the contract (a wrong number of rewards, a value that is not a number) is a bug, not a flaky verifier:
that raises ``ValueError`` naming it. With a ``timeout``, each call runs on a daemon thread the caller stops
waiting for: a hung function is abandoned (it cannot be killed), never waited on. Without one, plain functions
run on the caller's thread, exactly as TRL calls them.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

@dataclass
class RewardCall:
    """The rewards of one batch: ``values[f][b]`` (NaN: not applicable or failed), and per function the samples
    lost to an error or the time limit, with the first error seen."""

    values: list[list[float]]
    failures: list[int]
    errors: list[str | None] = field(default_factory=list)


def is_async(func: Any) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def _threads_until(jobs: list[Callable[[], Any]], timeout: float | None) -> list[Any]:
    """Every job on its own daemon thread, all started at once; each result or exception, a TimeoutError for
    those still running when ``timeout`` seconds have passed (None: wait for all)."""
    boxes: list[dict[str, Any]] = [{} for _ in jobs]

    def run(job: Callable[[], Any], box: dict[str, Any]) -> None:
        try:
            box["value"] = job()
        except BaseException as err:  # handed back below
            box["error"] = err

    threads = [threading.Thread(target=run, args=(job, box), daemon=True, name="reward-function")
               for job, box in zip(jobs, boxes)]
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return [TimeoutError(f"no answer within {timeout:g} s") if thread.is_alive() else box.get("error", box.get("value"))
            for thread, box in zip(threads, boxes)]


def _on_thread(job: Callable[[], Any], timeout: float | None) -> Any:
    """``job()`` on a daemon thread: its result, or its exception (a TimeoutError after ``timeout``) raised."""
    answer = _threads_until([job], timeout)[0]
    if isinstance(answer, BaseException):
        raise answer
    return answer


def _call_sync(func: Callable, kwargs: dict, timeout: float | None) -> Any:
    if timeout is None:
        return func(**kwargs)
    return _on_thread(lambda: func(**kwargs), timeout)


def _gather_async(calls: list[tuple[Callable, dict]], timeout: float | None) -> list[Any]:
    """Await every ``func(**kwargs)`` together on a fresh event loop (on its own thread, so a caller inside a
    running loop works too); each result, or the exception it raised (TimeoutError past ``timeout``)."""

    async def one(func: Callable, kwargs: dict) -> Any:
        return await asyncio.wait_for(func(**kwargs), timeout)

    async def everything() -> list[Any]:
        return await asyncio.gather(*(one(f, k) for f, k in calls), return_exceptions=True)

    # The loop's thread gets a little longer than the calls: wait_for ends them on time unless one blocks
    # the loop itself (synchronous work inside a coroutine); then every call still pending is abandoned.
    try:
        return _on_thread(lambda: asyncio.run(everything()), None if timeout is None else timeout + 1.0)
    except TimeoutError as err:
        return [err] * len(calls)


def _one_sample(kwargs: dict, index: int, size: int) -> dict:
    """The keyword arguments for sample ``index`` alone: every per-sample list cut to that sample."""
    return {k: v[index:index + 1] if isinstance(v, (list, tuple)) and len(v) == size else v
            for k, v in kwargs.items()}


def _as_floats(name: str, values: Any, size: int) -> list[float]:
    """A function's answer as ``size`` floats (None -> NaN); a ValueError naming it if the answer breaks the
    contract."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise ValueError(f"reward function {name!r} returned {type(values).__name__}; it must return a list of "
                         "floats (or None), one per completion")
    values = list(values)
    if len(values) != size:
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {size} completions; it must "
                         "return one per completion")
    floats = []
    for value in values:
        if value is None:
            floats.append(math.nan)
            continue
        try:
            number = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward function {name!r} returned {value!r}, not a number or None") from err
        floats.append(number)  # an infinity is left for the caller to mask and name (it knows the sample)
    return floats


def _per_sample(func: Callable, name: str, kwargs: dict, size: int, timeout: float | None
                ) -> tuple[list[float], int, str | None]:
    """Rewards from calling ``func`` on each sample alone (after the batch call failed); the failures and the
    first error. With a ``timeout`` the calls run together (threads, or one event loop for an async function)
    under one deadline, so a function that hangs on some samples costs ``timeout`` once and the others still
    answer; a verifier is then called concurrently, as pure functions can be."""
    singles = [_one_sample(kwargs, i, size) for i in range(size)]
    if is_async(func):
        answers = _gather_async([(func, s) for s in singles], timeout)
    elif timeout is not None:
        answers = _threads_until([partial(func, **single) for single in singles], timeout)
    else:
        answers = []
        for single in singles:
            try:
                answers.append(func(**single))
            except Exception as err:  # one sample's failure: recorded below
                answers.append(err)
    values, failures, first = [], 0, None
    for answer in answers:
        if isinstance(answer, BaseException):
            values.append(math.nan)
            failures += 1
            first = first or f"{type(answer).__name__}: {answer}"
        else:
            values.extend(_as_floats(name, answer, 1))
    return values, failures, first


def call_reward_funcs(funcs: Sequence[Callable], names: Sequence[str], kwargs: dict, size: int,
                      timeout: float | None = None) -> RewardCall:
    """Every function's rewards for a batch of ``size`` completions (see the module docstring)."""
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
    answers: dict[int, Any] = {}
    pending_async = [i for i, f in enumerate(funcs) if is_async(f)]
    for i, func in enumerate(funcs):
        if i not in pending_async:
            try:
                answers[i] = _call_sync(func, kwargs, timeout)
            except Exception as err:  # retried per sample below
                answers[i] = err
    if pending_async:
        results = _gather_async([(funcs[i], kwargs) for i in pending_async], timeout)
        answers.update(zip(pending_async, results))
    call = RewardCall(values=[], failures=[], errors=[])
    for i, (func, name) in enumerate(zip(funcs, names)):
        if isinstance(answers[i], BaseException):
            values, failed, error = _per_sample(func, name, kwargs, size, timeout)
            error = error or f"{type(answers[i]).__name__}: {answers[i]} (on the whole batch only)"
        else:
            values, failed, error = _as_floats(name, answers[i], size), 0, None
        call.values.append(values)
        call.failures.append(failed)
        call.errors.append(error)
    return call


__all__ = ["RewardCall", "call_reward_funcs", "is_async"]
