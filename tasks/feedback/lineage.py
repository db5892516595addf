"""Which human feedback taught a registered policy: the feedback batches it trained from and, through their rows,
the traces and judgements (MLflow assessments) behind them.

The registry step (``tasks/registry/gate.py``) puts :func:`feedback_tags` on every version it registers and logs
:func:`feedback_lineage` as ``feedback_lineage.json`` in its MLflow run (the version's run). The way back from a
version: its tags ``feedback.batches`` (SHA-256 of each batch = its file name under ``incoming/<kind>/``, restored by
``git checkout <commit> && dvc pull``) and ``feedback.manifest_md5`` (the manifest listing them, in git at
``lineage.git_commit``); then ``feedback_lineage.json`` lists per batch the trace ids, assessment ids and reviewers
of its rows: each trace opens in MLflow's UI with the judgement on it.

Only the feedback that can reach the policy's training counts: the kinds whose prepared file is an input of the
policy's stage or of a stage it trains from (``pairs`` -> ``data/preferences.jsonl``: reward model, DPO, and the
policies scored by the reward model; ``ratings`` -> ``data/ratings.jsonl``: KTO). And only the rows that entered
training are named (issue 33): an ingested row is listed when its texts (and a rating's label) are a row of that
prepared file, the file the policy's training read. ``prepare`` leaves a row out with ``incoming_judge: agree`` when
the gold judge disagrees (``metrics/prepare.json`` counts them), and a batch ingested after ``prepare`` last ran is in
no prepared file yet: neither is named; each batch says how many of its rows trained (``rows_trained``), a batch with
none is left out, and ``rows_not_trained`` counts the rest.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlhf_core.data import read_jsonl
from rlhf_core.feedback import KIND_FIELDS, MANIFEST, PROVENANCE_FIELDS, read_manifest, read_stored_rows
from tasks.store.provenance import md5_file

LINEAGE_FILE = "feedback_lineage.json"
"""The artifact of the registry's MLflow run listing the batches and judgements behind the version."""
PREPARED_FILE = {"pairs": "preferences.jsonl", "ratings": "ratings.jsonl"}
"""Where ``prepare`` puts each kind of ingested feedback (under ``paths.data``)."""
TAG_LIMIT = 5000
"""Longest tag value written (MLflow model version tags hold 5000 characters)."""


def training_inputs(io: dict, stage: str) -> set[str]:
    """Every file a stage reads, directly or through the stages that produce its inputs; ``io``: every stage's
    files by name (``tasks.stages.stage_files``)."""
    producer = {out: name for name, spec in io.items() for out in spec.outs.values()}
    inputs, todo = set(), [stage]
    while todo:
        for dep in io[todo.pop()].deps.values():
            if dep not in inputs:
                inputs.add(dep)
                if dep in producer:
                    todo.append(producer[dep])
    return inputs


def feedback_kinds(paths, io: dict, stage: str) -> list[str]:
    """The feedback kinds that reach ``stage``'s training."""
    inputs = training_inputs(io, stage)
    return [kind for kind, name in PREPARED_FILE.items() if f"{paths.data}/{name}" in inputs]


def trained_key(kind: str, row: dict) -> str:
    """What a prepared row and the stored row it came from share: the kind's schema fields (texts, a rating's label)."""
    return json.dumps([row[k] for k in KIND_FIELDS[kind]], ensure_ascii=False)


def trained_rows(root: Path, paths, kind: str) -> set[str]:
    """:func:`trained_key` of every row of ``kind``'s prepared file (what the policy's training read); a clear error
    when it is missing (the registry runs after ``prepare``: a missing file means the outputs were not restored)."""
    prepared = root / paths.data / PREPARED_FILE[kind]
    if not prepared.is_file():
        raise FileNotFoundError(f"{paths.data}/{PREPARED_FILE[kind]}: missing, so the feedback that trained the policy "
                                f"cannot be named; restore it (`dvc pull`) or run the pipeline")
    return {trained_key(kind, row) for row in read_jsonl(prepared) if all(k in row for k in KIND_FIELDS[kind])}


def feedback_lineage(root: str | Path, paths, io: dict, stage: str) -> dict:
    """The batches of the kinds that reach ``stage`` (manifest order) whose rows entered its training, with the
    provenance of those rows only (:func:`trained_rows`)."""
    root = Path(root)
    store = root / paths.incoming
    kinds = feedback_kinds(paths, io, stage)
    manifest = store / MANIFEST
    records = [r for r in read_manifest(store) if r["kind"] in kinds]
    trained = {kind: trained_rows(root, paths, kind) for kind in {r["kind"] for r in records}}
    batches, not_trained = [], 0
    for record in records:
        kind, keys = record["kind"], PROVENANCE_FIELDS[record["kind"]]
        stored = read_stored_rows(store, [record["file"]])
        rows = [row for row in stored if trained_key(kind, row) in trained[kind]]
        not_trained += len(stored) - len(rows)
        if rows:
            batches.append({**{k: record.get(k) for k in ("sha256", "kind", "file", "rows", "ingested_at", "user")},
                            "rows_trained": len(rows), "dvc_md5": md5_file(store / record["file"]),
                            "judgements": [{k: row[k] for k in keys if k in row} for row in rows
                                           if "assessment_id" in row]})
    return {"policy": stage, "kinds": kinds,
            "manifest_md5": hashlib.md5(manifest.read_bytes()).hexdigest() if manifest.is_file() else "none",
            "batches": batches, "rows_not_trained": not_trained}


def feedback_tags(lineage: dict) -> dict[str, str]:
    """The version tags summing up :func:`feedback_lineage` (the full lists are in its artifact)."""
    judgements = [j for b in lineage["batches"] for j in b["judgements"]]
    return {"feedback.kinds": ",".join(lineage["kinds"]) or "none",
            "feedback.manifest_md5": lineage["manifest_md5"],
            "feedback.batches": _fit([b["sha256"] for b in lineage["batches"]]),
            "feedback.judgements": str(len(judgements)),
            "feedback.reviewers": _fit(sorted({j["reviewer"] for j in judgements if "reviewer" in j})),
            "feedback.lineage": f"{LINEAGE_FILE} in the registry run's artifacts"}


def _fit(values: list[str]) -> str:
    """``values`` comma-joined; when they do not fit a tag, the newest that do (the artifact has them all)."""
    kept = list(values)
    text = ",".join(kept) or "none"
    while len(text) > TAG_LIMIT:
        kept = kept[1:]
        text = f"(the oldest {len(values) - len(kept)} in {LINEAGE_FILE})," + ",".join(kept)
    return text
