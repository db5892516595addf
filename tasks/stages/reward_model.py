"""Stage ``reward_model``: a pairwise reward model on the gold-labelled preference pairs.

Initialised from the SFT checkpoint (InstructGPT: the reward model starts from the supervised policy,
with a fresh one-output score head), or from ``reward_model.init_from`` when that names another model.
Writes ``models/reward_model``; the wrapper writes ``metrics/reward_model.json`` (including held-out pair accuracy
and its agreement with the gold judge) and ``plots/reward_model.csv``.
"""

from __future__ import annotations

from typing import ClassVar

import random
from dataclasses import dataclass

from rlhf_core.data import read_jsonl
from rlhf_core.rewards import RewardModelScorer
from tasks.process.logs import get_logger
from tasks.store.outputs import atomic_dir
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import as_dict
from tasks.spec.stage import StageContext, StageResult

HOLDOUT_SHARE = 0.1
COLUMNS = ("step", "loss")
"""plots/reward_model.csv: the pairwise loss per logged step."""
PLOT = dict(title="Reward model pairwise loss", x="step", y="loss")
"""DVC's options of ``plots/reward_model.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


@dataclass(frozen=True)
class RewardModelParams:
    """Pairwise reward model on the preference pairs, initialised from the SFT model (InstructGPT)."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("max_length", "per_device_train_batch_size"),
        positive_floats=("learning_rate", "num_train_epochs"))
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    init_from: str
    """``sft`` (the SFT checkpoint, as in InstructGPT) or a hub name / local path."""
    max_length: int
    """Chosen/rejected texts are truncated to this many tokens."""
    learning_rate: float
    """AdamW learning rate."""
    num_train_epochs: float
    """Passes over the pairs."""
    per_device_train_batch_size: int
    """Pairs per batch."""
    seed: int
    """Seed for the score head and data order."""


def body(ctx: StageContext) -> StageResult:
    """Train ``models/reward_model`` on ``data/preferences.jsonl``."""
    from datasets import Dataset  # datasets, transformers and the trainer: only when the stage runs
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_core import RewardTrainer, set_seed
    from tasks.stages.common.resume import checkpointing_arguments, loss_curve, resumable_training, training_arguments

    p, run, log = ctx.section, ctx.run, get_logger()
    pairs_path, sft_dir = ctx.io.deps["preferences"], ctx.io.deps["sft"]
    pairs = read_jsonl(ctx.dep("preferences"))
    if len(pairs) < 2:
        raise ValueError(f"{pairs_path}: need at least 2 preference pairs, found {len(pairs)}")
    base = str(ctx.dep("sft")) if p.init_from == "sft" else p.init_from
    random.Random(p.seed).shuffle(pairs)
    n_hold = max(1, int(len(pairs) * HOLDOUT_SHARE))
    held, train = pairs[:n_hold], pairs[n_hold:]

    set_seed(p.seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    run.log_dataset(ctx.dep("preferences"), "preferences")
    columns = ("prompt", "chosen", "rejected")
    dataset = Dataset.from_dict({c: [x[c] for x in train] for c in columns})
    log.info("reward_model: %d training pairs, %d held out, initialised from %s", len(train), len(held), base)
    with resumable_training("reward_model", run, p) as ck, atomic_dir(ctx.out("model")) as out:
        trainer = RewardTrainer(model=model, args=training_arguments(ck.dir, p, **checkpointing_arguments()),
                                train_dataset=dataset, tokenizer=tokenizer, max_length=p.max_length,
                                tracker=run.tracker, callbacks=[ck.callback])
        result = ck.train(trainer)  # resumes from .checkpoints/reward_model-*; SIGTERM -> Preempted (exit 75)
        curve = loss_curve(trainer.state.log_history)
        scorer = RewardModelScorer(trainer.model, tokenizer, max_length=p.max_length)
        chosen = scorer([x["prompt"] + x["chosen"] for x in held])
        rejected = scorer([x["prompt"] + x["rejected"] for x in held])
        metrics = {
            "train_loss": round(float(result.training_loss), 4),
            "heldout_accuracy": round(sum(c > r for c, r in zip(chosen, rejected)) / len(held), 4),
            "heldout_margin": round(sum(c - r for c, r in zip(chosen, rejected)) / len(held), 4),
            "num_train_pairs": len(train), "num_heldout_pairs": len(held), "steps": trainer.state.global_step,
            "num_processes": trainer.args.world_size,
        }
        trainer.save_model(str(out))
        tokenizer.save_pretrained(str(out))
        run.write_model_card(out, "RewardTrainer", base if p.init_from != "sft" else f"{sft_dir} (SFT policy)",
                             as_dict(p), metrics)
    log.info("reward_model: held-out accuracy %.3f", metrics["heldout_accuracy"])
    return StageResult(metrics, curve, finish=ck.done)
