"""Samples along training: a table (query, response, reward) per step window and the reward-KL frontier.

Every ``<stage>.sample_every`` optimizer steps (and at the last step) a policy stage samples responses for a small
FIXED set of held-out prompts (the first ``<stage>.sample_prompts`` of ``data/prompts_eval.jsonl``), scores them
with the gold judge and measures their KL to the SFT reference, exactly as ``evaluate`` does (the same seeded
sampling, ``rlhf_core.evaluation``), only on fewer prompts. Under a verifiable task (``task.name`` other than
``sentiment``) the task's verifier is the gold judge: a sample scores 1 when its answer is its problem's solution,
so a window's ``gold_reward`` is the pass rate of one sample per problem. Each window:

- logs a table through the stage's tracker, under PPO's ``game_log`` scheme (``tables/<name>_step000040.json``,
  columns query / response / reward; here the reward is the gold judge's score);
- adds a point ``{step, kl, gold_reward}`` to the stage's ``plots/<stage>_windows.csv`` (a DVC plot output, written
  by ``tasks/run/stage_task.py`` from the points the body returns).

``evaluate`` (``tasks/stages/evaluate.py``: ``frontier_rows``) joins those window files with its own final scores
into ``plots/frontier.csv`` (gold reward against KL to SFT, the DPO paper's frontier figure) and logs the figure to
MLflow as an image.

The points found so far are kept beside the stage's checkpoints, so a resumed stage keeps the windows it scored
before it stopped (those after the checkpoint it resumes from are scored again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.data import read_jsonl
from rlhf_core.evaluation import kl_to_reference, mean, sample_responses
from rlhf_core.models.padding import pad_id_of
from rlhf_core.rewards import GoldJudge, accuracy_reward
from rlhf_core.trainers.ppo.stats import game_log_rows
from tasks.process.distributed import is_main_process
from tasks.process.logs import get_logger
from tasks.spec.stage import StageContext
from tasks.stages.common.chat_prompts import render_with
from tasks.stages.common.problems import solutions_of
from tasks.stages.common.scoring import load_policy, load_tokenizer
from tasks.store.outputs import write_atomic

SAMPLE_COLUMNS = ("query", "response", "reward")
"""Columns of a window's table: the same as PPO's ``game_log`` (the reward is the gold judge's score here)."""


def is_window_step(step: int, every: int, last_step: int) -> bool:
    """Whether the policy is scored after optimizer step ``step`` (1-based): every ``every`` steps and at the end
    (``every`` 0: never)."""
    return every > 0 and step > 0 and (step % every == 0 or step == last_step)


@dataclass
class WindowScorer:
    """Scores a policy on the fixed held-out prompts: gold reward and KL to the reference, as ``evaluate`` does."""

    prompts: list[str]
    """The fixed held-out prompts (the first ``sample_prompts`` of the evaluation prompts)."""
    reference: Any
    """The SFT policy (frozen, in eval mode): the KL reference."""
    tokenizer: Any
    """The SFT tokenizer, left-padded, with a pad token."""
    gold: Callable[[Any], list[float]]
    """The gold judge of the samples (``rlhf_core.evaluation.Samples``): ``GoldJudge`` on prompt + response texts,
    or the task's verifier on the responses (:func:`gold_judge`)."""
    max_new_tokens: int
    """Tokens sampled per response (``evaluate.max_new_tokens``)."""
    seed: int
    """Sampling seed (``evaluate.seed``): every window samples with the same random stream."""

    def __call__(self, policy) -> tuple[list[str], list[float], dict[str, float]]:
        """(responses, per-sample gold scores, ``{"kl", "gold_reward"}``) of ``policy`` (a plain causal LM)."""
        was_training = policy.training
        pad_id = pad_id_of(self.tokenizer)
        try:
            with torch.no_grad():
                samples = sample_responses(policy, self.tokenizer, self.prompts, self.max_new_tokens,
                                           batch_size=len(self.prompts), seed=self.seed)
                kl = kl_to_reference(policy, self.reference, samples, pad_id, batch_size=len(self.prompts))
        finally:
            policy.train(was_training)
        gold = [float(g) for g in self.gold(samples)]
        return samples.responses, gold, {"kl": kl, "gold_reward": mean(gold)}


def gold_judge(task: str, rows: list[dict], where: str) -> Callable[[Any], list[float]]:
    """What scores a window's samples of the prompts ``rows`` (in order): the sentiment task's ``GoldJudge`` on
    prompt + response, a verifiable task's ``accuracy_reward`` of each response against its row's solution."""
    if task == "sentiment":
        judge = GoldJudge()
        return lambda samples: judge(samples.texts)
    solutions = solutions_of(rows, where)  # read (and checked) before any training step
    return lambda samples: [float(v or 0.0) for v in accuracy_reward(samples.responses, solutions)]


def load_window_scorer(ctx: StageContext, num_prompts: int) -> WindowScorer:
    """The scorer of a stage: the first ``num_prompts`` evaluation prompts, the SFT policy as reference, evaluate's
    sampling length and seed, the task's gold judge (``Stage.reads``)."""
    rows = read_jsonl(ctx.dep("prompts_eval"))[:num_prompts]
    where = ctx.io.deps["prompts_eval"]
    prompts = render_with(ctx.dep("sft"), [r["query"] for r in rows], where)  # a chat: SFT's template renders it
    if not prompts:
        raise ValueError(f"{ctx.io.deps['prompts_eval']}: no held-out prompts to sample from "
                         f"(sample_prompts={num_prompts})")
    reference = load_policy(ctx.dep("sft")).eval()
    evaluate = ctx.params.evaluate
    judge = gold_judge(ctx.params.section("task").name, rows, where)
    return WindowScorer(prompts, reference, load_tokenizer(ctx.dep("sft")), judge, evaluate.max_new_tokens,
                        evaluate.seed)


def log_sample_table(tracker, name: str, step: int, queries: Sequence[str], responses: Sequence[str],
                     rewards: Sequence[float]) -> None:
    """One window's table through ``tracker`` under PPO's scheme (``tables/<name>_step<6 digits>.json``)."""
    rows = game_log_rows({"query": list(queries), "response": list(responses)}, SAMPLE_COLUMNS[:2],
                         [round(float(r), 4) for r in rewards])
    tracker.log_table(name, list(SAMPLE_COLUMNS), rows, step=step)


class WindowLog:
    """The window points of one stage run: scored, logged, kept in ``state_file`` (survives a resume)."""

    def __init__(self, stage: str, scorer: WindowScorer | None, tracker, state_file: Path, table: str) -> None:
        self.stage, self.scorer, self.tracker, self.state_file, self.table = stage, scorer, tracker, state_file, table
        self.points: list[dict[str, float]] = []

    def resume(self, step: int) -> None:
        """Keep the points saved by an earlier attempt up to ``step`` (the step training continues from)."""
        if self.state_file.is_file():
            saved = json.loads(self.state_file.read_text())
            self.points = [p for p in saved if p["step"] <= step]

    def score(self, policy, step: int) -> dict[str, float]:
        """Score ``policy`` after ``step``: log the table and the metrics, keep the point."""
        responses, gold, point = self.scorer(policy)
        log_sample_table(self.tracker, self.table, step, self.scorer.prompts, responses, gold)
        self.tracker.log({"samples/gold_reward": point["gold_reward"], "samples/kl": point["kl"]}, step=step)
        row = {"step": step, "kl": round(point["kl"], 4), "gold_reward": round(point["gold_reward"], 4)}
        self.points = [p for p in self.points if p["step"] != step] + [row]
        self.points.sort(key=lambda p: p["step"])
        write_atomic(self.state_file, json.dumps(self.points))
        get_logger().info("%s step %d: held-out samples gold %.3f, kl %.3f", self.stage, step, row["gold_reward"],
                          row["kl"])
        return row

def sample_windows(ctx: StageContext, state_file: str | Path, table: str = "game_log") -> tuple[WindowLog, Any]:
    """A stage's ``WindowLog`` (points kept in ``state_file``, beside the stage's checkpoints) and the
    ``TrainerCallback`` that fills it. Only the main process of a launch scores (the others get an idle log)."""
    section = ctx.section
    active = section.sample_every > 0 and is_main_process()
    scorer = load_window_scorer(ctx, section.sample_prompts) if active else None
    window_log = WindowLog(ctx.stage.name, scorer, ctx.run.tracker, Path(state_file), table)
    return window_log, window_callback(window_log, section.sample_every)


def window_callback(window_log: WindowLog, every: int):
    """A ``TrainerCallback`` scoring the trainer's policy every ``every`` optimizer steps and at the last one."""
    from transformers import TrainerCallback  # transformers: only when a Trainer-based stage runs

    class SampleWindows(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            window_log.resume(state.global_step)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if window_log.scorer is not None and is_window_step(state.global_step, every, state.max_steps):
                window_log.score(_unwrapped(model), state.global_step)

    return SampleWindows()


def step_hook(window_log: WindowLog, policy: Callable[[], Any], every: int, total_steps: int,
              on_step: Callable[[dict], None]) -> Callable[[dict], None]:
    """``on_step`` for ``run_ppo`` that also scores ``policy()`` after every ``every``-th step and the last
    (``row["step"]`` is 0-based: the window after it is step ``row["step"] + 1``)."""
    def hook(row: dict) -> None:
        on_step(row)
        done = int(row["step"]) + 1
        if window_log.scorer is not None and is_window_step(done, every, total_steps):
            window_log.score(policy(), done)
    return hook


def _unwrapped(model):
    """The plain module under DDP / accelerate wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


__all__ = ["SAMPLE_COLUMNS", "is_window_step", "WindowScorer", "gold_judge", "load_window_scorer",
           "log_sample_table", "WindowLog", "sample_windows", "window_callback", "step_hook"]
