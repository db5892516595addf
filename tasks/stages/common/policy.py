"""What the policy stages share: the SFT policy they start from, and the TRL-1.16-style Trainer run of
``grpo``/``rloo``/``kto`` (config from the section, resume/stop plumbing, per-step curve, model and card)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tasks.process.logs import on_terminal
from tasks.store.outputs import atomic_dir
from tasks.spec.params import as_dict
from tasks.spec.stage import StageContext


def load_sft_policy(model_dir: Path) -> tuple[Any, Any]:
    """``(tokenizer, causal LM)`` of the SFT policy the policy stages start from; pad = EOS when it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: only when a stage trains

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, AutoModelForCausalLM.from_pretrained(model_dir)


def trainer_arguments(config_cls: type, section: Any, output_dir: Path, **extra: Any) -> Any:
    """The TRL-1.16 config (``GRPOConfig``/``RLOOConfig``/``KTOConfig``) from the section's config keys, plus the
    pipeline's fixed choices: no reporters (the stage run's tracker logs), resumable checkpoints, log every step."""
    from tasks.stages.common.resume import checkpointing_arguments  # tasks.stages.common.resume loads transformers: only when a stage trains

    return config_cls(output_dir=str(output_dir), **section.config, report_to=[], logging_steps=1,
                      disable_tqdm=not on_terminal(), dataloader_num_workers=0, dataloader_pin_memory=False,
                      **checkpointing_arguments(), **extra)


def curve_rows(log_history: list[dict], columns: Sequence[str]) -> list[dict]:
    """One row per logged training step (``columns[0]`` must be ``step``), from ``trainer.state.log_history``."""
    keys = columns[1:]
    return [{"step": e["step"], **{k: e.get(k) for k in keys}} for e in log_history
            if "step" in e and any(k in e for k in keys) and "train_runtime" not in e]


def last_fifth_mean(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the last fifth of ``rows`` (at least one row); NaN when absent."""
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.fmean(values[-max(1, len(values) // 5):]), 4) if values else float("nan")


def train_policy(ctx: StageContext, build: Callable[[Any], Any], card: tuple[str, str]) -> tuple[Any, list[dict]]:
    """Train with the resumable Trainer plumbing and save the policy (model + tokenizer + card) in ``models/<stage>``.

    ``build(ck)``: the trainer, given the ``Resumable`` (its ``.dir`` is the output_dir, ``.callback`` must be
    among the callbacks). Returns the trainer and the per-step curve rows (the row's plot columns). SIGTERM ->
    ``Preempted`` (exit 75). The resumable state is removed here: the rows are all that is left to write."""
    from tasks.stages.common.resume import resumable_training  # tasks.stages.common.resume loads transformers: only when a stage trains

    run, section = ctx.run, ctx.section
    with resumable_training(ctx.stage.name, run, section) as ck, atomic_dir(ctx.out("model")) as out:
        trainer = build(ck)
        ck.train(trainer)
        rows = curve_rows(trainer.state.log_history, ctx.stage.plot_columns)
        trainer.save_model(str(out))
        trainer.processing_class.save_pretrained(str(out))
        run.write_model_card(out, card[0], card[1], as_dict(section), {"steps": trainer.state.global_step})
    ck.done()
    return trainer, rows


__all__ = ["curve_rows", "last_fifth_mean", "load_sft_policy", "train_policy", "trainer_arguments"]
