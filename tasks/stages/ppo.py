"""Stage ``ppo``: optimise the SFT policy against the reward, with a KL penalty to the SFT reference.

The classic TRL loop on rlhf_core's ``PPOTrainer``: sample prompts, ``generate``, score query + response
with the reward (the learned reward model by default), ``step``, ``log_stats`` (step metrics under the
spec's names and a query/response/reward table per step in MLflow). Writes ``models/ppo`` (value-head
checkpoint; loads as a plain causal LM); the wrapper writes ``metrics/ppo.json``, ``plots/ppo.csv`` and
``plots/ppo_windows.csv``.

The loop itself is the library's (``rlhf_core.trainers.ppo.loop.run_ppo``): this body loads, runs and saves.
Its state (weights, optimizer, RNGs, KL controller, dataloader position, curve) is saved in
``.checkpoints/ppo-<hash of params and inputs>`` every ``ppo.save_steps`` steps and when SIGTERM/SIGINT arrives
(then ``Preempted`` is raised: exit status 75). Running the stage again, after a signal or a hard kill, resumes from
there and ends with the same model as an uninterrupted run.

Under a launcher with N processes the trainer's dataloader is sharded by accelerate, so every rank trains on its
own ``batch_size`` prompts of each step's ``batch_size x N``; DDP keeps the weights identical (checked at the
end) and rank 0 alone writes. The stop request is all-reduced at every step, so all ranks save (rank 0 writes) and
stop after the same step. Resuming a multi-process run continues from that state, but not bit for bit: the saved
RNG state is rank 0's (each other rank re-seeds with ``seed + rank``).
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rlhf_core.checkpointing import GracefulStop, Preempted
from rlhf_core.data import read_jsonl
from rlhf_core.rewards import make_reward
from tasks.process.distributed import check_replicas_identical, is_main_process
from tasks.process.logs import get_logger, progress_bar
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import ConfigSection, SampledPolicy, as_dict
from tasks.spec.paths import stage_checkpoint_dir
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.chat_prompts import render_with
from tasks.stages.common.problems import solutions_of, verifier_scores
from tasks.stages.common.samples import sample_windows, step_hook
from tasks.stages.common.scoring import load_tokenizer
from tasks.store.outputs import atomic_dir

PPO_CONFIG_KEYS = (
    "learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "init_kl_coef",
    "adap_kl_ctrl", "target", "horizon", "kl_penalty", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef",
    "max_grad_norm", "use_score_scaling", "use_score_norm", "whiten_rewards", "seed",
)
"""The ``PPOConfig`` fields the ppo section sets, in params.yaml's order (types and docs: ``PPOConfig``)."""

REWARDS = ("reward_model", "gold", "verifier")
"""``ppo.reward``: the learned reward model, the gold judge, the verifier (each prompt's ``solution``: the
arithmetic task), or ``pipeline:<hub classifier>``."""


@dataclass(frozen=True)
class PPOStageParams(SampledPolicy):
    """The ppo section's keys that are not ``PPOConfig`` fields."""

    total_steps: int
    """Number of PPO steps (batches of rollouts)."""
    max_new_tokens: int
    """Tokens sampled per response."""
    reward: str
    """``reward_model`` (the learned RM), ``gold`` (VADER), ``verifier`` (``accuracy_reward`` on each prompt's
    ``solution``) or ``pipeline:<hub classifier>``."""
    save_steps: int
    """Write the resumable PPO checkpoint every this many steps (0: only on SIGTERM/SIGINT)."""


@dataclass(frozen=True)
class PPOParams(ConfigSection, config="PPOConfig", keys=PPO_CONFIG_KEYS, stage=PPOStageParams):
    """PPO against the reward with a KL penalty to the SFT reference: ``PPOConfig`` keys + ``PPOStageParams``."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "total_steps",
                       "max_new_tokens", "sample_prompts"),
        non_negative_ints=("sample_every",),
        positive_floats=("learning_rate", "target", "horizon", "cliprange", "cliprange_value", "max_grad_norm"),
        non_negative_floats=("init_kl_coef", "vf_coef"),
        unit_interval=("gamma", "lam"),
        choices={"kl_penalty": ("kl", "abs", "mse", "full")})
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    def problems(self, name: str) -> list[str]:
        """The batch splits into mini-batches and backward passes (as ``PPOConfig`` checks when the stage starts);
        at least one step; a reward the stage knows."""
        backward = self.mini_batch_size * self.gradient_accumulation_steps
        return [message for broken, message in (
            (self.batch_size % self.mini_batch_size != 0, f"{name}.batch_size must be a multiple of "
                                                          f"{name}.mini_batch_size"),
            (self.batch_size % backward != 0,
             f"{name}.gradient_accumulation_steps: {name}.batch_size ({self.batch_size}) must be a multiple of "
             f"{name}.mini_batch_size x {name}.gradient_accumulation_steps ({self.mini_batch_size} x "
             f"{self.gradient_accumulation_steps} = {backward})"),
            (self.total_steps < 1, f"{name}.total_steps must be >= 1"),
            (self.reward not in REWARDS and not self.reward.startswith("pipeline:"),
             f"{name}.reward must be reward_model, gold, verifier or pipeline:<model>"),
        ) if broken]


COLUMNS = ("step", "reward_mean", "kl", "kl_coef")
"""plots/ppo.csv: per PPO step, the mean reward of its rollouts, the KL to SFT and the KL coefficient."""
PLOT = dict(title="PPO adaptive KL coefficient (reward and KL are in the chart above)", x="step", y="kl_coef")
CHARTS = {"PPO reward-model score and KL to the reference per step":
          dict(template="linear", x="step", y={"curve": ["reward_mean", "kl"]})}
"""The chart of ``plots/ppo.csv``'s reward and KL together (dvc.yaml's top-level ``plots``)."""
"""DVC's options of ``plots/ppo.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def ppo_config(p: PPOParams, model_name: str, query_dataset: str):
    """``PPOConfig`` from the ppo section's PPOConfig keys (the stage-only keys are ``p.stage``)."""
    from rlhf_core import PPOConfig  # the trainer package loads transformers: only when the stage runs

    return PPOConfig(model_name=model_name, query_dataset=query_dataset, reward_model=p.reward,
                     tracker_project_name="rlhf-pipeline", steps=p.total_steps * p.batch_size, **p.config)


