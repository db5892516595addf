"""Reviewers' judgements -> versioned feedback batches (``make intake-feedback``, and the scheduled deployment).

:func:`collect` reads the judgements (``tasks/feedback/assessments.py``) made on served generations since the last collection and
ingests them through the feedback intake itself (``tasks/feedback/intake.py``: the same validation, DVC versioning, manifest,
git commit and ``rlhf.feedback.ingested`` event as ``make intake FILE=...``):

- a rating ``good`` on a trace -> a ``ratings`` row: prompt, completion, label, then trace_id, assessment_id, reviewer;
- a preference ``preferred`` = true on a trace -> a ``pairs`` row: prompt, chosen (that trace's answer), rejected
  (the answer of the trace in its ``rejected_trace_id``), then chosen_trace_id, rejected_trace_id, assessment_id,
  reviewer.

Only valid human judgements count (MLflow marks a judgement a reviewer changed as invalid, and the change is a new
one). Each row is checked first with the intake's own functions (schema, empty or identical texts, limits, a
duplicate of a stored row or of an earlier judgement of this collection): one that fails is left out of the batch and
marked on its trace (tag ``rlhf.intake.<assessment id>`` = ``refused: <why>``), never dropped silently; a row that
was ingested is marked there with its batch (``<kind> batch <sha256>``).

**Collecting twice adds nothing twice.** What was collected is the ``assessment_id`` column of the stored batches:
it is committed with the batch, in the batch. A collection first lets the intake finish or undo an intake that was
killed (its journal), then leaves out every judgement already in a batch or marked refused. So a collection killed
after it read the judgements and before the intake's commit is either finished by the next one (its batch files were
whole) or undone and collected again, into the same bytes: nothing is lost or ingested twice. One collection at a
time holds ``rlhf-collect.lock`` in ``.dvc/tmp``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlflow
from mlflow.entities import AssessmentSourceType

from rlhf_core.data import DataFormatError
from rlhf_core.feedback import (IntakeLimits, canonical_bytes, canonical_row, read_manifest, read_stored_rows, row_key,
                                stored_keys)
from tasks.feedback.assessments import CHOSEN_KEY, PREFERENCE, RATING, REJECTED_KEY, Generation, generation, load_generation
from tasks.feedback.intake import ingest, recover_interrupted
from tasks.feedback.intake_journal import intake_lock, scratch_dir, scratch_lock
from tasks.process.logs import get_logger
from tasks.serving.answer import SERVED_TAG
from tasks.store.mlflow_runs import mlflow_setup

MARK = "rlhf.intake."
"""Trace tag prefix: ``rlhf.intake.<assessment id>`` says what the intake did with that judgement."""
UNNAMED = "(unnamed)"
"""The reviewer recorded for a human judgement whose source names nobody (MLflow's UI without a login)."""
COLLECT_LOCK = "rlhf-collect.lock"
SCRATCH = "review"
"""Under ``.dvc/tmp``: the files a collection hands to the intake (named by kind and time; kept, git-ignored)."""


@dataclass(frozen=True)
class Judgement:
    """One human judgement to collect: the assessment and the generation(s) it judged."""

    assessment_id: str
    kind: str
    """``ratings`` or ``pairs``."""
    reviewer: str
    value: object
    """The rating's value (the label); for a preference, True."""
    judged: Generation
    """The rated generation, or the chosen one."""
    rejected: Generation | None = None
    created_ms: int = 0


@dataclass(frozen=True)
class Refusal:
    """A judgement left out of the batches, and why (recorded on its trace)."""

    assessment_id: str
    trace_id: str
    reason: str


@dataclass
class Collection:
    """What a collection found and did."""

    rows: dict[str, list[dict]] = field(default_factory=lambda: {"pairs": [], "ratings": []})
    """The rows handed to the intake, per kind (provenance columns included)."""
    refused: list[Refusal] = field(default_factory=list)
    """Each judgement left out, with why."""
    records: list[dict] = field(default_factory=list)
    """The manifest records the intake added."""


def collect_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """One collection at a time (a second waits: a collection takes seconds)."""
    return scratch_lock(root, COLLECT_LOCK)


def collected_ids(store: Path) -> set[str]:
    """The assessment ids in the stored batches the manifest lists (what earlier collections ingested). Every batch
    must be here: one not pulled yet raises (``dvc pull``), rather than its judgements being collected again."""
    files = [r["file"] for r in read_manifest(store)]
    return {r["assessment_id"] for r in read_stored_rows(store, files) if "assessment_id" in r}


def _reviewer(assessment) -> str:
    source_id = assessment.source.source_id if assessment.source else ""
    return (source_id or "").strip() or UNNAMED


def _is_candidate(assessment, trace_tags: dict[str, str], done: set[str]) -> bool:
    """A valid human judgement of our two kinds, not collected and not refused before."""
    return (assessment.name in (RATING, PREFERENCE) and assessment.valid is not False
            and assessment.source is not None and assessment.source.source_type == AssessmentSourceType.HUMAN
            and assessment.assessment_id not in done and MARK + assessment.assessment_id not in trace_tags
            and not (assessment.name == PREFERENCE and _value(assessment) is not True))  # the rejected side's mirror


def _value(assessment):
    return assessment.feedback.value if assessment.feedback is not None else None


def _judged_traces(client, experiment_id: str, name: str) -> Iterator:
    """Served traces (spans included) carrying a ``name`` judgement, oldest first, page by page."""
    token = None
    while True:
        page = client.search_traces(locations=[experiment_id], max_results=100, page_token=token,
                                    filter_string=f"tags.`{SERVED_TAG}` = 'true' AND feedback.`{name}` IS NOT NULL",
                                    order_by=["timestamp_ms ASC"])
        yield from page
        token = page.token
        if not token:
            return


def find_judgements(client, experiment_id: str, done: set[str]) -> tuple[list[Judgement], list[Refusal]]:
    """New judgements in judgement order (creation time, then id), and the refusals of unusable ones."""
    found, unusable = [], []
    for name in (RATING, PREFERENCE):
        for trace in _judged_traces(client, experiment_id, name):
            judged = generation(trace)
            for a in trace.info.assessments:
                if a.name != name or not _is_candidate(a, trace.info.tags, done):
                    continue
                try:
                    found.append(_judgement(client, a, judged, trace.info.trace_id))
                except ValueError as error:  # JudgementError too: a rejected trace that is not a generation
                    unusable.append(Refusal(a.assessment_id, trace.info.trace_id, str(error)))
    found.sort(key=lambda j: (j.created_ms, j.assessment_id))
    return found, unusable


def _judgement(client, assessment, judged: Generation | None, trace_id: str) -> Judgement:
    if judged is None:
        raise ValueError(f"trace {trace_id} is not a generation of the served policy")
    kind, rejected, value = "ratings", None, _value(assessment)
    if assessment.name == PREFERENCE:
        other = (assessment.metadata or {}).get(REJECTED_KEY)
        if not other:
            raise ValueError(f"a `{PREFERENCE}` judgement needs the rejected trace in its metadata ({REJECTED_KEY})")
        kind, rejected = "pairs", load_generation(client, other)
    return Judgement(assessment.assessment_id, kind, _reviewer(assessment), value, judged, rejected,
                     assessment.create_time_ms or 0)


def judgement_row(j: Judgement) -> dict:
    """The feedback row of a judgement, before the intake's checks."""
    if j.kind == "ratings":
        return {"prompt": j.judged.prompt, "completion": j.judged.completion, "label": j.value,
                "trace_id": j.judged.trace_id, "assessment_id": j.assessment_id, "reviewer": j.reviewer}
    if j.rejected.prompt != j.judged.prompt:
        raise DataFormatError(f"assessment {j.assessment_id}", None,
                              f"traces {j.judged.trace_id} and {j.rejected.trace_id} answer different prompts")
    return {"prompt": j.judged.prompt, "chosen": j.judged.completion, "rejected": j.rejected.completion,
            CHOSEN_KEY: j.judged.trace_id, REJECTED_KEY: j.rejected.trace_id, "assessment_id": j.assessment_id,
            "reviewer": j.reviewer}


def latest_judgements(judgements: list[Judgement]) -> tuple[list[Judgement], list[Refusal]]:
    """A reviewer's latest judgement of the same thing wins: a rating of one trace (Good, then Bad: the correction),
    a preference between the same two traces (A over B, then B over A). The earlier ones are left out, marked on
    their traces as superseded by the later one (kept in the lineage, never dropped silently). ``judgements`` are in
    judgement order; the result keeps it."""
    latest: dict[tuple, Judgement] = {}
    for j in judgements:
        latest[(j.reviewer, j.kind, _subject(j))] = j
    kept, refused = [], []
    for j in judgements:
        winner = latest[(j.reviewer, j.kind, _subject(j))]
        if winner is j:
            kept.append(j)
        else:
            refused.append(Refusal(j.assessment_id, j.judged.trace_id, f"superseded by {winner.assessment_id}, "
                                   f"{j.reviewer}'s later judgement of the same "
                                   f"{'answer' if j.kind == 'ratings' else 'pair'}"))
    return kept, refused


def _subject(j: Judgement) -> tuple:
    return (j.judged.trace_id,) if j.kind == "ratings" else tuple(sorted([j.judged.trace_id, j.rejected.trace_id]))


def check_rows(judgements: list[Judgement], stored: dict[str, str], limits: IntakeLimits, collection: Collection) -> None:
    """Put each judgement's row through the intake's row checks (schema, texts, limits, duplicates of stored rows
    and of earlier judgements); rows that pass go to ``collection.rows``, the others to ``collection.refused``."""
    seen = dict(stored)
    for j in judgements:
        where = f"assessment {j.assessment_id}"
        try:
            row = canonical_row(Path(where), None, j.kind, judgement_row(j), limits)
            key = row_key(j.kind, row)
            if key in seen:
                raise DataFormatError(where, None, f"duplicate of a row already ingested or judged ({seen[key]})")
            if len(collection.rows[j.kind]) >= limits.max_rows:  # the rest waits for the next collection
                continue
        except DataFormatError as error:
            collection.refused.append(Refusal(j.assessment_id, j.judged.trace_id, str(error)))
            continue
        seen[key] = where
        collection.rows[j.kind].append(row)


def _write_files(root: Path, rows: dict[str, list[dict]]) -> list[Path]:
    """One JSONL file per kind with rows, under ``review`` in ``.dvc/tmp`` (the intake reads it and stores its batch)."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    folder = scratch_dir(root) / SCRATCH
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for kind, kind_rows in rows.items():
        if kind_rows:
            path = folder / f"review-{kind}-{stamp}.jsonl"
            path.write_bytes(canonical_bytes(kind_rows))
            files.append(path)
    return files


def marks(collection: Collection) -> list[tuple[str, str, str]]:
    """(trace id, tag, value) saying what the intake did with each judgement: its batch, or why it was refused."""
    out = []
    for record in collection.records:
        for row in collection.rows[record["kind"]]:
            for key in ("trace_id", CHOSEN_KEY, REJECTED_KEY):
                if key in row:
                    out.append((row[key], MARK + row["assessment_id"], f"{record['kind']} batch {record['sha256']}"))
    out += [(r.trace_id, MARK + r.assessment_id, f"refused: {r.reason}"[:1000]) for r in collection.refused]
    return out


def _tag(client, tags: list[tuple[str, str, str]]) -> None:
    for trace_id, key, value in tags:
        try:
            client.set_trace_tag(trace_id, key, value)
        except Exception as error:  # noqa: BLE001 - the batches are the record; a refusal is simply found again
            get_logger().warning("intake-feedback: could not tag trace %s (%s)", trace_id, error)


def collect(root: str | Path, store_dir: str = "incoming", push: bool = True, commit: bool = True, emit: bool = True,
            remote: str | None = None, limits: IntakeLimits = IntakeLimits(), metrics_dir: str = "metrics") -> Collection:
    """Ingest the judgements made since the last collection (see the module docstring); the options are
    :func:`tasks.feedback.intake.ingest`'s. Raises what ``ingest`` raises (nothing of this collection is then ingested, and
    the next collection takes the same judgements again)."""
    root = Path(root).resolve()
    store = root / store_dir
    collection = Collection()
    with collect_lock(root):
        with intake_lock(root):
            recover_interrupted(root, store)  # a killed intake's batch is in (or out) before we look at the batches
        experiment_id = mlflow_setup(root)
        client = mlflow.MlflowClient()
        judgements, collection.refused = find_judgements(client, experiment_id, collected_ids(store))
        judgements, superseded = latest_judgements(judgements)
        collection.refused += superseded
        check_rows(judgements, stored_keys(store), limits, collection)
        files = _write_files(root, collection.rows)
        if files:
            collection.records = ingest(root, files, store_dir=store_dir, push=push, commit=commit, emit=emit,
                                        remote=remote, limits=limits, metrics_dir=metrics_dir)
        _tag(client, marks(collection))
    for refusal in collection.refused:
        get_logger().warning("intake-feedback: left out %s on trace %s: %s", refusal.assessment_id, refusal.trace_id,
                             refusal.reason)
    return collection
