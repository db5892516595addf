"""Stage ``sft``: supervised fine-tuning of the policy on the review corpus.

Offline default (``sft.model_name: ''``): a byte-level BPE tokenizer trained on the corpus and a small
GPT-2-shaped model built from the config in ``params.yaml:sft``. With a hub name or path (``gpt2``), the
same code fine-tunes that model. Writes ``models/sft`` (safetensors + tokenizer + model card); the wrapper writes
``metrics/sft.json`` and ``plots/sft.csv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.data import read_jsonl
from rlhf_core.models.padding import ensure_pad_token
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.chat_prompts import completion_only_rows


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
    split_digits: bool
    """Built tokenizer: every digit a token of its own (an arithmetic task needs it to carry; off for sentiment)."""
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
        ensure_pad_token(tokenizer)
        return AutoModelForCausalLM.from_pretrained(p.model_name), tokenizer
    tokenizer = build_tokenizer(texts, vocab_size=p.vocab_size, padding_side="right", split_digits=p.split_digits)
    model = tiny_causal_lm(tokenizer, arch=p.arch, hidden_size=p.hidden_size, num_layers=p.num_layers,
                           num_heads=p.num_heads, max_positions=p.max_positions, seed=p.seed)
    return model, tokenizer


def conversation_texts(rows: list[dict]) -> list[str]:
    """The corpus a built tokenizer learns from, of conversational prompt-completion rows: each turn as the plain
    template writes it (``Role: content``)."""
    return [f"{m['role'].capitalize()}: {m['content']}" for r in rows for m in r["prompt"] + r["completion"]]


def body(ctx: StageContext) -> StageResult:
    """Train ``models/sft`` from ``data/sft_train.jsonl``: ``{"text"}`` rows, or conversational prompt-completion
    rows (``{"prompt": [messages], "completion": [messages]}``, a user's conversational problems) rendered with the
    tokenizer's chat template (a plain one, ``SIMPLE_CHAT_TEMPLATE``, where it has none), the loss on the
    completion only."""
    from datasets import Dataset  # datasets and the trainer load transformers: only when the stage runs
    from transformers import DataCollatorForSeq2Seq

    from rlhf_core import SFTConfig, SFTTrainer, set_seed
    from rlhf_core.models.chat_format import SIMPLE_CHAT_TEMPLATE
    from tasks.stages.common.resume import checkpointing_arguments, loss_curve, train_and_save, training_arguments

    p, run, log = ctx.section, ctx.run, get_logger()
    rows = read_jsonl(ctx.dep("sft_train"))
    if not rows:
        raise ValueError(f"{ctx.io.deps['sft_train']}: no training texts")
    chat = "prompt" in rows[0]
    texts = conversation_texts(rows) if chat else [r["text"] for r in rows]
    set_seed(p.seed)
    model, tokenizer = build_policy(p, texts)
    if chat and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE  # saved with the tokenizer: the later stages render with it
        log.info("sft: conversational data and a tokenizer without a chat template: the plain one set")
    n_params = sum(t.numel() for t in model.parameters())
    log.info("sft: %d %s, model %s with %.2fM parameters", len(rows), "conversations" if chat else "texts",
             p.model_name or f"tiny-{p.arch}", n_params / 1e6)
    run.log_dataset(ctx.dep("sft_train"), "sft_train")

    def build(ck):
        if not chat:
            return SFTTrainer(model=model, args=training_arguments(ck.dir, p, **checkpointing_arguments()),
                              train_dataset=Dataset.from_dict({"text": texts}), dataset_text_field="text",
                              max_seq_length=p.max_seq_length, tokenizer=tokenizer, tracker=run.tracker,
                              callbacks=[ck.callback])
        tokenized = completion_only_rows(tokenizer, rows, p.max_seq_length, ctx.io.deps["sft_train"])
        args = training_arguments(ck.dir, p, config_class=SFTConfig, dataset_kwargs={"skip_prepare_dataset": True},
                                  **checkpointing_arguments())
        return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(tokenized),
                          data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
                          max_seq_length=p.max_seq_length, tokenizer=tokenizer, tracker=run.tracker,
                          callbacks=[ck.callback])

    def card_metrics(trainer, result):
        curve = loss_curve(trainer.state.log_history)
        final_loss = curve[-1]["loss"] if curve else float(result.training_loss)
        return {"train_loss": round(float(result.training_loss), 4), "final_loss": round(final_loss, 4),
                "final_perplexity": round(math.exp(min(final_loss, 50.0)), 3),
                "num_texts": len(rows), "num_parameters": n_params, "steps": trainer.state.global_step,
                "num_processes": trainer.args.world_size}

    trained = train_and_save(ctx, build, ("SFTTrainer", p.model_name or f"built from config (tiny {p.arch})"),
                             card_metrics, tokenizer)
    return StageResult(trained.card_metrics, loss_curve(trained.trainer.state.log_history), finish=trained.finish)
