"""Scoring policies on the evaluation set: what the evaluate stage, the registry step and the sample windows share.

- :func:`load_evaluation_set` + :func:`score_policy` / :func:`rescore`: a policy's metrics (gold reward, reward-model
  score, KL to SFT, perplexity, win rate) on the held-out prompts, exactly as the evaluate stage records them; the
  registry re-scores a champion with them.
- :func:`content_md5`: DVC's hash of what is on disk now (the registry refuses weights that are not the ones scored).
- ``metrics/evaluate.json`` (:func:`evaluation_file`, :func:`read_results`: the one place its path is built) and the
  per-prompt scores in ``data/evaluate_prompts.csv`` (:func:`write_prompt_scores`, :func:`read_prompt_scores`).
- :func:`read_windows`: the points of a stage's ``plots/<stage>_windows.csv``.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.data import read_jsonl
from rlhf_core.evaluation import PromptScores, evaluate_policy
from rlhf_core.models.padding import ensure_pad_token
from rlhf_core.rewards import GoldJudge, RewardModelScorer
from tasks.spec.params import METRIC_KEYS, PathsParams, as_dict
from tasks.spec.stage import metrics_file
from tasks.store.outputs import write_csv
from tasks.store.provenance import md5_dir, md5_file

EVALUATE = "evaluate"
"""The stage whose metrics file holds every policy's scores."""

SCORED_KEY = "scored"
"""Key of ``metrics/evaluate.json`` holding the DVC hash of every policy directory scored and of the evaluation set."""


def evaluation_file(root: str | Path, paths: PathsParams) -> Path:
    """``metrics/evaluate.json`` of the project in ``root``."""
    return Path(root) / metrics_file(paths, EVALUATE)


def policy_results(evaluation_json: dict) -> dict[str, dict[str, float]]:
    """The per-policy metrics of an ``evaluate.json`` object (without its ``scored`` hashes)."""
    return {k: v for k, v in evaluation_json.items() if k != SCORED_KEY}


def read_results(root: str | Path, paths: PathsParams) -> dict[str, dict[str, float]]:
    """The per-policy metrics of the project's ``metrics/evaluate.json``; ``{}`` when there is none (yet) or it is
    not JSON."""
    path = evaluation_file(root, paths)
    try:
        return policy_results(json.loads(path.read_text())) if path.exists() else {}
    except ValueError:
        return {}


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
    from transformers import AutoModelForCausalLM  # transformers: only when a policy is loaded
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


def load_tokenizer(model_dir: str | Path):
    """The SFT tokenizer, left-padded for generation, with EOS as pad when it has none."""
    from transformers import AutoTokenizer  # transformers: only when a stage scores

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    ensure_pad_token(tokenizer)
    return tokenizer


def load_evaluation_set(root: Path, section: Any, deps: Mapping[str, str]) -> EvaluationSet:
    """The evaluation set of the project in ``root``: evaluate's params ``section`` and its inputs ``deps``
    (``prompts_eval``, ``heldout``, ``policy/sft``, ``reward_model``, relative paths), as the evaluate stage scores."""
    prompts_path, heldout_path, sft_dir, rm_dir = (deps[k] for k in ("prompts_eval", "heldout", "policy/sft",
                                                                    "reward_model"))
    prompts = [r["query"] for r in read_jsonl(root / prompts_path)][: section.num_prompts]
    heldout = [r["text"] for r in read_jsonl(root / heldout_path)]
    if not prompts or not heldout:
        raise ValueError(f"{prompts_path} / {heldout_path}: need held-out prompts and texts")
    inputs = {dep: content_md5(root / dep) for dep in (prompts_path, heldout_path, sft_dir, rm_dir)}
    scoring = {k: v for k, v in as_dict(section).items() if k != "num_samples"}  # num_samples only sizes the tables
    md5 = hashlib.md5(json.dumps({"inputs": inputs, "params": scoring}, sort_keys=True).encode()).hexdigest()
    return EvaluationSet(section, prompts, heldout, load_tokenizer(root / sft_dir), load_policy(root / sft_dir),
                         GoldJudge(), RewardModelScorer(str(root / rm_dir), batch_size=section.batch_size), md5, inputs)


def score_policy(policy, evaluation: EvaluationSet, baseline_gold=None):
    """(metrics rounded as in evaluate.json, samples, per-prompt scores) of one policy on ``evaluation``."""
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
    if not path.is_file():
        return {}
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    names = [c.removesuffix("_gold") for c in (rows[0] if rows else {}) if c.endswith("_gold")]
    return {n: PromptScores(gold=[float(r[f"{n}_gold"]) for r in rows], rm=[float(r[f"{n}_rm"]) for r in rows])
            for n in names}


def read_windows(path: Path) -> list[dict[str, str]]:
    """The rows of a ``plots/<stage>_windows.csv`` (empty when the file is missing or has no rows)."""
    if not path.is_file():
        return []
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


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


__all__ = ["EVALUATE", "EvaluationSet", "FRONTIER_COLUMNS", "SCORED_KEY", "content_md5", "evaluation_file",
           "frontier_rows", "load_evaluation_set", "load_policy", "load_tokenizer", "policy_results", "read_prompt_scores", "read_results", "read_windows",
           "rescore", "score_policy", "write_prompt_scores"]
