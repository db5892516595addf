"""Stage ``evaluate``: compare SFT and every enabled policy (ppo, dpo, grpo, rloo, kto) on held-out prompts.

A disabled policy stage's placeholder (``tasks.store.placeholders.is_placeholder``) is skipped: it has no entry in the
results. Per policy: mean gold-judge sentiment (VADER compound, -1..1), mean learned-reward score, KL to the SFT
reference, perplexity on held-out text, win rate against SFT under the gold judge (``tasks/stages/common/scoring.py``).

The wrapper writes ``metrics/evaluate.json`` (one object per policy: gold_reward, rm_reward, kl, perplexity,
win_rate; what ``dvc metrics show/diff`` read), ``plots/evaluate.csv`` and ``plots/frontier.csv``: the reward-KL
frontier, gold reward against KL to SFT for SFT, each policy's final score here, and the PPO/DPO/KTO points measured
along training on held-out samples (``plots/<stage>_windows.csv``, tasks/stages/common/samples.py); MLflow gets before/after sample
tables, a chart and the same frontier as an image.

``data/evaluate_prompts.csv`` (DVC-cached) holds each policy's per-prompt gold and reward-model scores (one row per
held-out prompt, in order): the registry's paired test compares a challenger with the champion prompt by prompt.
``evaluate.json`` also records, under ``scored``, the DVC hash of each policy directory it scored (computed
from the files, not read from dvc.lock) and of the evaluation set (prompts, held-out text, SFT reference,
reward model, scoring params): the registry refuses weights that differ and compares scores only on one set.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import METRIC_KEYS
from tasks.store.mlflow_runs import mlflow_compare_link
from tasks.store.placeholders import is_placeholder
from tasks.stages.common.scoring import (FRONTIER_COLUMNS, SCORED_KEY, content_md5, frontier_rows, load_evaluation_set,
                                         load_policy, read_windows, score_policy, write_prompt_scores)
from tasks.spec.stage import StageContext, StageResult
from tasks.spec.task import task_of
from tasks.stages.common import verified_eval


@dataclass(frozen=True)
class EvaluateParams:
    """Compare SFT and every enabled policy (ppo, dpo, grpo, rloo, kto) on held-out prompts."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("num_prompts", "max_new_tokens", "batch_size"),
        non_negative_ints=("num_samples",))
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    num_prompts: int
    """Held-out prompts sampled per policy."""
    max_new_tokens: int
    """Tokens sampled per response (same as PPO for a fair comparison)."""
    batch_size: int
    """Generation / scoring batch size."""
    num_samples: int
    """Samples shown in the before/after table."""
    seed: int
    """Seed for sampling."""


COLUMNS = ("policy", *METRIC_KEYS)
"""plots/evaluate.csv: one row per evaluated policy."""
PLOT = dict(template="bars", title="Gold reward per policy (held-out prompts)", x="policy", y="gold_reward")
"""DVC's options of ``plots/evaluate.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""
FRONTIER_PLOT = dict(template="frontier", title="Reward-KL frontier (gold reward against KL to SFT; SFT, checkpoints along "
                     "training, final policies)", x="kl", y="gold_reward", x_label="KL to SFT (nats per response)",
                     y_label="gold reward (VADER; a verifiable task: the verifier's pass rate)")
"""DVC's options of ``plots/frontier.csv``."""


