"""Stage ``dpo``: direct preference optimisation of the SFT policy on the preference pairs (loss: ``dpo.loss_type``).

The reference is a frozen copy of the SFT policy (``ref_model=None``). Writes ``models/dpo``,
``metrics/dpo.json``, ``plots/dpo.csv`` and ``plots/dpo_windows.csv`` (every ``dpo.sample_every`` optimizer steps:
gold reward and KL to SFT of held-out samples, also logged as a sample table; tasks/samples.py).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.logs import get_logger
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import as_dict, cross_section_values, load_stage
from tasks.stage_run import stage_run


@task(name="dpo", cache_policy=NO_CACHE)  # training: no retries
def dpo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/dpo`` from ``data/preferences.jsonl``; returns the metrics written to metrics/dpo.json."""
    from tasks.policy import disabled_placeholder, load_sft_policy
    from tasks.samples import write_empty_windows

    if (skipped := disabled_placeholder(root, "dpo", ("step", "loss", "reward_accuracy", "reward_margin"))) is not None:
        write_empty_windows(root, "dpo")
        return skipped  # dpo.enabled: false
    from datasets import Dataset

    from rlhf_core import DPOTrainer, set_seed
    from tasks.resume import checkpointing_arguments, loss_curve, resumable_training, training_arguments
    from tasks.samples import sample_windows

    root, params, p, io = load_stage(root, "dpo")
    paths = params.paths
    pairs_path, sft_dir, eval_prompts_path = io["deps"]
    log = get_logger()
    pairs = read_jsonl(root / pairs_path)
    if not pairs:
        raise ValueError(f"{pairs_path}: no preference pairs")

    with stage_run("dpo", root, p, io["deps"], parent_run_id, reads=cross_section_values(params, "dpo")) as run:
        set_seed(p.seed)
        tokenizer, model = load_sft_policy(root, sft_dir)
        dataset = Dataset.from_dict({c: [x[c] for x in pairs] for c in ("prompt", "chosen", "rejected")})
        run.log_dataset(root / pairs_path, "preferences")
        log.info("dpo: %d pairs, beta %.3g", len(pairs), p.beta)
        with resumable_training("dpo", run, p) as ck, atomic_dir(root / io["outs"][0]) as out:
            windows, windows_callback = sample_windows("dpo", root, params, run, ck.dir / "sample_windows.json",
                                                       eval_prompts_path, sft_dir)
            trainer = DPOTrainer(model, ref_model=None, beta=p.beta, loss_type=p.loss_type,
                                 args=training_arguments(ck.dir, p, **checkpointing_arguments()),
                                 train_dataset=dataset, tokenizer=tokenizer, max_length=p.max_length,
                                 max_prompt_length=p.max_prompt_length, tracker=run.tracker,
                                 callbacks=[ck.callback, windows_callback])
            result = ck.train(trainer)  # resumes from .checkpoints/dpo-*; SIGTERM -> Preempted (exit 75)
            keys = ("loss", "rewards/accuracies", "rewards/margins")
            curve = loss_curve(trainer.state.log_history, keys)
            last = curve[-1] if curve else {}
            metrics = {"train_loss": round(float(result.training_loss), 4),
                       "final_loss": round(float(last.get("loss", result.training_loss)), 4),
                       "final_reward_accuracy": round(float(last.get("rewards/accuracies", float("nan"))), 4),
                       "final_reward_margin": round(float(last.get("rewards/margins", float("nan"))), 4),
                       "num_pairs": len(pairs), "steps": trainer.state.global_step,
                       "num_processes": trainer.args.world_size}
            trainer.save_model(str(out))
            tokenizer.save_pretrained(str(out))
            run.write_model_card(out, "DPOTrainer", f"{sft_dir} (SFT policy; also the reference)", as_dict(p), metrics)
        write_json(root / paths.metrics / "dpo.json", metrics)
        write_csv(root / paths.plots / "dpo.csv", [{"step": r["step"], "loss": r.get("loss"),
                                                    "reward_accuracy": r.get("rewards/accuracies"),
                                                    "reward_margin": r.get("rewards/margins")} for r in curve],
                  ["step", "loss", "reward_accuracy", "reward_margin"])
        windows.write(root / io["plots"][1])
        ck.done()
        run.log_metrics({f"final/{k}": v for k, v in metrics.items()})
        run.summary.update(metrics)
    return metrics
