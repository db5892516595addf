"""Stage ``evaluate``: compare SFT and every enabled policy (ppo, dpo, grpo, rloo, kto) on held-out prompts.

A disabled policy stage's placeholder (``tasks.policy.is_placeholder``) is skipped: it has no entry in the results.

Per policy: mean gold-judge sentiment (VADER compound, -1..1), mean learned-reward score, KL to the SFT
reference, perplexity on held-out text, win rate against SFT under the gold judge. Writes
``metrics/evaluate.json`` (one object per policy: gold_reward, rm_reward, kl, perplexity, win_rate; what
``dvc metrics show/diff`` read), ``plots/evaluate.csv``, and logs before/after sample tables and a chart.
``plots/frontier.csv`` (and the same figure as an MLflow image, ``plots/frontier.png``) is the reward-KL frontier:
gold reward against KL to SFT for SFT, each policy's final score here, and the PPO/DPO/KTO points measured along
training on held-out samples (``plots/<stage>_windows.csv``, tasks/samples.py).

``data/evaluate_prompts.csv`` (DVC-cached) holds each policy's per-prompt gold and reward-model scores (one row per
held-out prompt, in order): the registry's paired test compares a challenger with the champion prompt by prompt.
``evaluate.json`` also records, under ``scored``, the DVC hash of each policy directory it scored (computed
from the files, not read from dvc.lock) and of the evaluation set (prompts, held-out text, SFT reference,
reward model, scoring params): the registry refuses weights that differ and compares scores only on one set.
``load_evaluation_set`` + ``rescore`` score any other policy (a registered champion) exactly as this stage does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.distributed import require_single_process
from tasks.logs import get_logger
from tasks.mlflow_runs import mlflow_compare_link
from tasks.outputs import write_csv, write_json
from tasks.params import METRIC_KEYS, POLICY_STAGES, WINDOW_STAGES, as_dict, load_stage
from tasks.policy import is_placeholder
from tasks.provenance import md5_dir, md5_file
from tasks.stage_run import stage_run


def _chart(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, key in zip(axes, ("gold_reward", "kl", "win_rate")):
        ax.bar(list(results), [results[p][key] for p in results], color=["#888", "#2a7", "#27a"])
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


FRONTIER_COLUMNS = ("policy", "step", "kl", "gold_reward", "kind")
"""plots/frontier.csv (``kind``: reference = SFT, checkpoint = a training window, final = evaluate's score)."""


def frontier_rows(final: Mapping[str, Mapping[str, float]],
                  windows: Mapping[str, list[Mapping[str, Any]]]) -> list[dict]:
    """plots/frontier.csv: SFT (KL 0), each policy's window points in step order, then its final evaluate score.

    ``final``: evaluate's per-policy metrics (``sft`` first); ``windows``: per stage, rows of its windows file. A
    final point takes the step of the policy's last window (empty when it has none)."""
    rows = []
    for policy, metrics in final.items():
        points = sorted(windows.get(policy, []), key=lambda p: int(p["step"]))
        if policy == "sft":
            rows.append({"policy": "sft", "step": 0, "kl": 0.0, "gold_reward": metrics["gold_reward"],
                         "kind": "reference"})
            continue
        rows += [{"policy": policy, "step": int(p["step"]), "kl": float(p["kl"]),
                  "gold_reward": float(p["gold_reward"]), "kind": "checkpoint"} for p in points]
        rows.append({"policy": policy, "step": int(points[-1]["step"]) if points else "", "kl": metrics["kl"],
                     "gold_reward": metrics["gold_reward"], "kind": "final"})
    return rows


def read_windows(path: Path) -> list[dict[str, str]]:
    """The rows of a ``plots/<stage>_windows.csv`` (empty when the file is missing or has no rows)."""
    import csv

    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def frontier_png(rows: list[Mapping[str, Any]], path: Path) -> None:
    """The frontier as a PNG (matplotlib): one colour per policy, checkpoints joined in step order, final points
    as large markers, SFT as a star."""
    import matplotlib

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


SCORED_KEY = "scored"
"""Key of ``metrics/evaluate.json`` holding the DVC hash of every policy directory scored and of the evaluation set."""


@dataclass
class EvaluationSet:
    """Everything a policy is scored against: prompts, held-out text, the SFT reference (tokenizer, KL,
    win-rate baseline), the gold judge and the learned reward model, and the scoring params."""

    params: Any
    prompts: list[str]
    heldout: list[str]
    tokenizer: Any
    reference: Any
    gold: Any
    learned: Any
    md5: str
    """Hash of the inputs and params that decide a score: two scores compare only when this is equal."""
    inputs: dict[str, str]
    """DVC hash of each input file/directory of the set (``data/...``, ``models/sft``, ``models/reward_model``)."""


def content_md5(path: str | Path) -> str:
    """DVC's hash of the content now on disk: a file's md5, or a directory's ``<md5>.dir`` (never from dvc.lock)."""
    path = Path(path)
    if path.is_dir():
        return md5_dir(path)
    if path.is_file():
        return md5_file(path)
    raise FileNotFoundError(f"{path}: nothing to hash")


def load_policy(model_dir: str | Path):
    """A plain causal LM from a policy directory. A PPO checkpoint's value head (``v_head.*``) is dropped
    quietly; any other unexpected or missing weight is an error naming the directory."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the load report would list the value head as UNEXPECTED
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    finally:
        hf_logging.set_verbosity(level)
    unexpected = sorted(k for k in info["unexpected_keys"] if not k.startswith("v_head."))
    if unexpected or info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(f"{model_dir}: not a causal LM checkpoint (missing {sorted(info['missing_keys'])}, "
                         f"unexpected {unexpected}, mismatched {sorted(info['mismatched_keys'])})")
    return model


def load_evaluation_set(root: str | Path) -> EvaluationSet:
    """The evaluation set of the project in ``root``, as the evaluate stage scores against it."""
    from transformers import AutoTokenizer

    from rlhf_core.rewards import GoldJudge, RewardModelScorer

    root, _, p, io = load_stage(root, "evaluate")
    prompts_path, heldout_path, sft_dir, rm_dir = io["deps"][:4]
    prompts = [r["query"] for r in read_jsonl(root / prompts_path)][: p.num_prompts]
    heldout = [r["text"] for r in read_jsonl(root / heldout_path)]
    if not prompts or not heldout:
        raise ValueError(f"{prompts_path} / {heldout_path}: need held-out prompts and texts")
    tokenizer = AutoTokenizer.from_pretrained(root / sft_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    inputs = {dep: content_md5(root / dep) for dep in (prompts_path, heldout_path, sft_dir, rm_dir)}
    scoring = {k: v for k, v in as_dict(p).items() if k != "num_samples"}  # num_samples only sizes the tables
    md5 = hashlib.md5(json.dumps({"inputs": inputs, "params": scoring}, sort_keys=True).encode()).hexdigest()
    return EvaluationSet(p, prompts, heldout, tokenizer, load_policy(root / sft_dir), GoldJudge(),
                         RewardModelScorer(str(root / rm_dir), batch_size=p.batch_size), md5, inputs)


def score_policy(policy, evaluation: EvaluationSet, baseline_gold=None):
    """(metrics rounded as in evaluate.json, samples, per-prompt scores) of one policy on ``evaluation``."""
    from rlhf_core.evaluation import evaluate_policy

    p = evaluation.params
    metrics, samples, scores = evaluate_policy(
        policy, evaluation.reference, evaluation.tokenizer, evaluation.prompts, evaluation.heldout, evaluation.gold,
        evaluation.learned, baseline_gold=baseline_gold, max_new_tokens=p.max_new_tokens, batch_size=p.batch_size,
        seed=p.seed)
    return {k: round(float(metrics[k]), 4) for k in METRIC_KEYS}, samples, scores


def rescore(policy, evaluation: EvaluationSet):
    """(metrics, per-prompt scores) of ``policy`` on ``evaluation``, exactly as the evaluate stage would record
    them (the win rate against the SFT reference's samples)."""
    _, _, sft = score_policy(evaluation.reference, evaluation)
    metrics, _, scores = score_policy(policy, evaluation, baseline_gold=sft.gold)
    return metrics, scores


def write_prompt_scores(path: Path, scores: Mapping[str, Any]) -> None:
    """One row per prompt (``prompt`` = its index), two columns per policy; full float precision."""
    names = list(scores)
    columns = ["prompt"] + [f"{n}_{kind}" for n in names for kind in ("gold", "rm")]
    count = len(next(iter(scores.values())).gold)
    rows = [{"prompt": i, **{f"{n}_gold": repr(scores[n].gold[i]) for n in names},
             **{f"{n}_rm": repr(scores[n].rm[i]) for n in names}} for i in range(count)]
    write_csv(path, rows, columns)


def read_prompt_scores(path: Path) -> dict:
    """policy -> ``PromptScores`` from a file :func:`write_prompt_scores` wrote (empty when there is none)."""
    import csv

    from rlhf_core.evaluation import PromptScores

    if not path.is_file():
        return {}
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = [c.removesuffix("_gold") for c in (rows[0] if rows else {}) if c.endswith("_gold")]
    return {n: PromptScores(gold=[float(r[f"{n}_gold"]) for r in rows], rm=[float(r[f"{n}_rm"]) for r in rows])
            for n in names}


def policy_results(evaluation_json: dict) -> dict[str, dict[str, float]]:
    """The per-policy metrics of an ``evaluate.json`` object (without its ``scored`` hashes)."""
    return {k: v for k, v in evaluation_json.items() if k != SCORED_KEY}


def _set_tags(run, tags: dict[str, str]) -> None:
    """Tag the stage's MLflow run (how the registry finds the run that scored a policy); skipped offline."""
    from mlflow import MlflowClient
    from mlflow.entities import RunTag

    if run.run_id:
        run._direct("tags", lambda: MlflowClient().log_batch(run.run_id, tags=[RunTag(k, v) for k, v in tags.items()]))


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Evaluate every policy; returns the content of metrics/evaluate.json."""
    import tempfile

    require_single_process("evaluate")  # not a training stage: one process (see tasks/distributed.py)

    root, params, p, io = load_stage(root, "evaluate")
    paths = params.paths
    prompts_path, heldout_path, sft_dir, rm_dir = io["deps"][:4]
    window_files = io["deps"][4:4 + len(WINDOW_STAGES)]  # plots/<stage>_windows.csv per WINDOW_STAGES
    policy_dirs = io["deps"][-len(POLICY_STAGES):]  # models/<stage> per POLICY_STAGES
    trained = {s: d for s, d in zip(POLICY_STAGES, policy_dirs) if not is_placeholder(root / d)}
    names = ("sft", *trained)  # the policies of this run, in order
    log = get_logger()

    with stage_run("evaluate", root, p, io["deps"], parent_run_id) as run:
        evaluation = load_evaluation_set(root)
        prompts = evaluation.prompts
        dirs = {"sft": sft_dir, **trained}
        scored = {name: content_md5(root / dirs[name]) for name in names}  # before loading: what is scored
        policies = {"sft": evaluation.reference, **{s: load_policy(root / d) for s, d in trained.items()}}
        log.info("evaluate: %s (disabled, skipped: %s)", ", ".join(names),
                 ", ".join(s for s in POLICY_STAGES if s not in trained) or "none")
        run.log_dataset(root / prompts_path, "prompts_eval", context="eval")
        run.log_dataset(root / heldout_path, "heldout", context="eval")
        results, samples, scores = {}, {}, {}
        for name in names:
            results[name], samples[name], scores[name] = score_policy(
                policies[name], evaluation, baseline_gold=scores["sft"].gold if "sft" in scores else None)
            log.info("evaluate %s: %s", name, ", ".join(f"{k}={v}" for k, v in results[name].items()))
            run.log_metrics({f"{name}/{k}": v for k, v in results[name].items()})
        if any(content_md5(root / dirs[name]) != scored[name] for name in names):
            raise RuntimeError(f"{', '.join(dirs.values())}: a policy directory changed while it was evaluated")
        # DVC-tracked: hashes only (a function of the inputs); run ids and times stay in MLflow
        record = {**results, SCORED_KEY: {"policies": scored, "evaluation_set": evaluation.md5}}
        write_json(root / paths.metrics / "evaluate.json", record)
        _set_tags(run, {"evaluation.set_md5": evaluation.md5, **{f"evaluation.scored.{n}": h for n, h in scored.items()}})
        write_csv(root / paths.plots / "evaluate.csv", [{"policy": n, **results[n]} for n in names],
                  ["policy", *METRIC_KEYS])
        write_prompt_scores(root / io["outs"][0], scores)  # data/evaluate_prompts.csv
        gold_scores = {n: scores[n].gold for n in names}
        # before/after: the same prompt, the SFT response, then each optimised policy's
        rows = [{"prompt": prompts[i],
                 **{f"{n}_response": samples[n].responses[i] for n in names},
                 **{f"{n}_gold": round(gold_scores[n][i], 3) for n in names}} for i in range(min(p.num_samples, len(prompts)))]
        run.log_table("before_after", rows)
        for n in names:
            run.log_table(f"samples_{n}", [{"query": q, "response": r, "gold": round(g, 3)} for q, r, g in
                                           zip(samples[n].prompts, samples[n].responses, gold_scores[n])][: 4 * p.num_samples])
        windows = {s: read_windows(root / f) for s, f in zip(WINDOW_STAGES, window_files) if s in trained}
        frontier = frontier_rows(results, windows)
        write_csv(root / io["plots"][1], frontier, list(FRONTIER_COLUMNS))
        with tempfile.TemporaryDirectory() as tmp:
            _chart(results, Path(tmp) / "evaluate.png")
            run.log_artifact(Path(tmp) / "evaluate.png", artifact_path="plots")
            frontier_png(frontier, Path(tmp) / "frontier.png")
            run.log_artifact(Path(tmp) / "frontier.png", artifact_path="plots")
        # one run per policy with the same metric keys: MLflow's run comparison shows them side by side
        compared = run.log_child_runs({n: ({"policy": n, "weights_md5": scored[n], "evaluation_set": evaluation.md5},
                                           results[n]) for n in names})
        if compared:
            run.summary["compare_policies"] = mlflow_compare_link(run.experiment_id, list(compared.values()))
        for n in trained:
            run.summary[f"{n}_gold_gain"] = round(results[n]["gold_reward"] - results["sft"]["gold_reward"], 4)
        run.summary.update({f"{n}.{k}": v for n in names for k, v in results[n].items()})
    return results
