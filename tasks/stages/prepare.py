"""Stage ``prepare``: reviews -> SFT corpus, held-out text, prompts, gold-labelled preference pairs and unpaired
thumbs-up/down ratings (``data/ratings.jsonl``, for KTO).

Reads ``params.yaml:prepare`` and the source it names (the synthetic default, local files or a hub dataset:
``tasks/stages/common/source.py``; or a user's preference pairs, ``pairs:<file>``: ``tasks/stages/common/pair_source.py``) plus the feedback batches ingested under ``paths.incoming`` (``python -m flows.intake``); writes
the six ``data/*.jsonl`` files; the wrapper writes ``metrics/prepare.json`` and ``plots/prepare.csv`` (a histogram of
the training reviews' gold scores). Everything is read and validated before anything is written.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from rlhf_core.data import (
    IncomingData,
    bound_reviews,
    clean_text,
    make_preference_pairs,
    make_prompts,
    make_unpaired_ratings,
    pairs_with_margin,
    ratings_with_margin,
    split_train_eval,
    write_jsonl,
)
from rlhf_core.feedback import read_feedback_pairs, read_feedback_ratings
from rlhf_core.rewards import GoldJudge
from rlhf_core.user_problems import read_problems
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.stage import StageContext, StageResult
from tasks.spec.task import task_of
from tasks.stages.common.problems import answer_histogram, arithmetic_datasets, user_datasets
from tasks.stages.common.pair_source import chat_renderer, is_pairs_source, pair_datasets
from tasks.stages.common.source import SOURCE_FINGERPRINT, load_pairs, load_source, read_source, source_fingerprint


@dataclass(frozen=True)
class PrepareParams:
    """Dataset preparation: corpus, prompts and gold-labelled preference pairs."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("max_words", "prompt_min_words", "prompt_max_words", "pairs_per_review"),
        non_negative_ints=("num_reviews",),
        non_negative_floats=("min_margin",),
        choices={"incoming_judge": ("keep", "agree")})
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    source: str
    """``synthetic`` (generated offline), a local file/dir (txt, jsonl, csv, parquet) or ``hub:<dataset name>``."""
    source_revision: str
    """Hub dataset revision (a new revision is new data for retraining); empty = default branch."""
    split: str
    """Hub split to read."""
    text_field: str
    """Column holding the review text (jsonl/csv/parquet/hub)."""
    num_reviews: int
    """Synthetic: how many reviews to generate. Files/hub: cap on reviews read (0 = all)."""
    max_words: int
    """Reviews longer than this many words are truncated at a word boundary."""
    prompt_min_words: int
    """Prompts are the first N words of a review, N drawn from [prompt_min_words, prompt_max_words]."""
    prompt_max_words: int
    """Upper bound of the prompt length in words."""
    eval_fraction: float
    """Share of reviews held out for evaluation (prompts and perplexity text)."""
    pairs_per_review: int
    """Preference pairs built per training review (its continuation against another review's)."""
    min_margin: float
    """Minimum gold-judge score gap between chosen and rejected; closer pairs are dropped."""
    incoming_judge: str
    """What the gold judge may do to incoming human judgements (``incoming/``): ``keep`` (human judgements are data:
    every one trains, the judge's disagreements are only counted in the log), or ``agree`` (only those the judge
    agrees with: pairs by ``min_margin``, ratings outside its neutral band; each drop counted in
    ``metrics/prepare.json`` and logged with its reason)."""
    seed: int
    """Seed for generation, shuffling and pairing."""

    def problems(self, name: str) -> list[str]:
        """Prompt lengths that exist and a held-out share strictly between 0 and 1."""
        return [message for broken, message in (
            (self.prompt_min_words < 1, f"{name}.prompt_min_words must be >= 1"),
            (self.prompt_max_words < self.prompt_min_words,
             f"{name}.prompt_max_words must be >= {name}.prompt_min_words"),
            (not 0.0 < self.eval_fraction < 1.0, f"{name}.eval_fraction must be in (0, 1)"),
        ) if broken]


MIN_REVIEWS = 10

NEUTRAL_BAND = 0.05
"""Ratings: a continuation is desirable when the gold score of prompt + completion is > 0; rows within this
distance of 0 (VADER's neutral band, also used for prepare's share_positive/negative) are dropped."""