def _chart(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib  # matplotlib: only for the figures, when the stage runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, key in zip(axes, ("gold_reward", "kl", "win_rate")):
        ax.bar(list(results), [results[p][key] for p in results], color=["#888", "#2a7", "#27a"])
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def frontier_png(rows: list[Mapping[str, Any]], path: Path) -> None:
    """The frontier as a PNG (matplotlib): one colour per policy, checkpoints joined in step order, final points
    as large markers, SFT as a star."""
    import matplotlib  # matplotlib: only for the figures, when the stage runs

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for i, policy in enumerate(policies):
        own = [r for r in rows if r["policy"] == policy]
        colour = "#444" if policy == "sft" else colours[i % len(colours)]
        checkpoints = [r for r in own if r["kind"] == "checkpoint"]
        if checkpoints:
            ax.plot([r["kl"] for r in checkpoints], [r["gold_reward"] for r in checkpoints], "o-", color=colour,
                    alpha=0.5, markersize=4)
        for r in own:
            if r["kind"] != "checkpoint":
                ax.plot(r["kl"], r["gold_reward"], "*" if r["kind"] == "reference" else "D", color=colour,
                        markersize=12 if r["kind"] == "reference" else 8, label=f"{policy} ({r['kind']})")
    ax.set_xlabel("KL to SFT (nats per response)")
    ax.set_ylabel("gold reward (VADER)")
    ax.set_title("Reward-KL frontier (small dots: training windows)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _set_tags(run, tags: dict[str, str]) -> None:
    """Tag the stage's MLflow run (how the registry finds the run that scored a policy); skipped offline."""
    from mlflow import MlflowClient  # mlflow: only when the stage runs
    from mlflow.entities import RunTag

    if run.run_id:
        run._direct("tags", lambda: MlflowClient().log_batch(run.run_id, tags=[RunTag(k, v) for k, v in tags.items()]))


def _log_samples(run, names: tuple[str, ...], prompts: list[str], samples: dict, gold: dict, shown: int) -> None:
    """Before/after: the same prompt, the SFT response, then each optimised policy's; and each policy's samples."""
    rows = [{"prompt": prompts[i], **{f"{n}_response": samples[n].responses[i] for n in names},
             **{f"{n}_gold": round(gold[n][i], 3) for n in names}} for i in range(min(shown, len(prompts)))]
    run.log_table("before_after", rows)
    for n in names:
        run.log_table(f"samples_{n}", [{"query": q, "response": r, "gold": round(g, 3)} for q, r, g in
                                       zip(samples[n].prompts, samples[n].responses, gold[n])][: 4 * shown])


def _log_figures(run, results: dict, frontier: list[dict]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _chart(results, Path(tmp) / "evaluate.png")
        run.log_artifact(Path(tmp) / "evaluate.png", artifact_path="plots")
        frontier_png(frontier, Path(tmp) / "frontier.png")
        run.log_artifact(Path(tmp) / "frontier.png", artifact_path="plots")


def body(ctx: StageContext) -> StageResult:
    """Score SFT and every trained policy on the evaluation set (a verifiable task's problems: its own body)."""
    if task_of(ctx.params).name != "sentiment":
        return verified_eval.body(ctx)
    p, run, log = ctx.section, ctx.run, get_logger()
    dirs = {name: d for name, d in ctx.io.group("policy").items() if name == "sft" or not is_placeholder(ctx.root / d)}
    names = tuple(dirs)  # the policies of this run, in order: sft first
    evaluation = load_evaluation_set(ctx.root, p, ctx.io.deps)
    scored = {name: content_md5(ctx.root / dirs[name]) for name in names}  # before loading: what is scored
    policies = {"sft": evaluation.reference, **{n: load_policy(ctx.root / dirs[n]) for n in names if n != "sft"}}
    log.info("evaluate: %s (disabled, skipped: %s)", ", ".join(names),
             ", ".join(n for n in ctx.io.group("policy") if n not in dirs) or "none")
    run.log_dataset(ctx.dep("prompts_eval"), "prompts_eval", context="eval")
    run.log_dataset(ctx.dep("heldout"), "heldout", context="eval")
    results, samples, scores = {}, {}, {}
    for name in names:
        results[name], samples[name], scores[name] = score_policy(
            policies[name], evaluation, baseline_gold=scores["sft"].gold if "sft" in scores else None)
        log.info("evaluate %s: %s", name, ", ".join(f"{k}={v}" for k, v in results[name].items()))
        run.log_metrics({f"{name}/{k}": v for k, v in results[name].items()})
    if any(content_md5(ctx.root / dirs[name]) != scored[name] for name in names):
        raise RuntimeError(f"{', '.join(dirs.values())}: a policy directory changed while it was evaluated")
    # DVC-tracked: hashes only (a function of the inputs); run ids and times stay in MLflow
    record = {**results, SCORED_KEY: {"policies": scored, "evaluation_set": evaluation.md5}}
    _set_tags(run, {"evaluation.set_md5": evaluation.md5, **{f"evaluation.scored.{n}": h for n, h in scored.items()}})
    write_prompt_scores(ctx.out("prompt_scores"), scores)
    _log_samples(run, names, evaluation.prompts, samples, {n: scores[n].gold for n in names}, p.num_samples)
    windows = {s: read_windows(ctx.root / f) for s, f in ctx.io.group("windows").items() if s in dirs}
    frontier = frontier_rows(results, windows)
    _log_figures(run, results, frontier)
    # one run per policy with the same metric keys: MLflow's run comparison shows them side by side
    compared = run.log_child_runs({n: ({"policy": n, "weights_md5": scored[n], "evaluation_set": evaluation.md5},
                                       results[n]) for n in names})
    summary = {"compare_policies": mlflow_compare_link(run.experiment_id, list(compared.values()))} if compared else {}
    summary.update({f"{n}_gold_gain": round(results[n]["gold_reward"] - results["sft"]["gold_reward"], 4)
                    for n in names if n != "sft"})
    summary.update({f"{n}.{k}": v for n in names for k, v in results[n].items()})
    return StageResult(record, [{"policy": n, **results[n]} for n in names], plots={"frontier": (FRONTIER_COLUMNS,
                                                                                                 frontier)},
                       summary=summary)
