"""What the policy stages share: the SFT policy they start from, and the TRL-1.16-style Trainer run of
``grpo``/``rloo``/``kto`` (config from the section, resume/stop plumbing, per-step curve, model and card)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhf_core.models.padding import ensure_pad_token
from tasks.process.logs import on_terminal
from tasks.spec.stage import StageContext


def load_sft_policy(model_dir: Path) -> tuple[Any, Any]:
    """``(tokenizer, causal LM)`` of the SFT policy the policy stages start from; pad = EOS when it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: only when a stage trains

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ensure_pad_token(tokenizer)
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


def last_fifth_mean(rows: list[dict], key: str) -> float | None:
    """Mean of ``key`` over the last fifth of ``rows`` (at least one row); None (JSON null: not measured, as GRPO's
    ``kl`` with ``beta`` 0) when no row has it. Never NaN, which is not JSON and which ``dvc metrics`` cannot read."""
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    return round(statistics.fmean(values[-max(1, len(values) // 5):]), 4) if values else None


def train_policy(ctx: StageContext, build: Callable[[Any], Any], card: tuple[str, str]) -> tuple[Any, list[dict]]:
    """``tasks.stages.common.resume.train_and_save`` for a TRL-1.16-style policy trainer (its card records the
    steps). Returns its ``Trained`` (``finish`` goes into the ``StageResult``: the resumable state is removed only
    once the stage's outputs are written) and the per-step curve rows (the row's plot columns)."""
    from tasks.stages.common.resume import train_and_save  # tasks.stages.common.resume loads transformers: only when a stage trains

    trained = train_and_save(ctx, build, card, lambda trainer, _: {"steps": trainer.state.global_step})
    return trained, curve_rows(trained.trainer.state.log_history, ctx.stage.plot_columns)


__all__ = ["curve_rows", "last_fifth_mean", "load_sft_policy", "train_policy", "trainer_arguments"]
