"""Stages ``grpo`` and ``rloo``: GRPOTrainer / RLOOTrainer (TRL 1.16 API) on the training prompts against the
learned reward model (or the gold judge: ``<stage>.reward: gold``), KL to the SFT reference; each writes
``models/<stage>``, ``metrics/<stage>.json`` and ``plots/<stage>.csv``.

One run serves both methods (``online_policy_stage``); they differ only in the trainer and config class. Off when
``<stage>.enabled`` is false (placeholder outputs, see tasks/policy.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.logs import get_logger
from tasks.outputs import write_csv, write_json
from tasks.params import load_stage
from tasks.policy import disabled_placeholder, last_fifth_mean, load_sft_policy, train_policy, trainer_arguments


@task(name="grpo", cache_policy=NO_CACHE)  # training: no retries
def grpo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/grpo`` (group-relative advantages); returns metrics/grpo.json (``{"enabled": false}`` when off)."""
    return online_policy_stage("grpo", root, parent_run_id)


@task(name="rloo", cache_policy=NO_CACHE)  # training: no retries
def rloo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/rloo`` (leave-one-out baseline); returns metrics/rloo.json (``{"enabled": false}`` when off)."""
    return online_policy_stage("rloo", root, parent_run_id)


def text_reward(spec: str, reward_model_path: Path) -> Callable[..., list[float]]:
    """A TRL ``reward_funcs`` callable scoring prompt + completion text with ``make_reward(spec)`` (as PPO does)."""
    from rlhf_core.rewards import make_reward

    scorer = make_reward(spec, reward_model_path=str(reward_model_path))

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(s) for s in scorer([p + c for p, c in zip(prompts, completions)])]

    reward.__name__ = spec  # the name in the trainer's ``rewards/<name>/mean`` metrics
    return reward



ONLINE_COLUMNS = ("step", "reward", "reward_std", "kl", "loss", "entropy")
"""plots/grpo.csv and plots/rloo.csv: per optimizer step (``kl``: GRPO's per-token k3 mean, RLOO's per-sequence sum).
``reward``/``reward_std`` (and RLOO's ``kl``, part of its reward) are those of the completions the step optimises,
measured when they were generated (see :func:`fill_reused_batches`)."""

GENERATION_COLUMNS = ("reward", "reward_std", "kl")
"""Columns the trainers log only on the step that generates a batch (RLOO's ``kl`` enters its reward there)."""


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


def online_policy_stage(stage: str, root: str, parent_run_id: str | None) -> dict:
    """The ``grpo``/``rloo`` stage: ``<Stage>Trainer`` (TRL 1.16 API) on ``data/prompts_train.jsonl`` against
    ``<stage>.reward`` (the learned reward model by default, or the gold judge); writes ``models/<stage>``,
    ``metrics/<stage>.json`` and ``plots/<stage>.csv``."""
    if (skipped := disabled_placeholder(root, stage, ONLINE_COLUMNS)) is not None:
        return skipped
    from datasets import Dataset

    import rlhf_core
    from rlhf_core.data import read_jsonl
    from tasks.stage_run import stage_run

    root_path, params, p, io = load_stage(root, stage)
    prompts_path, sft_dir, rm_dir = io["deps"]
    prompts = [r["query"] for r in read_jsonl(root_path / prompts_path)]
    prompts_per_step = p.per_device_train_batch_size // p.num_generations
    if len(prompts) < prompts_per_step:
        raise ValueError(f"{prompts_path}: {len(prompts)} prompts, fewer than the {prompts_per_step} per step that "
                         f"{stage}.per_device_train_batch_size / {stage}.num_generations need")
    name = stage.upper()
    with stage_run(stage, root_path, p, io["deps"], parent_run_id) as run:
        rlhf_core.set_seed(p.seed)
        tokenizer, model = load_sft_policy(root_path, sft_dir)
        reward = text_reward(p.reward, root_path / rm_dir)
        run.log_dataset(root_path / prompts_path, "prompts_train")
        get_logger().info("%s: %d steps of %d completions (%d per prompt), reward=%s, beta=%g", stage, p.max_steps,
                          p.per_device_train_batch_size, p.num_generations, p.reward, p.beta)

        def build(ck):
            args = trainer_arguments(getattr(rlhf_core, f"{name}Config"), p, ck.dir)
            return getattr(rlhf_core, f"{name}Trainer")(
                model, reward_funcs=reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                processing_class=tokenizer, callbacks=[ck.callback], tracker=run.tracker)

        trainer, rows = train_policy(stage, root_path, run, p, build, io["outs"][0],
                                     (f"{name}Trainer", f"{sft_dir} (SFT policy; also the KL reference)"), ONLINE_COLUMNS)
        rows = fill_reused_batches(rows, p.num_iterations)
        metrics = {"enabled": True, "reward_mean_first": round(float(rows[0]["reward"]), 4),
                   "reward_mean_last": last_fifth_mean(rows, "reward"), "kl_last": last_fifth_mean(rows, "kl"),
                   "steps": trainer.state.global_step, "num_processes": trainer.args.world_size,
                   "completions_per_step": p.per_device_train_batch_size * trainer.args.world_size}
        write_json(root_path / io["metrics"][0], metrics)
        write_csv(root_path / io["plots"][0], rows, list(ONLINE_COLUMNS))
        run.log_metrics({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        run.summary.update(metrics)
    return metrics


__all__ = ["GENERATION_COLUMNS", "ONLINE_COLUMNS", "fill_reused_batches", "grpo_task", "online_policy_stage", "rloo_task", "text_reward"]