RECOMMENDED_REVIEWS = 2000
"""Fewer reviews than this train poorly (a few hundred gave SFT perplexity 614 and PPO below SFT): warn."""

DATASETS = ("sft_train", "heldout", "prompts_train", "prompts_eval", "preferences", "ratings")
"""The stage's outputs (``data/<name>.jsonl``), in the row's order; evaluation data is logged as such."""


COLUMNS = ("gold_bin", "count")
"""plots/prepare.csv: the training reviews per gold-score bin (:func:`gold_histogram`)."""
PLOT = dict(template="bars", title="Gold (VADER) score of the training reviews", x="gold_bin", y="count",
            x_label="gold score bin (centre)", y_label="reviews")
"""DVC's options of ``plots/prepare.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def size_warning(num_reviews: int) -> str | None:
    """A warning when the corpus is too small to train meaningfully (``RECOMMENDED_REVIEWS``), else None."""
    if num_reviews >= RECOMMENDED_REVIEWS:
        return None
    return (f"prepare: only {num_reviews} reviews; at least {RECOMMENDED_REVIEWS} are needed to train meaningfully "
            f"(a few hundred gave SFT perplexity ~600 and PPO below SFT). Add data to prepare.source or incoming/, "
            f"or raise prepare.num_reviews")


def incoming_pairs_judged(p: PrepareParams, incoming: list[dict], judge, dropped: dict[str, int]) -> list[dict]:
    """The incoming human pairs that train, with their gold scores: all of them (``incoming_judge: keep``), or those
    the judge prefers by ``min_margin`` (``agree``); what the judge disagrees with is counted and said either way."""
    dropped["num_dropped_incoming_pairs"] = 0
    if not incoming:
        return []
    n = len(incoming)
    scores = judge([x["prompt"] + x["chosen"] for x in incoming] + [x["prompt"] + x["rejected"] for x in incoming])
    agreed, disagreed = pairs_with_margin(incoming, scores[:n], scores[n:], p.min_margin)
    if p.incoming_judge == "agree":
        dropped["num_dropped_incoming_pairs"] = disagreed
        if disagreed:
            get_logger().warning("prepare: dropped %d incoming pair(s) whose chosen text the gold judge does not "
                                 "prefer by prepare.min_margin=%s (prepare.incoming_judge: agree)", disagreed,
                                 p.min_margin)
        return agreed
    if disagreed:
        get_logger().info("prepare: kept all %d incoming human pairs; the gold judge does not prefer %d of them by "
                          "prepare.min_margin (prepare.incoming_judge: keep: human judgements are data)", n, disagreed)
    return [{**pair, "chosen_score": float(sc), "rejected_score": float(sr)}
            for pair, sc, sr in zip(incoming, scores[:n], scores[n:])]


def incoming_ratings_judged(p: PrepareParams, incoming: list[dict], judge, dropped: dict[str, int]) -> list[dict]:
    """As :func:`incoming_pairs_judged`, for ratings (the judge's label by its neutral band)."""
    dropped["num_dropped_incoming_ratings"] = 0
    if not incoming:
        return []
    scores = judge([r["prompt"] + r["completion"] for r in incoming])
    agreed, disagreed = ratings_with_margin(incoming, scores, threshold=0.0, min_margin=NEUTRAL_BAND)
    if p.incoming_judge == "agree":
        dropped["num_dropped_incoming_ratings"] = disagreed
        if disagreed:
            get_logger().warning("prepare: dropped %d incoming rating(s) whose label the gold judge does not give "
                                 "(outside its neutral band %s; prepare.incoming_judge: agree)", disagreed,
                                 NEUTRAL_BAND)
        return agreed
    if disagreed:
        get_logger().info("prepare: kept all %d incoming human ratings; the gold judge does not give the label of %d "
                          "(prepare.incoming_judge: keep: human judgements are data)", len(incoming), disagreed)
    return [{**rating, "score": float(s)} for rating, s in zip(incoming, scores)]


def build_datasets(p: PrepareParams, reviews: list[str], incoming_pairs: list[dict], judge,
                   dropped: dict[str, int] | None = None, incoming_ratings: list[dict] = ()) -> dict[str, list[dict]]:
    """Pure shaping: cleaned reviews -> the six datasets (lists of records; ``ratings``: unpaired
    prompt/completion/label rows for KTO, with the incoming ratings the gold judge labels the same).

    Hostile data is bounded here, not left to crash a later stage (issue 12.3): reviews with an overlong word or
    prompt (``rlhf_core.data.review_overlong``) are dropped, and, with ``incoming_judge: agree`` only, incoming
    judgements the gold judge disagrees with; their counts go into ``dropped`` (``metrics/prepare.json``).
    """
    dropped = {} if dropped is None else dropped
    cleaned = [t for t in (clean_text(r, p.max_words) for r in reviews) if len(t.split()) >= 2]
    texts, overlong = bound_reviews(cleaned, p.prompt_max_words)
    dropped["num_dropped_overlong"] = len(overlong)
    if overlong:
        get_logger().warning("prepare: dropped %d review(s) that would overflow a later stage, e.g. %s",
                             len(overlong), overlong[0])
    if len(texts) < MIN_REVIEWS:
        raise ValueError(f"prepare: only {len(texts)} usable reviews (need at least {MIN_REVIEWS}); check prepare.source")
    train, heldout = split_train_eval(texts, p.eval_fraction, seed=p.seed)
    pairs = make_preference_pairs(train, judge, p.prompt_min_words, p.prompt_max_words,
                                  pairs_per_review=p.pairs_per_review, min_margin=p.min_margin, seed=p.seed)
    pairs += incoming_pairs_judged(p, incoming_pairs, judge, dropped)
    ratings = make_unpaired_ratings(train, judge, p.prompt_min_words, p.prompt_max_words, threshold=0.0,
                                    min_margin=NEUTRAL_BAND, seed=p.seed)
    kept_ratings = incoming_ratings_judged(p, list(incoming_ratings), judge, dropped)
    return {
        "sft_train": [{"text": t} for t in train],
        "heldout": [{"text": t} for t in heldout],
        "prompts_train": [{"query": q} for q in make_prompts(train, p.prompt_min_words, p.prompt_max_words, seed=p.seed)],
        "prompts_eval": [{"query": q} for q in make_prompts(heldout, p.prompt_min_words, p.prompt_max_words, seed=p.seed + 1)],
        "preferences": pairs,
        "ratings": ratings + kept_ratings,
    }


def write_datasets(files: dict[str, Path], datasets: dict[str, list[dict]]) -> dict[str, int]:
    """Write every file to a temp name first, then rename them all: no half-written dataset survives."""
    tmp_paths = {}
    try:
        for name, records in datasets.items():
            files[name].parent.mkdir(parents=True, exist_ok=True)
            tmp = files[name].with_name(f".{files[name].name}.tmp-{os.getpid()}")
            write_jsonl(records, tmp)
            tmp_paths[name] = tmp
    except BaseException:
        for tmp in tmp_paths.values():
            tmp.unlink(missing_ok=True)
        raise
    for name, tmp in tmp_paths.items():
        os.replace(tmp, files[name])
    return {name: len(records) for name, records in datasets.items()}


def gold_histogram(gold: list[float]) -> list[dict]:
    """plots/prepare.csv: the number of training reviews per gold-score bin of width 0.2 (``gold_bin``: its centre)."""
    bins = [-1.0 + 0.2 * i for i in range(11)]
    return [{"gold_bin": round(lo + 0.1, 2), "count": sum(lo <= g < hi or (hi == 1.0 and g == 1.0) for g in gold)}
            for lo, hi in zip(bins[:-1], bins[1:])]


def verifiable_body(ctx: StageContext) -> StageResult:
    """A verifiable task's datasets (``tasks/stages/common/problems.py``): generated problems (``arithmetic``) or
    the user's file named by ``prepare.source`` (``problems``), every row checked before anything is written."""
    task, run, p = task_of(ctx.params), ctx.run, ctx.section
    if task.name == "arithmetic":
        datasets = arithmetic_datasets(task, p.seed)
    else:
        if p.source == "synthetic":
            raise ValueError("prepare.source: task 'problems' reads a JSONL, CSV or Parquet file of problems, or a "
                             "dataset (hub:<name>), got 'synthetic'")
        problems = read_source(p, ctx.root, read_problems, task.prompt_field, task.answer_field,
                               task.completion_field)
        datasets = user_datasets(problems, task, p.eval_fraction, p.seed)
    files = {name: ctx.out(name) for name in DATASETS}
    counts = write_datasets(files, datasets)
    metrics = {"task": task.name, "num_train": counts["sft_train"], "num_heldout": counts["heldout"],
               "num_prompts_train": counts["prompts_train"], "num_prompts_eval": counts["prompts_eval"],
               "num_pairs": 0, "num_ratings": 0}
    for name in DATASETS:
        run.log_dataset(files[name], name, context="eval" if "eval" in name or name == "heldout" else "training")
    run.log_table("problem_samples", [{"query": r["query"], "solution": r["solution"]}
                                      for r in datasets["prompts_train"][:20]])
    get_logger().info("prepare: %d training and %d held-out problems (task %s)", counts["sft_train"],
                      counts["heldout"], task.name)
    return StageResult(metrics, answer_histogram(datasets["prompts_train"]))


def body(ctx: StageContext) -> StageResult:
    """Materialise the datasets of ``params.yaml:prepare`` for the task of ``params.yaml:task``."""
    if task_of(ctx.params).name != "sentiment":
        return verifiable_body(ctx)
    p, run, log = ctx.section, ctx.run, get_logger()
    # read and validate everything first: the user's pairs (prepare.source: pairs:<file>) or the reviews
    pairs = load_pairs(p, ctx.root) if is_pairs_source(p.source) else None
    reviews = [] if pairs is not None else load_source(p, ctx.root)
    incoming_dir = ctx.io.deps["incoming"]
    incoming = IncomingData(reviews=[], pairs=read_feedback_pairs(ctx.dep("incoming")),  # versioned by the intake
                            ratings=read_feedback_ratings(ctx.dep("incoming")))
    log.info("prepare: %d %s from %s, %d new reviews, %d new pairs and %d new ratings from %s",
             len(reviews if pairs is None else pairs), "reviews" if pairs is None else "preference pairs", p.source,
             len(incoming.reviews), len(incoming.pairs), len(incoming.ratings), incoming_dir)
    if pairs is None and (warning := size_warning(len(reviews) + len(incoming.reviews))) is not None:
        log.warning(warning)
    judge = GoldJudge()
    dropped: dict[str, int] = {}
    if pairs is None:
        datasets = build_datasets(p, reviews + incoming.reviews, incoming.pairs, judge, dropped, incoming.ratings)
        gold_texts = [r["text"] for r in datasets["sft_train"]]
    else:  # conversations rendered with the template the SFT policy will have (sft.model_name's, else the plain one)
        datasets = pair_datasets(pairs, p.eval_fraction, p.seed, chat_renderer(ctx.params.section("sft").model_name,
                                                                                pairs))
        gold_texts = [r["prompt"] + r["chosen"] for r in datasets["preferences"]]  # what SFT learns, as text
        datasets["preferences"] += incoming_pairs_judged(p, incoming.pairs, judge, dropped)
        datasets["ratings"] += incoming_ratings_judged(p, incoming.ratings, judge, dropped)

    files = {name: ctx.out(name) for name in DATASETS}
    counts = write_datasets(files, datasets)
    (ctx.root / ctx.params.paths.data / SOURCE_FINGERPRINT).write_text(json.dumps(source_fingerprint(p, ctx.root)))
    gold = judge(gold_texts)
    metrics = {
        "num_train": counts["sft_train"], "num_heldout": counts["heldout"],
        "num_prompts_train": counts["prompts_train"], "num_prompts_eval": counts["prompts_eval"],
        "num_pairs": counts["preferences"], "num_ratings": counts["ratings"],
        "num_desirable": sum(r["label"] for r in datasets["ratings"]), "num_incoming_reviews": len(incoming.reviews),
        "num_incoming_pairs": len(incoming.pairs), "num_incoming_ratings": len(incoming.ratings), **dropped,
        "gold_mean": round(statistics.fmean(gold), 4),
        "share_positive": round(sum(g > NEUTRAL_BAND for g in gold) / len(gold), 4),
        "share_negative": round(sum(g < -NEUTRAL_BAND for g in gold) / len(gold), 4),
    }
    for name in DATASETS:
        run.log_dataset(files[name], name, context="eval" if "eval" in name or name == "heldout" else "training")
    run.log_table("preference_samples", [{k: r.get(k) for k in ("prompt", "chosen", "rejected", "chosen_score",
                                                                  "rejected_score")} for r in datasets["preferences"][:20]])
    log.info("prepare: wrote %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    return StageResult(metrics, gold_histogram(gold))