def generation_kwargs(tokenizer, max_new_tokens: int) -> dict:
    """Pure sampling, as in the classic examples (no top-k/top-p), stopping at EOS."""
    return {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": max_new_tokens,
            "eos_token_id": tokenizer.eos_token_id}


def body(ctx: StageContext) -> StageResult:
    """Train ``models/ppo`` with ``rlhf_core.trainers.ppo.loop.run_ppo`` over the trainer's own (resumable,
    per-rank sharded) dataloader of prompts."""
    from rlhf_core.trainers.ppo.loop import run_ppo  # the trainer loads transformers: only when the stage runs
    from tasks.stages.common.resume import resume_key  # (tasks.stages.common.resume loads transformers too)

    p, run, log = ctx.section, ctx.run, get_logger()
    rows = read_jsonl(ctx.dep("prompts_train"))
    prompts = render_with(ctx.dep("sft"), [r["query"] for r in rows], ctx.io.deps["prompts_train"])  # a chat: templated
    if len(prompts) < p.batch_size:
        raise ValueError(f"{ctx.io.deps['prompts_train']}: {len(prompts)} prompts, fewer than ppo.batch_size="
                         f"{p.batch_size}")
    state = stage_checkpoint_dir(ctx.root, "ppo", resume_key(run, p))
    trainer, tokenizer = _build_trainer(ctx, prompts)
    world = trainer.accelerator.num_processes
    reward = (verifier_scores(prompts, solutions_of(rows, ctx.io.deps["prompts_train"])) if p.reward == "verifier"
              else _reward_fn(p.reward, str(ctx.dep("reward_model"))))
    # held-out samples every ppo.sample_every steps (table + reward-KL point; tasks/stages/common/samples.py)
    windows, _ = sample_windows(ctx, state.with_name(f"{state.name}.samples.json"), table="heldout_samples")
    policy = lambda: trainer.accelerator.unwrap_model(trainer.model).pretrained_model  # noqa: E731
    run.log_dataset(ctx.dep("prompts_train"), "prompts_train")
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
    with atomic_dir(ctx.out("model")) as out:
        trainer.save_pretrained(str(out))
        metrics = _final_metrics(curve, p.total_steps, world, p.batch_size * world)
        run.write_model_card(out, "PPOTrainer", f"{ctx.io.deps['sft']} (SFT policy; also the KL reference)",
                             as_dict(p), metrics)
    return StageResult(metrics, curve, windows=windows.points, finish=lambda: _forget_state(state, windows.state_file))


def _forget_state(state: Path, windows_state: Path) -> None:
    """The outputs are complete: the resumable state is no longer needed (the main process owns it)."""
    if is_main_process():
        shutil.rmtree(state, ignore_errors=True)
        windows_state.unlink(missing_ok=True)


def _build_trainer(ctx: StageContext, prompts: list[str]):
    """The SFT policy (and, as its frozen copy, the reference) in a ``PPOTrainer`` over the tokenized prompts."""
    from datasets import Dataset  # datasets and the trainer load transformers: only when the stage runs

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOTrainer, set_seed

    p = ctx.section
    set_seed(p.seed)
    config = ppo_config(p, str(ctx.dep("sft")), str(ctx.dep("prompts_train")))
    tokenizer = load_tokenizer(ctx.dep("sft"))
    dataset = Dataset.from_dict({"query": prompts, "input_ids": [tokenizer(q).input_ids for q in prompts]})
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(ctx.dep("sft")))
    return PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, dataset=dataset,
                      tracker=ctx.run.tracker), tokenizer


def _reward_fn(spec: str, reward_model_path: str):
    """``(queries, responses) -> scores``: the configured reward on each query + response text."""
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
