"""What the ``grpo`` and ``rloo`` stages share: a TRL-1.16 trainer that samples a group of completions per training
prompt, scored by a text reward (the learned reward model, as PPO, or the gold judge), with a KL penalty to the SFT
reference. The two stages differ only in the trainer and config class (``tasks/stages/grpo.py``, ``rloo.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rlhf_core.data import read_jsonl
from rlhf_core.rewards import accuracy_reward, make_reward
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import ConfigSection, PolicySwitch
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.policy import last_fifth_mean, load_sft_policy, train_policy, trainer_arguments
from tasks.stages.common.problems import solutions_of

ONLINE_REWARDS = ("reward_model", "gold", "verifier")
"""What GRPO/RLOO optimise: the learned reward model (``models/reward_model``), the gold judge (VADER), or the
verifier (``rlhf_core.rewards.accuracy_reward`` on each prompt's ``solution``: the arithmetic task)."""


@dataclass(frozen=True)
class OnlineStageParams(PolicySwitch):
    """The grpo/rloo sections' keys that are not ``GRPOConfig``/``RLOOConfig`` fields."""

    reward: str
    """``reward_model`` (the learned RM, as PPO) or ``gold`` (VADER: a verifiable reward, for experiments)."""


class GroupSampledParams(ConfigSection):
    """A grpo/rloo section: the trainer config's keys + :class:`OnlineStageParams`, and their shared rules."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("per_device_train_batch_size", "max_completion_length", "num_iterations"),
        positive_floats=("learning_rate", "epsilon", "temperature"),
        non_negative_floats=("beta",))
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    def problems(self, name: str) -> list[str]:
        return [message for broken, message in (
            (self.reward not in ONLINE_REWARDS, f"{name}.reward must be one of {ONLINE_REWARDS}"),
            (self.max_steps < 1, f"{name}.max_steps must be >= 1"),
            (self.num_generations < 2, f"{name}.num_generations must be >= 2"),
            (self.per_device_train_batch_size % self.num_generations != 0,
             f"{name}.per_device_train_batch_size must be a multiple of {name}.num_generations"),
        ) if broken]


COLUMNS = ("step", "reward", "reward_std", "kl", "loss", "entropy")
"""plots/grpo.csv and plots/rloo.csv: per optimizer step (``kl``: GRPO's per-token k3 mean, RLOO's per-sequence sum).
``reward``/``reward_std`` (and RLOO's ``kl``, part of its reward) are those of the completions the step optimises,
measured when they were generated (see :func:`fill_reused_batches`)."""

GENERATION_COLUMNS = ("reward", "reward_std", "kl")
"""Columns the trainers log only on the step that generates a batch (RLOO's ``kl`` enters its reward there)."""


def text_reward(spec: str, reward_model_path: Path) -> Callable[..., list[float]]:
    """A TRL ``reward_funcs`` callable scoring prompt + completion text with ``make_reward(spec)`` (as PPO does);
    ``verifier``: ``accuracy_reward``, which reads the dataset's ``solution`` column."""
    if spec == "verifier":
        return accuracy_reward
    scorer = make_reward(spec, reward_model_path=str(reward_model_path))

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(s) for s in scorer([p + c for p, c in zip(prompts, completions)])]

    reward.__name__ = spec  # the name in the trainer's ``rewards/<name>/mean`` metrics
    return reward


def fill_reused_batches(rows: list[dict], num_iterations: int) -> list[dict]:
    """Rows whose :data:`GENERATION_COLUMNS` are complete: with ``num_iterations`` > 1 one generated batch is
    optimised for ``num_iterations`` steps, and the trainers log its reward (and RLOO its KL) only at the first.
    The steps that re-use the batch get that batch's values: they are the rewards of what those steps optimise,
    not a guess (a blank cell is drawn as 0 by DVC's plots). A value logged on a re-use step is kept."""
    filled, batch = [], {}
    for i, row in enumerate(rows):
        if i % num_iterations == 0:  # the step that generated this block's batch
            batch = {k: row.get(k) for k in GENERATION_COLUMNS}
        filled.append({**row, **{k: batch[k] for k in GENERATION_COLUMNS if row.get(k) is None}})
    return filled


def train_group_sampled(ctx: StageContext, config_class: type, trainer_class: type) -> StageResult:
    """``trainer_class`` (``GRPOTrainer`` or ``RLOOTrainer``, TRL 1.16 API, configured by ``config_class``) on
    ``data/prompts_train.jsonl`` against ``<stage>.reward``; the model goes to ``models/<stage>``, the result to the
    wrapper."""
    from datasets import Dataset  # datasets and the trainers load transformers: only when the stage runs

    from rlhf_core import set_seed

    stage, p, run, prompts_path = ctx.stage.name, ctx.section, ctx.run, ctx.io.deps["prompts_train"]
    rows = read_jsonl(ctx.dep("prompts_train"))
    prompts = [r["query"] for r in rows]
    columns = {"prompt": prompts}
    if p.reward == "verifier":  # the verifier reads each prompt's answer (TRL's contract: a dataset column)
        columns["solution"] = solutions_of(rows, prompts_path)
    prompts_per_step = p.per_device_train_batch_size // p.num_generations
    if len(prompts) < prompts_per_step:
        raise ValueError(f"{prompts_path}: {len(prompts)} prompts, fewer than the {prompts_per_step} per step that "
                         f"{stage}.per_device_train_batch_size / {stage}.num_generations need")
    set_seed(p.seed)
    tokenizer, model = load_sft_policy(ctx.dep("sft"))
    reward = text_reward(p.reward, ctx.dep("reward_model"))
    run.log_dataset(ctx.dep("prompts_train"), "prompts_train")
    get_logger().info("%s: %d steps of %d completions (%d per prompt), reward=%s, beta=%g", stage, p.max_steps,
                      p.per_device_train_batch_size, p.num_generations, p.reward, p.beta)

    def build(ck):
        args = trainer_arguments(config_class, p, ck.dir)
        return trainer_class(
            model, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict(columns),
            processing_class=tokenizer, callbacks=[ck.callback], tracker=run.tracker)

    trained, rows = train_policy(ctx, build, (trainer_class.__name__,
                                              f"{ctx.io.deps['sft']} (SFT policy; also the KL reference)"))
    trainer = trained.trainer
    rows = fill_reused_batches(rows, p.num_iterations)
    metrics = {"enabled": True, "reward_mean_first": round(float(rows[0]["reward"]), 4),
               "reward_mean_last": last_fifth_mean(rows, "reward"), "kl_last": last_fifth_mean(rows, "kl"),
               "steps": trainer.state.global_step, "num_processes": trainer.args.world_size,
               "completions_per_step": p.per_device_train_batch_size * trainer.args.world_size}
    return StageResult(metrics, rows, finish=trained.finish)


__all__ = ["COLUMNS", "GENERATION_COLUMNS", "GroupSampledParams", "ONLINE_REWARDS", "OnlineStageParams",
           "fill_reused_batches", "text_reward", "train_group_sampled"]
