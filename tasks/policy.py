"""What the policy stages share: the enable switch (a placeholder for a disabled stage) and the TRL-1.16-style
Trainer run of ``grpo``/``rloo``/``kto`` (config from the section, resume/stop plumbing, metrics, plot, card);
the ``grpo``/``rloo`` stages themselves are in tasks/online.py.

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


def load_sft_policy(root: Path, sft_dir: str) -> tuple[Any, Any]:
    """``(tokenizer, causal LM)`` of the SFT policy the policy stages start from; pad = EOS when it has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / sft_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, AutoModelForCausalLM.from_pretrained(root / sft_dir)


def trainer_arguments(config_cls: type, section: Any, output_dir: Path, **extra: Any) -> Any:
    """The TRL-1.16 config (``GRPOConfig``/``RLOOConfig``/``KTOConfig``) from the section's config keys, plus the
    pipeline's fixed choices: no reporters (the stage run's tracker logs), resumable checkpoints, log every step."""
    from tasks.logs import on_terminal
    from tasks.resume import checkpointing_arguments

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


__all__ = ["PLACEHOLDER", "curve_rows", "disabled_placeholder", "is_placeholder", "last_fifth_mean", "load_sft_policy",
           "train_policy", "trainer_arguments"]
