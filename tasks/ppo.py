"""Stage ``ppo``: optimise the SFT policy against the reward, with a KL penalty to the SFT reference.

The classic TRL loop on rlhf_core's ``PPOTrainer``: sample prompts, ``generate``, score query + response
with the reward (the learned reward model by default), ``step``, ``log_stats`` (step metrics under the
spec's names and a query/response/reward table per step in MLflow). Writes ``models/ppo`` (value-head
checkpoint; loads as a plain causal LM), ``metrics/ppo.json`` and ``plots/ppo.csv``.

The loop itself is the library's (``rlhf_core.trainers.ppo.loop.run_ppo``): this task loads, runs and writes.
Under a launcher with N processes the trainer's dataloader is sharded by accelerate, so every rank trains on its
own ``batch_size`` prompts of each step's ``batch_size x N``; DDP keeps the weights identical (checked at the
end) and rank 0 alone writes.
"""

from __future__ import annotations

import shutil
import statistics

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.distributed import check_replicas_identical, is_main_process
from tasks.logs import get_logger, progress_bar
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import PPOParams, as_dict, cross_section_values, load_stage
from tasks.paths import stage_checkpoint_dir
from tasks.stage_run import stage_run

def ppo_config(p: PPOParams, model_name: str, query_dataset: str):
    """``PPOConfig`` from the ppo section's PPOConfig keys (the stage-only keys are ``p.stage``)."""
    from rlhf_core import PPOConfig

    return PPOConfig(model_name=model_name, query_dataset=query_dataset, reward_model=p.reward,
                     tracker_project_name="rlhf-pipeline", steps=p.total_steps * p.batch_size, **p.config)


def generation_kwargs(tokenizer, max_new_tokens: int) -> dict:
    """Pure sampling, as in the classic examples (no top-k/top-p), stopping at EOS."""
    return {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens,
            "eos_token_id": tokenizer.eos_token_id}


