"""GRPO/RLOO with verifier rewards through TRL 1.16's contract: dataset columns as keywords, async functions,
None, per-function metrics, a failing or hanging verifier costing only its samples, DAPO's dynamic sampling."""

from __future__ import annotations

import asyncio
import math
import threading
from functools import partial

import pytest
import torch
from datasets import Dataset

from rlhf_core import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.rewards import accuracy_reward, get_soft_overlong_punishment
from tests._online_rl import PROMPTS, online_args, tok, train_logs  # noqa: F401  (tok: a fixture)

_args = partial(online_args, GRPOConfig)


def problems(n: int = 8) -> Dataset:
    """Prompts with a ``solution`` column (every third unreadable: accuracy_reward says None there)."""
    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n)],
                              "solution": [str(i) if i % 3 else "n/a" for i in range(n)]})


ROWS = [{"prompt": p, "solution": "1"} for p in ["The film was"] * 4 + ["A good"] * 4]


def test_verifiers_and_an_async_function_get_every_column_and_log_under_trl_names(tok, tmp_path):
    seen = {}

    async def async_has_e(prompts, completions, completion_ids, solution, trainer_state, log_metric, **kwargs):
        await asyncio.sleep(0)
        seen.update(solution=list(solution), ids=len(completion_ids), step=trainer_state.global_step)
        log_metric("async_calls", 1.0)
        return [1.0 if "e" in c else 0.0 for c in completions]

    overlong = get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=2)
    trainer = GRPOTrainer(tiny_causal_lm(tok), [accuracy_reward, async_has_e, overlong],
                          args=_args(tmp_path, max_steps=2, reward_weights=[1.0, 0.5, 0.2]),
                          train_dataset=problems(), processing_class=tok)
    trainer.train()
    assert len(seen["solution"]) == 8 and seen["ids"] == 8 and all(s == "n/a" or s.isdigit() for s in seen["solution"])
    logs = train_logs(trainer)
    for name in ("accuracy_reward", "async_has_e", "soft_overlong_punishment_reward"):
        assert all(math.isfinite(log[f"rewards/{name}/mean"]) and math.isfinite(log[f"rewards/{name}/std"])
                   for log in logs), name
        assert all(log[f"rewards/{name}/failures"] == 0 for log in logs)
    assert all(log["async_calls"] == 1.0 for log in logs)


def test_a_raising_verifier_costs_only_the_samples_it_fails_on(tok, tmp_path):
    def fails_on_the_second_prompt(prompts, completions, **kwargs):
        if "A good" in prompts:
            raise RuntimeError("verifier crashed")
        return [1.0] * len(completions)

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(tiny_causal_lm(tok), [fails_on_the_second_prompt, length], args=_args(tmp_path),
                          train_dataset=problems(), processing_class=tok)
    with pytest.warns(RuntimeWarning, match=r"'fails_on_the_second_prompt' failed on 4 sample\(s\).*verifier crashed"):
        per_func = trainer._rewards(ROWS, [r["prompt"] for r in ROWS], ["a"] * 8, [[0]] * 8, "train")
    assert per_func[:4, 0].tolist() == [1.0] * 4 and torch.isnan(per_func[4:, 0]).all()
    assert per_func[:, 1].tolist() == [1.0] * 8
    assert trainer._metrics["train"]["rewards/fails_on_the_second_prompt/failures"] == [4.0]
    trainer._metrics["train"].clear()
    trainer.train_dataset = Dataset.from_dict({"prompt": ["A good"] * 8})  # every training sample fails it
    with pytest.warns(RuntimeWarning, match="failed on 8 sample"):
        trainer.train()  # the run goes on, on the other function's rewards
    assert trainer.state.global_step == 2
    assert [log["rewards/fails_on_the_second_prompt/failures"] for log in train_logs(trainer)] == [8.0, 8.0]
    assert all(math.isfinite(log["reward"]) for log in train_logs(trainer))


def test_a_hanging_verifier_is_cut_off_by_reward_timeout(tok, tmp_path):
    release = threading.Event()

    def hangs_on_the_first_prompt(prompts, completions, **kwargs):
        if "The film was" in prompts:
            release.wait(30)
        return [2.0] * len(completions)

    trainer = GRPOTrainer(tiny_causal_lm(tok), hangs_on_the_first_prompt, args=_args(tmp_path, reward_timeout=0.2),
                          train_dataset=problems(), processing_class=tok)
    try:
        with pytest.warns(RuntimeWarning, match="failed on 4 sample.*TimeoutError"):
            per_func = trainer._rewards(ROWS, [r["prompt"] for r in ROWS], ["a"] * 8, [[0]] * 8, "train")
    finally:
        release.set()
    assert torch.isnan(per_func[:4, 0]).all() and per_func[4:, 0].tolist() == [2.0] * 4
    with pytest.raises(ValueError, match="reward_timeout must be > 0"):
        _args(tmp_path, reward_timeout=0)


def test_every_function_failing_everywhere_is_an_error_not_a_silent_zero(tok, tmp_path):
    def broken(**kwargs):
        raise KeyError("no column 'answer'")

    trainer = GRPOTrainer(tiny_causal_lm(tok), broken, args=_args(tmp_path), train_dataset=problems(),
                          processing_class=tok)
    with pytest.raises(RuntimeError, match="every reward function failed on every sample.*no column 'answer'"):
        with pytest.warns(RuntimeWarning):
            trainer._rewards(ROWS, [r["prompt"] for r in ROWS], ["a"] * 8, [[0]] * 8, "train")


@pytest.mark.parametrize("trainer_cls, config_cls", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_dynamic_sampling_leaves_all_equal_groups_out_of_the_loss(tok, tmp_path, trainer_cls, config_cls):
    def equal_in_the_first_group(prompts, completions, **kwargs):
        # the first prompt's group: all 1.0 (no signal); the second: distinct rewards
        return [1.0 if p == "The film was" else float(i) for i, p in enumerate(prompts)]

    args = online_args(config_cls, tmp_path, dynamic_sampling=True, beta=0.0)
    trainer = trainer_cls(tiny_causal_lm(tok), equal_in_the_first_group, args=args, train_dataset=problems(),
                          processing_class=tok)
    rollout = trainer._generate_and_score(ROWS, "train")
    mask = rollout.batch.response_mask  # (B, A)
    assert mask[:4].sum() == 0 and (mask[4:].sum(dim=1) > 0).all()
    assert rollout.num_items == mask.sum()
    assert trainer._metrics["train"]["dynamic_sampling/dropped_groups"] == [1.0]
    assert trainer._metrics["train"]["dynamic_sampling/frac_dropped"] == [0.5]
    trainer._metrics["train"].clear()
    off = trainer_cls(tiny_causal_lm(tok), equal_in_the_first_group, args=online_args(config_cls, tmp_path, beta=0.0),
                      train_dataset=problems(), processing_class=tok)
    assert (off._generate_and_score(ROWS, "train").batch.response_mask[:4].sum(dim=1) > 0).all()
    trainer.train()
    assert all("dynamic_sampling/dropped_groups" in log for log in train_logs(trainer))
