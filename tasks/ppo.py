"""Stage ``ppo``: optimise the SFT policy against the reward, with a KL penalty to the SFT reference.

The classic TRL loop on rlhf_core's ``PPOTrainer``: sample prompts, ``generate``, score query + response
with the reward (the learned reward model by default), ``step``, ``log_stats`` (step metrics under the
spec's names and a query/response/reward table per step in MLflow). Writes ``models/ppo`` (value-head
checkpoint; loads as a plain causal LM), ``metrics/ppo.json`` and ``plots/ppo.csv``.

Under a launcher with N processes every rank draws the same seeded prompt order and takes its own slice of
each step's ``batch_size x N`` prompts (rank r: the r-th ``batch_size``), so the effective batch is
``batch_size x N``; DDP keeps the weights identical (checked at the end) and rank 0 alone writes.
"""

from __future__ import annotations

import random
import shutil
import statistics
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.distributed import (
    any_process,
    check_replicas_identical,
    is_main_process,
    main_process_first,
    mean_over_processes,
)
from tasks.logs import get_logger, progress
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import PPOParams, as_dict, load_stage
from tasks.paths import stage_checkpoint_dir
from tasks.stage_run import stage_run

STAGE_ONLY = ("enabled", "total_steps", "max_new_tokens", "reward")


def ppo_config(p: PPOParams, model_name: str, query_dataset: str, log_with: Any = "mlflow"):
    """``PPOConfig`` from the ppo section: every key but the stage-only ones is a PPOConfig field.

    ``log_with``: the stage run's tracker (spools when the server is unreachable), or a tracker name."""
    from rlhf_core import PPOConfig

    fields = {k: v for k, v in as_dict(p).items() if k not in STAGE_ONLY}
    return PPOConfig(model_name=model_name, query_dataset=query_dataset, reward_model=p.reward, log_with=log_with,
                     tracker_project_name="rlhf-pipeline", steps=p.total_steps * p.batch_size, **fields)


def generation_kwargs(tokenizer, max_new_tokens: int) -> dict:
    """Pure sampling, as in the classic examples (no top-k/top-p), stopping at EOS."""
    return {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens,
            "eos_token_id": tokenizer.eos_token_id}


