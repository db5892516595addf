"""Stage ``sft``: supervised fine-tuning of the policy on the review corpus.

Offline default (``sft.model_name: ''``): a byte-level BPE tokenizer trained on the corpus and a small
GPT-2-shaped model built from the config in ``params.yaml:sft``. With a hub name or path (``gpt2``), the
same code fine-tunes that model. Writes ``models/sft`` (safetensors + tokenizer + model card); the wrapper writes
``metrics/sft.json`` and ``plots/sft.csv``.
"""

from __future__ import annotations

from typing import ClassVar

import math
from dataclasses import dataclass

from rlhf_core.data import read_jsonl
from tasks.process.logs import get_logger
from tasks.store.outputs import atomic_dir
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import as_dict
from tasks.spec.stage import StageContext, StageResult


@dataclass(frozen=True)
class SFTParams:
    """Supervised fine-tuning of the policy on the corpus (tokenizer trained on the corpus when offline)."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("vocab_size", "hidden_size", "num_layers", "num_heads", "max_positions", "max_seq_length",
                       "per_device_train_batch_size"),
        positive_floats=("learning_rate", "num_train_epochs"),
        non_negative_floats=("warmup_steps", "weight_decay"),
        choices={"arch": ("gpt2", "llama")})
    """Value rules of the section (tasks/spec/param_rules.py applies them); ``arch``: what rlhf_core/models/tiny.py
    builds."""

    model_name: str
    """Empty: build a small model from the config below; else a hub name or local path (e.g. ``gpt2``)."""
    arch: str
    """Architecture of the built model: ``gpt2`` or ``llama``."""
    vocab_size: int
    """Byte-level BPE vocabulary trained on the corpus (built model only)."""
    hidden_size: int
    """Width of the built model."""
    num_layers: int
    """Transformer blocks of the built model."""
    num_heads: int
    """Attention heads of the built model."""
    max_positions: int
    """Context length of the built model."""
    max_seq_length: int
    """SFT truncates training texts to this many tokens."""
    learning_rate: float
    """AdamW learning rate."""
    num_train_epochs: float
    """Passes over the corpus."""
    per_device_train_batch_size: int
    """Batch size."""
    warmup_steps: float
    """Linear warm-up: a share of the steps when < 1, else a step count (TrainingArguments.warmup_steps)."""
    weight_decay: float
    """AdamW weight decay."""
    seed: int
    """Seed for initialisation and data order."""

    def problems(self, name: str) -> list[str]:
        """The built model splits its width evenly over its heads."""
        return [f"{name}.hidden_size must be divisible by {name}.num_heads"] if self.hidden_size % self.num_heads else []


COLUMNS = ("step", "loss")
"""plots/sft.csv: the training loss per logged step."""
PLOT = dict(title="SFT training loss", x="step", y="loss")
"""DVC's options of ``plots/sft.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def build_policy(p: SFTParams, texts: list[str]):
    """(model, tokenizer): built from the config and the corpus, or loaded from ``p.model_name``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers: only when the stage runs

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    if p.model_name:
        tokenizer = AutoTokenizer.from_pretrained(p.model_name)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(p.model_name), tokenizer
    tokenizer = build_tokenizer(texts, vocab_size=p.vocab_size, padding_side="right")
    model = tiny_causal_lm(tokenizer, arch=p.arch, hidden_size=p.hidden_size, num_layers=p.num_layers,
                           num_heads=p.num_heads, max_positions=p.max_positions, seed=p.seed)
    return model, tokenizer


def body(ctx: StageContext) -> StageResult:
    """Train ``models/sft`` from ``data/sft_train.jsonl``."""
    from datasets import Dataset  # datasets and the trainer load transformers: only when the stage runs

    from rlhf_core import SFTTrainer, set_seed
    from tasks.stages.common.resume import checkpointing_arguments, loss_curve, resumable_training, training_arguments

    p, run, log = ctx.section, ctx.run, get_logger()
    texts = [r["text"] for r in read_jsonl(ctx.dep("sft_train"))]
    if not texts:
        raise ValueError(f"{ctx.io.deps['sft_train']}: no training texts")
    set_seed(p.seed)
    model, tokenizer = build_policy(p, texts)
    n_params = sum(t.numel() for t in model.parameters())
    log.info("sft: %d texts, model %s with %.2fM parameters", len(texts), p.model_name or f"tiny-{p.arch}", n_params / 1e6)
    run.log_dataset(ctx.dep("sft_train"), "sft_train")
    with resumable_training("sft", run, p) as ck, atomic_dir(ctx.out("model")) as out:
        trainer = SFTTrainer(
            model=model, args=training_arguments(ck.dir, p, **checkpointing_arguments()),
            train_dataset=Dataset.from_dict({"text": texts}), dataset_text_field="text",
            max_seq_length=p.max_seq_length, tokenizer=tokenizer, tracker=run.tracker, callbacks=[ck.callback])
        result = ck.train(trainer)  # resumes from .checkpoints/sft-*; SIGTERM -> Preempted (exit 75)
        curve = loss_curve(trainer.state.log_history)
        final_loss = curve[-1]["loss"] if curve else float(result.training_loss)
        metrics = {"train_loss": round(float(result.training_loss), 4), "final_loss": round(final_loss, 4),
                   "final_perplexity": round(math.exp(min(final_loss, 50.0)), 3),
                   "num_texts": len(texts), "num_parameters": n_params, "steps": trainer.state.global_step,
                   "num_processes": trainer.args.world_size}
        trainer.save_model(str(out))
        tokenizer.save_pretrained(str(out))
        run.write_model_card(out, "SFTTrainer", p.model_name or f"built from config (tiny {p.arch})", as_dict(p), metrics)
    return StageResult(metrics, curve, finish=ck.done)
