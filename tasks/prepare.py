"""Stage ``prepare``: reviews -> SFT corpus, held-out text, prompts, gold-labelled preference pairs and unpaired
thumbs-up/down ratings (``data/ratings.jsonl``, for KTO).

Reads ``params.yaml:prepare`` and the source it names (the synthetic default, local files or a hub dataset)
plus the feedback batches ingested under ``paths.incoming`` (``python -m flows.intake``); writes
``data/*.jsonl``, ``metrics/prepare.json`` and ``plots/prepare.csv``. Everything is read and validated before anything is written.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import (
    DataFormatError,
    IncomingData,
    bound_reviews,
    clean_text,
    generate_reviews,
    load_hub_texts,
    make_preference_pairs,
    make_prompts,
    make_unpaired_ratings,
    pairs_with_margin,
    ratings_with_margin,
    read_text_records,
    split_train_eval,
    write_jsonl,
)
from rlhf_core.feedback import read_feedback_pairs, read_feedback_ratings
from rlhf_core.rewards import GoldJudge
from tasks.distributed import LauncherError, require_single_process
from tasks.logs import get_logger
from tasks.outputs import write_csv, write_json
from tasks.params import ParamsError, PrepareParams, load_stage
from tasks.provenance import md5_dir, md5_file
from tasks.stage_run import stage_run

MIN_REVIEWS = 10

NEUTRAL_BAND = 0.05
"""Ratings: a continuation is desirable when the gold score of prompt + completion is > 0; rows within this
distance of 0 (VADER's neutral band, also used for prepare's share_positive/negative) are dropped."""


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry transient I/O errors, never bad input (a malformed file or params fail the same way twice)."""
    try:
        state.result()
    except (DataFormatError, ParamsError, FileNotFoundError, ValueError, LauncherError):
        return False
    except Exception:  # noqa: BLE001
        return True
    return False


RECOMMENDED_REVIEWS = 2000
"""Fewer reviews than this train poorly (a few hundred gave SFT perplexity 614 and PPO below SFT): warn."""


def source_path(p: PrepareParams, root: Path) -> Path | None:
    """The local file/directory ``prepare.source`` names (relative to the project), None for synthetic/hub."""
    if p.source == "synthetic" or p.source.startswith("hub:"):
        return None
    path = Path(os.path.expanduser(p.source))
    return path if path.is_absolute() else root / path


def source_error(p: PrepareParams, error: Exception) -> Exception:
    """``error`` from reading ``prepare.source`` as the same kind of error naming the parameter, with the fix
    when it is obvious (a missing text field whose text is in another field: ``prepare.text_field: review``)."""
    message = f"prepare.source: {error}"
    hint = getattr(error, "hint_field", None)
    if hint:
        message += f". Fix: set `prepare.text_field: {hint}` in params.yaml (now {p.text_field!r})"
    elif isinstance(error, FileNotFoundError):
        message += ". Fix: point `prepare.source` in params.yaml at an existing file or directory (or `synthetic`)"
    if isinstance(error, DataFormatError):
        wrapped = DataFormatError(error.path, error.line, "", hint_field=hint)
        wrapped.args = (message,)
        return wrapped
    return type(error)(message) if isinstance(error, (FileNotFoundError, ValueError)) else error


def check_source(p: PrepareParams, root: Path) -> None:
    """Cheap checks of ``prepare.source`` before any server or model starts: the file exists, its type is
    supported and its first record has ``prepare.text_field``. Raises ``source_error``'s errors."""
    path = source_path(p, root)
    if path is None:
        return
    try:
        read_text_records(path, text_field=p.text_field, limit=1)
    except (DataFormatError, FileNotFoundError) as error:
        raise source_error(p, error) from None


def size_warning(num_reviews: int) -> str | None:
    """A warning when the corpus is too small to train meaningfully (``RECOMMENDED_REVIEWS``), else None."""
    if num_reviews >= RECOMMENDED_REVIEWS:
        return None
    return (f"prepare: only {num_reviews} reviews; at least {RECOMMENDED_REVIEWS} are needed to train meaningfully "
            f"(a few hundred gave SFT perplexity ~600 and PPO below SFT). Add data to prepare.source or incoming/, "
            f"or raise prepare.num_reviews")


