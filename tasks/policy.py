"""What the policy stages share: the enable switch (a placeholder for a disabled stage) and the TRL-1.16-style
Trainer run of ``grpo``/``rloo``/``kto`` (config from the section, resume/stop plumbing, metrics, plot, card).

A disabled stage (``enabled: false`` in its section) still runs and is recorded by DVC, in well under a second:
it writes ``models/<stage>/DISABLED`` (the whole output), ``metrics/<stage>.json`` = ``{"enabled": false}`` and a
header-only ``plots/<stage>.csv``, so ``dvc status`` is clean after the pipeline whatever the switches say.
``evaluate`` skips a placeholder (``is_placeholder``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasks.logs import get_logger
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import as_dict, load_stage, stage_enabled

PLACEHOLDER = "DISABLED"
"""File name that marks ``models/<stage>`` as the output of a disabled stage (no model inside)."""


def is_placeholder(model_dir: str | Path) -> bool:
    """True when ``model_dir`` is a disabled stage's placeholder (or missing), not a trained model."""
    model_dir = Path(model_dir)
    return (model_dir / PLACEHOLDER).exists() or not model_dir.is_dir()


def disabled_placeholder(root: str | Path, stage: str, plot_columns: Sequence[str]) -> dict | None:
    """If ``stage``'s section says ``enabled: false``: write its placeholder outputs and return its metrics
    (``{"enabled": False}``); else None (the caller trains)."""
    root_path, params, _, io = load_stage(root, stage)
    if stage_enabled(params, stage):
        return None
    for out in io["outs"]:
        with atomic_dir(root_path / out) as tmp:
            (tmp / PLACEHOLDER).write_text(f"{stage} is disabled ({stage}.enabled: false in params.yaml); "
                                           "no model was trained. evaluate and the registry skip it.\n")
    metrics = {"enabled": False}
    write_json(root_path / io["metrics"][0], metrics)
    write_csv(root_path / io["plots"][0], [], list(plot_columns))
    get_logger().info("%s: disabled (%s.enabled: false); placeholder outputs written", stage, stage)
    return metrics


def trainer_arguments(config_cls: type, section: Any, output_dir: Path, **extra: Any) -> Any:
    """The TRL-1.16 config (``GRPOConfig``/``RLOOConfig``/``KTOConfig``) from the section's config keys, plus the
    pipeline's fixed choices: no reporters (the stage run's tracker logs), resumable checkpoints, log every step."""
    from tasks.logs import on_terminal
    from tasks.resume import checkpointing_arguments

    return config_cls(output_dir=str(output_dir), **section.config, report_to=[], logging_steps=1,
                      disable_tqdm=not on_terminal(), dataloader_num_workers=0, dataloader_pin_memory=False,
                      **checkpointing_arguments(), **extra)


def text_reward(spec: str, reward_model_path: Path) -> Callable[..., list[float]]:
    """A TRL ``reward_funcs`` callable scoring prompt + completion text with ``make_reward(spec)`` (as PPO does)."""
    from rlhf_core.rewards import make_reward

    scorer = make_reward(spec, reward_model_path=str(reward_model_path))

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(s) for s in scorer([p + c for p, c in zip(prompts, completions)])]

    reward.__name__ = spec  # the name in the trainer's ``rewards/<name>/mean`` metrics
    return reward


def curve_rows(log_history: list[dict], columns: Sequence[str]) -> list[dict]:
    """One row per logged training step (``columns[0]`` must be ``step``), from ``trainer.state.log_history``."""
    keys = columns[1:]
    return [{"step": e["step"], **{k: e.get(k) for k in keys}} for e in log_history
            if "step" in e and any(k in e for k in keys) and "train_runtime" not in e]


def last_fifth_mean(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the last fifth of ``rows`` (at least one row); NaN when absent."""
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.fmean(values[-max(1, len(values) // 5):]), 4) if values else float("nan")


def train_policy(stage: str, root: Path, run: Any, section: Any, build: Callable[[Any], Any],
                 out_rel: str, card: tuple[str, str], plot_columns: Sequence[str]) -> tuple[Any, list[dict]]:
    """Train with the resumable Trainer plumbing and save the policy (model + tokenizer + card) in ``out_rel``.

    ``build(ck)``: the trainer, given the ``Resumable`` (its ``.dir`` is the output_dir, ``.callback`` must be
    among the callbacks). Returns the trainer and the per-step curve rows. SIGTERM -> ``Preempted`` (exit 75)."""
    from tasks.resume import resumable_training

    with resumable_training(stage, run, section) as ck, atomic_dir(root / out_rel) as out:
        trainer = build(ck)
        ck.train(trainer)
        rows = curve_rows(trainer.state.log_history, plot_columns)
        trainer.save_model(str(out))
        trainer.processing_class.save_pretrained(str(out))
        run.write_model_card(out, card[0], card[1], as_dict(section), {"steps": trainer.state.global_step})
    ck.done()
    return trainer, rows


ONLINE_COLUMNS = ("step", "reward", "reward_std", "kl", "loss", "entropy")
"""plots/grpo.csv and plots/rloo.csv: per optimizer step (``kl``: GRPO's per-token k3 mean, RLOO's per-sequence sum)."""


def online_policy_stage(stage: str, root: str, parent_run_id: str | None) -> dict:
    """The ``grpo``/``rloo`` stage: ``<Stage>Trainer`` (TRL 1.16 API) on ``data/prompts_train.jsonl`` against
    ``<stage>.reward`` (the learned reward model by default, or the gold judge); writes ``models/<stage>``,
    ``metrics/<stage>.json`` and ``plots/<stage>.csv``."""
    if (skipped := disabled_placeholder(root, stage, ONLINE_COLUMNS)) is not None:
        return skipped
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        tokenizer = AutoTokenizer.from_pretrained(root_path / sft_dir)
        model = AutoModelForCausalLM.from_pretrained(root_path / sft_dir)
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
        metrics = {"enabled": True, "reward_mean_first": round(float(rows[0]["reward"]), 4),
                   "reward_mean_last": last_fifth_mean(rows, "reward"), "kl_last": last_fifth_mean(rows, "kl"),
                   "steps": trainer.state.global_step, "num_processes": trainer.args.world_size,
                   "completions_per_step": p.per_device_train_batch_size * trainer.args.world_size}
        write_json(root_path / io["metrics"][0], metrics)
        write_csv(root_path / io["plots"][0], rows, list(ONLINE_COLUMNS))
        run.log_metrics({f"final/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))})
        run.summary.update(metrics)
    return metrics


__all__ = ["ONLINE_COLUMNS", "online_policy_stage", "PLACEHOLDER", "curve_rows", "disabled_placeholder", "is_placeholder", "last_fifth_mean",
           "text_reward", "train_policy", "trainer_arguments"]
