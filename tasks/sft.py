"""Stage ``sft``: supervised fine-tuning of the policy on the review corpus.

Offline default (``sft.model_name: ''``): a byte-level BPE tokenizer trained on the corpus and a small
GPT-2-shaped model built from the config in ``params.yaml:sft``. With a hub name or path (``gpt2``), the
same code fine-tunes that model. Writes ``models/sft`` (safetensors + tokenizer + model card),
``metrics/sft.json`` and ``plots/sft.csv``.
"""

from __future__ import annotations

import math

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.logs import get_logger
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import SFTParams, as_dict, load_stage
from tasks.stage_run import stage_run


def build_policy(p: SFTParams, texts: list[str]):
    """(model, tokenizer): built from the config and the corpus, or loaded from ``p.model_name``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


@task(name="sft", cache_policy=NO_CACHE)  # training: no retries
def sft_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/sft`` from ``data/sft_train.jsonl``; returns the metrics written to metrics/sft.json."""
    from datasets import Dataset

    from rlhf_core import SFTTrainer, set_seed
    from tasks.resume import checkpointing_arguments, loss_curve, resumable_training, training_arguments

    root, params, p, io = load_stage(root, "sft")
    paths = params.paths
    log = get_logger()
    texts = [r["text"] for r in read_jsonl(root / io["deps"][0])]
    if not texts:
        raise ValueError(f"{io['deps'][0]}: no training texts")

    with stage_run("sft", root, p, io["deps"], parent_run_id) as run:
        set_seed(p.seed)
        model, tokenizer = build_policy(p, texts)
        n_params = sum(t.numel() for t in model.parameters())
        log.info("sft: %d texts, model %s with %.2fM parameters", len(texts), p.model_name or f"tiny-{p.arch}", n_params / 1e6)
        run.log_dataset(root / io["deps"][0], "sft_train")
        with resumable_training("sft", run, p) as ck, atomic_dir(root / io["outs"][0]) as out:
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
        write_json(root / paths.metrics / "sft.json", metrics)
        write_csv(root / paths.plots / "sft.csv", curve, ["step", "loss"])
        ck.done()
        run.log_metrics({f"final/{k}": v for k, v in metrics.items()})
        run.summary.update(metrics)
    return metrics