SOURCE_FINGERPRINT = ".source-fingerprint.json"
"""In ``paths.data``: the md5 of the local file/directory ``prepare.source`` named when prepare last ran. DVC
cannot depend on a path held in a param (``synthetic`` is not a file), so the pipeline flow compares it
(``source_changed``) and re-runs prepare when the file was edited."""


def source_fingerprint(p: PrepareParams, root: Path) -> dict[str, str]:
    """``{"source", "md5"}`` of ``prepare.source`` (md5 empty for synthetic/hub: params cover those)."""
    path = source_path(p, root)
    if path is None or not path.exists():
        return {"source": p.source, "md5": ""}
    return {"source": p.source, "md5": md5_dir(path) if path.is_dir() else md5_file(path)}


def source_changed(p: PrepareParams, root: Path, data_dir: Path) -> str | None:
    """Why prepare is stale although DVC says it is not (the source file's content changed, or was never
    recorded), else None. Synthetic and hub sources: always None (their params are DVC params)."""
    current = source_fingerprint(p, root)
    if not current["md5"]:
        return None
    try:
        recorded = json.loads((data_dir / SOURCE_FINGERPRINT).read_text())
    except (OSError, ValueError):
        return f"prepare.source {p.source}: no recorded fingerprint"
    if recorded != current:
        return f"prepare.source {p.source}: content changed"
    return None


def load_source(p: PrepareParams, root: Path) -> list[str]:
    """The reviews named by ``prepare.source`` (errors name the parameter: ``source_error``)."""
    if p.source == "synthetic":
        return generate_reviews(p.num_reviews, seed=p.seed)
    if p.source.startswith("hub:"):
        return load_hub_texts(p.source[4:], split=p.split, text_field=p.text_field, revision=p.source_revision,
                              limit=p.num_reviews)
    try:
        return read_text_records(source_path(p, root), text_field=p.text_field, limit=p.num_reviews)
    except (DataFormatError, FileNotFoundError) as error:
        raise source_error(p, error) from None