@task(name="ppo", cache_policy=NO_CACHE)  # training: no retries
def ppo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/ppo``; returns the metrics written to metrics/ppo.json.

    SIGTERM/SIGINT stop the loop at the next step boundary: the trainer state (weights, optimizer, RNGs, KL
    controller) and the loop's own (next step, prompt order, curve, prompt sampler) are saved in
    ``.checkpoints/ppo-<hash of params and inputs>`` and ``Preempted`` is raised (exit status 75). Running the
    stage again resumes there and ends with the same model as an uninterrupted run.

    Under a launcher the stop request is all-reduced at every step, so all ranks save (rank 0 writes) and stop
    after the same step. Resuming a multi-process run continues from that state, but not bit for bit: the saved
    RNG state is rank 0's (each other rank re-seeds with ``seed + rank``).
    """
    from tasks.policy import disabled_placeholder

    if (skipped := disabled_placeholder(root, "ppo", ("step", "reward_mean", "kl", "kl_coef"))) is not None:
        return skipped  # ppo.enabled: false
    import torch
    from transformers import AutoTokenizer

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOTrainer, set_seed
    from rlhf_core.checkpointing import GracefulStop, Preempted, resumable_checkpoint
    from rlhf_core.rewards import make_reward

    root, params, p, io = load_stage(root, "ppo")
    paths = params.paths
    prompts_path, sft_dir, rm_dir = io["deps"]
    log = get_logger()
    prompts = [r["query"] for r in read_jsonl(root / prompts_path)]
    if len(prompts) < p.batch_size:
        raise ValueError(f"{prompts_path}: {len(prompts)} prompts, fewer than ppo.batch_size={p.batch_size}")

    with stage_run("ppo", root, p, io["deps"], parent_run_id) as run:
        set_seed(p.seed)
        state = stage_checkpoint_dir(root, "ppo", {"params": as_dict(p), "inputs": run.input_hashes})
        config = ppo_config(p, str(root / sft_dir), str(root / prompts_path), log_with=run.tracker)
        tokenizer = AutoTokenizer.from_pretrained(root / sft_dir, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLMWithValueHead.from_pretrained(str(root / sft_dir))
        trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)
        world, rank = trainer.accelerator.num_processes, trainer.accelerator.process_index
        reward_fn = make_reward(p.reward, reward_model_path=str(root / rm_dir))
        run.log_dataset(root / prompts_path, "prompts_train")
        gen = generation_kwargs(tokenizer, p.max_new_tokens)
        rng = random.Random(p.seed)
        order: list[str] = []
        curve = []
        start = 0
        with main_process_first():  # rank 0 recovers a half-swapped state directory before the others look
            resume = resumable_checkpoint(state)
        if resume:
            extra = trainer.load_state(str(state))
            start, order, curve = int(extra["next_step"]), list(extra["order"]), list(extra["curve"])
            version, internal, gauss = extra["rng"]
            rng.setstate((version, tuple(internal), gauss))
            log.info("ppo: resuming at step %d from %s", start, state)
            run.summary["resumed_at_step"] = start
        if rank:  # independent sampling per rank (the prompt order above stays shared)
            set_seed(p.seed + rank)
        per_step = p.batch_size * world
        log.info("ppo: %d steps of %d rollouts (%d per process x %d), reward=%s", p.total_steps, per_step,
                 p.batch_size, world, p.reward)
        with GracefulStop() as stop:
            for step in progress(range(start, p.total_steps), desc="ppo", unit="step"):
                while len(order) < per_step:
                    order += rng.sample(prompts, len(prompts))
                batch_prompts = order[rank * p.batch_size:(rank + 1) * p.batch_size]  # this rank's slice
                order = order[per_step:]
                queries = [tokenizer(q, return_tensors="pt").input_ids[0] for q in batch_prompts]
                responses = trainer.generate(queries, return_prompt=False, batch_size=p.batch_size, **gen)
                texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
                scores = reward_fn([q + r for q, r in zip(batch_prompts, texts)])
                rewards = [torch.tensor(s, dtype=torch.float32) for s in scores]
                stats = trainer.step(queries, responses, rewards)
                trainer.log_stats(stats, {"query": batch_prompts, "response": texts}, rewards)
                row = {"step": step, "reward_mean": mean_over_processes(scores), "kl": float(stats["objective/kl"]),
                       "kl_coef": float(stats["objective/kl_coef"])}
                curve.append(row)
                if step % 5 == 0 or step == p.total_steps - 1:
                    log.info("ppo step %d: reward %.3f, kl %.3f, kl_coef %.3f", step, row["reward_mean"], row["kl"], row["kl_coef"])
                stopping = any_process(stop.requested)  # collective: every rank, every step
                if stopping and step + 1 < p.total_steps:
                    version, internal, gauss = rng.getstate()
                    trainer.save_state(str(state), extra={"next_step": step + 1, "order": order, "curve": curve,
                                                          "rng": [version, list(internal), gauss]})
                    log.warning("ppo: %s at step %d; state saved in %s; run the stage again to resume",
                                stop.signal_name or "stop request from another process", step + 1, state)
                    raise Preempted(state, step + 1, stop.signal_name)
        check_replicas_identical(trainer.accelerator, trainer.accelerator.unwrap_model(trainer.model), "ppo")
        with atomic_dir(root / io["outs"][0]) as out:
            trainer.save_pretrained(str(out))
            last = curve[-max(1, len(curve) // 5):]  # the last fifth of training
            metrics = {"reward_mean_first": round(curve[0]["reward_mean"], 4),
                       "reward_mean_last": round(statistics.fmean(r["reward_mean"] for r in last), 4),
                       "kl_last": round(statistics.fmean(r["kl"] for r in last), 4),
                       "kl_coef_last": round(curve[-1]["kl_coef"], 4), "steps": p.total_steps,
                       "num_processes": world, "rollouts_per_step": per_step}
            run.write_model_card(out, "PPOTrainer", f"{sft_dir} (SFT policy; also the KL reference)", as_dict(p), metrics)
        write_json(root / paths.metrics / "ppo.json", metrics)
        write_csv(root / paths.plots / "ppo.csv", curve, ["step", "reward_mean", "kl", "kl_coef"])
        if is_main_process():  # outputs are complete: the resumable state is no longer needed
            shutil.rmtree(state, ignore_errors=True)
        run.log_metrics({f"final/{k}": v for k, v in metrics.items()})
        run.summary.update(metrics)
    return metrics