@task(name="ppo", cache_policy=NO_CACHE)  # training: no retries
def ppo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/ppo``; returns the metrics written to metrics/ppo.json.

    The loop is ``rlhf_core.trainers.ppo.loop.run_ppo`` over the trainer's own (resumable, per-rank sharded)
    dataloader of prompts. Its state (weights, optimizer, RNGs, KL controller, dataloader position, curve) is
    saved in ``.checkpoints/ppo-<hash of params and inputs>`` every ``ppo.save_steps`` steps and when
    SIGTERM/SIGINT arrives (then ``Preempted`` is raised: exit status 75). Running the stage again, after a
    signal or a hard kill, resumes from there and ends with the same model as an uninterrupted run.

    Under a launcher the stop request is all-reduced at every step, so all ranks save (rank 0 writes) and stop
    after the same step. Resuming a multi-process run continues from that state, but not bit for bit: the saved
    RNG state is rank 0's (each other rank re-seeds with ``seed + rank``).
    """
    from tasks.policy import disabled_placeholder
    from tasks.samples import sample_windows, step_hook, write_empty_windows

    if (skipped := disabled_placeholder(root, "ppo", ("step", "reward_mean", "kl", "kl_coef"))) is not None:
        write_empty_windows(root, "ppo")
        return skipped  # ppo.enabled: false
    from rlhf_core.checkpointing import GracefulStop, Preempted
    from rlhf_core.trainers.ppo.loop import run_ppo
    from tasks.resume import resume_key

    root, params, p, io = load_stage(root, "ppo")
    paths = params.paths
    prompts_path, sft_dir, rm_dir, eval_prompts_path = io["deps"]
    log = get_logger()
    prompts = [r["query"] for r in read_jsonl(root / prompts_path)]
    if len(prompts) < p.batch_size:
        raise ValueError(f"{prompts_path}: {len(prompts)} prompts, fewer than ppo.batch_size={p.batch_size}")

    with stage_run("ppo", root, p, io["deps"], parent_run_id, reads=cross_section_values(params, "ppo")) as run:
        state = stage_checkpoint_dir(root, "ppo", resume_key(run, p))
        trainer, tokenizer = _build_trainer(root, p, sft_dir, prompts_path, prompts, run.tracker)
        world = trainer.accelerator.num_processes
        reward = _reward_fn(p.reward, str(root / rm_dir))
        # held-out samples every ppo.sample_every steps (table + reward-KL point; tasks/samples.py)
        windows, _ = sample_windows("ppo", root, params, run, state.with_name(f"{state.name}.samples.json"),
                                    eval_prompts_path, sft_dir, table="heldout_samples")
        policy = lambda: trainer.accelerator.unwrap_model(trainer.model).pretrained_model  # noqa: E731
        run.log_dataset(root / prompts_path, "prompts_train")
        log.info("ppo: %d steps of %d rollouts (%d per process x %d), reward=%s", p.total_steps, p.batch_size * world,
                 p.batch_size, world, p.reward)
        def resuming(step: int, path) -> None:
            log.info("ppo: resuming at step %d from %s", step, path)
            windows.resume(step)
            run.summary["resumed_at_step"] = step

        with GracefulStop() as stop, progress_bar(p.total_steps, desc="ppo", unit="step") as bar:
            try:
                result = run_ppo(trainer, reward, total_steps=p.total_steps,
                                 generation_kwargs=generation_kwargs(tokenizer, p.max_new_tokens), checkpoint_dir=state,
                                 save_every=p.save_steps, should_stop=lambda: stop.requested,
                                 stop_reason=lambda: stop.signal_name,
                                 on_step=step_hook(windows, policy, p.sample_every, p.total_steps,
                                                   _step_logger(log, p.total_steps, bar)),
                                 on_resume=resuming)
            except Preempted as stopped:
                log.warning("ppo: %s at step %d; state saved in %s; run the stage again to resume",
                            stopped.signal_name or "stop request from another process", stopped.step, state)
                raise
        curve = result.curve
        check_replicas_identical(trainer.accelerator, trainer.accelerator.unwrap_model(trainer.model), "ppo")
        with atomic_dir(root / io["outs"][0]) as out:
            trainer.save_pretrained(str(out))
            metrics = _final_metrics(curve, p.total_steps, world, p.batch_size * world)
            run.write_model_card(out, "PPOTrainer", f"{sft_dir} (SFT policy; also the KL reference)", as_dict(p), metrics)
        write_json(root / paths.metrics / "ppo.json", metrics)
        write_csv(root / paths.plots / "ppo.csv", curve, ["step", "reward_mean", "kl", "kl_coef"])
        windows.write(root / io["plots"][1])
        if is_main_process():  # outputs are complete: the resumable state is no longer needed
            shutil.rmtree(state, ignore_errors=True)
            windows.state_file.unlink(missing_ok=True)
        run.log_metrics({f"final/{k}": v for k, v in metrics.items()})
        run.summary.update(metrics)
    return metrics


def _build_trainer(root, p: PPOParams, sft_dir, prompts_path, prompts: list[str], tracker):
    """The SFT policy (and, as its frozen copy, the reference) in a ``PPOTrainer`` over the tokenized prompts."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOTrainer, set_seed

    set_seed(p.seed)
    config = ppo_config(p, str(root / sft_dir), str(root / prompts_path))
    tokenizer = AutoTokenizer.from_pretrained(root / sft_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict({"query": prompts, "input_ids": [tokenizer(q).input_ids for q in prompts]})
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(root / sft_dir))
    return PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, dataset=dataset, tracker=tracker), tokenizer


def _reward_fn(spec: str, reward_model_path: str):
    """``(queries, responses) -> scores``: the configured reward on each query + response text."""
    from rlhf_core.rewards import make_reward

    scorer = make_reward(spec, reward_model_path=reward_model_path)
    return lambda queries, responses: scorer([q + r for q, r in zip(queries, responses)])


def _step_logger(log, total_steps: int, bar):
    """``on_step`` for the loop: advance the progress bar, log every 5th step and the last."""
    def on_step(row: dict) -> None:
        bar.update(1)
        step = row["step"]
        if step % 5 == 0 or step == total_steps - 1:
            log.info("ppo step %d: reward %.3f, kl %.3f, kl_coef %.3f", step, row["reward_mean"], row["kl"],
                     row["kl_coef"])
    return on_step


def _final_metrics(curve: list[dict], total_steps: int, world: int, per_step: int) -> dict:
    """metrics/ppo.json: first reward, means over the last fifth of training, final KL coefficient."""
    last = curve[-max(1, len(curve) // 5):]  # the last fifth of training
    return {"reward_mean_first": round(curve[0]["reward_mean"], 4),
            "reward_mean_last": round(statistics.fmean(r["reward_mean"] for r in last), 4),
            "kl_last": round(statistics.fmean(r["kl"] for r in last), 4),
            "kl_coef_last": round(curve[-1]["kl_coef"], 4), "steps": total_steps,
            "num_processes": world, "rollouts_per_step": per_step}