def build_datasets(p: PrepareParams, reviews: list[str], incoming_pairs: list[dict], judge,
                   dropped: dict[str, int] | None = None, incoming_ratings: list[dict] = ()) -> dict[str, list[dict]]:
    """Pure shaping: cleaned reviews -> the six datasets (lists of records; ``ratings``: unpaired
    prompt/completion/label rows for KTO).

    Hostile data is bounded here, not left to crash a later stage (issue 12.3): reviews with an overlong word or
    prompt (``rlhf_core.data.review_overlong``) and incoming pairs the gold judge does not prefer by
    ``min_margin`` are dropped; their counts go into ``dropped`` (``metrics/prepare.json``).
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
    dropped["num_dropped_incoming_pairs"] = 0
    if incoming_pairs:
        scores = judge([x["prompt"] + x["chosen"] for x in incoming_pairs] + [x["prompt"] + x["rejected"] for x in incoming_pairs])
        n = len(incoming_pairs)
        kept, dropped["num_dropped_incoming_pairs"] = pairs_with_margin(incoming_pairs, scores[:n], scores[n:],
                                                                        p.min_margin)
        if len(kept) < n:
            get_logger().warning("prepare: dropped %d incoming pair(s) whose chosen text the gold judge does not "
                                 "prefer by prepare.min_margin=%s", n - len(kept), p.min_margin)
        pairs += kept
    ratings = make_unpaired_ratings(train, judge, p.prompt_min_words, p.prompt_max_words, threshold=0.0,
                                    min_margin=NEUTRAL_BAND, seed=p.seed)
    kept_ratings, dropped["num_dropped_incoming_ratings"] = ratings_with_margin(
        incoming_ratings, judge([r["prompt"] + r["completion"] for r in incoming_ratings]) if incoming_ratings else [],
        threshold=0.0, min_margin=NEUTRAL_BAND)
    if len(kept_ratings) < len(incoming_ratings):
        get_logger().warning("prepare: dropped %d incoming rating(s) whose label the gold judge does not give (outside "
                             "its neutral band %s)", len(incoming_ratings) - len(kept_ratings), NEUTRAL_BAND)
    return {
        "sft_train": [{"text": t} for t in train],
        "heldout": [{"text": t} for t in heldout],
        "prompts_train": [{"query": q} for q in make_prompts(train, p.prompt_min_words, p.prompt_max_words, seed=p.seed)],
        "prompts_eval": [{"query": q} for q in make_prompts(heldout, p.prompt_min_words, p.prompt_max_words, seed=p.seed + 1)],
        "preferences": pairs,
        "ratings": ratings + kept_ratings,
    }


def _write_datasets(data_dir: Path, datasets: dict[str, list[dict]]) -> dict[str, int]:
    """Write every file to a temp name first, then rename them all: no half-written dataset survives."""
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp_paths = {}
    try:
        for name, records in datasets.items():
            tmp = data_dir / f".{name}.jsonl.tmp-{os.getpid()}"
            write_jsonl(records, tmp)
            tmp_paths[name] = tmp
    except BaseException:
        for tmp in tmp_paths.values():
            tmp.unlink(missing_ok=True)
        raise
    for name, tmp in tmp_paths.items():
        os.replace(tmp, data_dir / f"{name}.jsonl")
    return {name: len(records) for name, records in datasets.items()}


@task(name="prepare", retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input,
      cache_policy=NO_CACHE)
def prepare_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Materialise the datasets of ``params.yaml:prepare``; returns the metrics written to metrics/prepare.json."""
    require_single_process("prepare")  # not a training stage: one process (see tasks/distributed.py)
    root, params, p, io = load_stage(root, "prepare")
    paths = params.paths
    log = get_logger()

    # read and validate everything first
    reviews = load_source(p, root)
    incoming = IncomingData(reviews=[], pairs=read_feedback_pairs(root / paths.incoming),  # versioned by the intake
                            ratings=read_feedback_ratings(root / paths.incoming))
    log.info("prepare: %d reviews from %s, %d new reviews, %d new pairs and %d new ratings from %s", len(reviews),
             p.source, len(incoming.reviews), len(incoming.pairs), len(incoming.ratings), paths.incoming)
    if (warning := size_warning(len(reviews) + len(incoming.reviews))) is not None:
        log.warning(warning)
    judge = GoldJudge()
    dropped: dict[str, int] = {}
    datasets = build_datasets(p, reviews + incoming.reviews, incoming.pairs, judge, dropped, incoming.ratings)

    with stage_run("prepare", root, p, io["deps"], parent_run_id) as run:
        counts = _write_datasets(root / paths.data, datasets)
        (root / paths.data / SOURCE_FINGERPRINT).write_text(json.dumps(source_fingerprint(p, root)))
        gold = judge([r["text"] for r in datasets["sft_train"]])
        metrics = {
            "num_train": counts["sft_train"], "num_heldout": counts["heldout"],
            "num_prompts_train": counts["prompts_train"], "num_prompts_eval": counts["prompts_eval"],
            "num_pairs": counts["preferences"], "num_ratings": counts["ratings"],
            "num_desirable": sum(r["label"] for r in datasets["ratings"]), "num_incoming_reviews": len(incoming.reviews),
            "num_incoming_pairs": len(incoming.pairs), "num_incoming_ratings": len(incoming.ratings), **dropped,
            "gold_mean": round(statistics.fmean(gold), 4),
            "share_positive": round(sum(g > 0.05 for g in gold) / len(gold), 4),
            "share_negative": round(sum(g < -0.05 for g in gold) / len(gold), 4),
        }
        write_json(root / paths.metrics / "prepare.json", metrics)
        bins = [-1.0 + 0.2 * i for i in range(11)]
        hist = [{"gold_bin": round(lo + 0.1, 2), "count": sum(lo <= g < hi or (hi == 1.0 and g == 1.0) for g in gold)}
                for lo, hi in zip(bins[:-1], bins[1:])]
        write_csv(root / paths.plots / "prepare.csv", hist)
        run.log_metrics(metrics)
        for name in ("sft_train", "heldout", "prompts_train", "prompts_eval", "preferences", "ratings"):
            run.log_dataset(root / paths.data / f"{name}.jsonl", name, context="eval" if "eval" in name or name == "heldout" else "training")
        run.log_table("preference_samples", [{k: r[k] for k in ("prompt", "chosen", "rejected", "chosen_score", "rejected_score")}
                                             for r in datasets["preferences"][:20]])
        run.summary.update(metrics)
        log.info("prepare: wrote %s", ", ".join(f"{k}={v}" for k, v in counts.items()))
    return metrics
