"""Validation of new human feedback before it is versioned: preference pairs and unpaired ratings.

Two kinds of batch, one kind per file:

- ``pairs``: records with ``prompt``, ``chosen``, ``rejected`` (strings), the preference data of reward
  modelling and DPO;
- ``ratings``: records with ``prompt``, ``completion`` (strings) and ``label`` (true = desirable), the
  unpaired data of KTO.

Either kind may carry provenance columns (``PROVENANCE_FIELDS``: the trace(s) a row was judged on, the assessment
and the reviewer, as the review loop writes them): they are checked, kept in the stored batch after the schema's
fields, never part of what makes two rows duplicates, and never trained on (:func:`read_stored_pairs` and
:func:`read_stored_ratings` return the schema's fields only).

:func:`validate_batch` reads one ``.jsonl``/``.csv``/``.parquet`` file and returns its rows in a canonical
form (:func:`canonical_bytes` of which gives the batch's SHA-256, its name in the store) or raises
:class:`~rlhf_core.data.DataFormatError` naming the file and line of the first problem: schema, UTF-8,
empty fields, identical pair, a duplicate inside the batch or of a row already stored, size limits.
Pure apart from reading the file; nothing here writes, and nothing imports Prefect, MLflow or DVC.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rlhf_core.data import DataFormatError, check_preference_pair, iter_records

KIND_FIELDS = {"pairs": ("prompt", "chosen", "rejected"), "ratings": ("prompt", "completion", "label")}
PROVENANCE_FIELDS = {"pairs": ("chosen_trace_id", "rejected_trace_id", "assessment_id", "reviewer"),
                     "ratings": ("trace_id", "assessment_id", "reviewer")}
"""Optional columns of each kind naming where a row came from (MLflow trace and assessment ids, the reviewer)."""
MAX_PROVENANCE_CHARS = 256
"""Longest accepted provenance value (ids are about 35 characters; a reviewer's name is short)."""
SUFFIXES = (".jsonl", ".csv", ".parquet")
MANIFEST = "manifest.jsonl"
STORE_ENTRIES = {"README.md", MANIFEST, ".gitignore", *KIND_FIELDS}
_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


@dataclass(frozen=True)
class IntakeLimits:
    """Size limits of one feedback file; a file over any of them is refused whole."""

    max_file_bytes: int = 64 * 1024 * 1024
    """Largest accepted file on disk, in bytes."""
    max_rows: int = 200_000
    """Most records in one file."""
    max_field_chars: int = 20_000
    """Longest accepted prompt/chosen/rejected/completion, in characters."""


@dataclass
class Batch:
    """One validated file: its kind, canonical rows and the line each row came from."""

    source: Path
    """The file as given to the intake."""
    kind: str
    """``pairs`` or ``ratings``."""
    rows: list[dict] = field(default_factory=list)
    """Canonical rows: exactly the fields of ``KIND_FIELDS[kind]``, in that order."""
    lines: list[int] = field(default_factory=list)
    """1-based line (CSV/JSONL) or row (parquet) of each row in ``source``."""
    ingested: dict | None = None
    """The manifest record of this exact batch when it was ingested before (the intake then has nothing to do)."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(canonical_bytes(self.rows)).hexdigest()


def row_key(kind: str, row: Mapping) -> str:
    """What makes two rows duplicates: the same texts (a rating's label is not part of it, so a
    contradicting second label for the same completion is a duplicate too)."""
    texts = [row[k] for k in KIND_FIELDS[kind] if k != "label"]
    return hashlib.sha256(json.dumps([kind, *texts], ensure_ascii=False).encode("utf-8")).hexdigest()


def canonical_bytes(rows: Iterable[Mapping]) -> bytes:
    """The stored form of a batch: one JSON object per line, UTF-8, keys in schema order."""
    return "".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def detect_kind(path: Path, line: int, record: Mapping) -> str:
    """``pairs`` or ``ratings`` from a record's keys (the schema's fields, plus any of that kind's provenance
    columns); any other key set is a schema error."""
    keys = set(record)
    for kind, fields in KIND_FIELDS.items():
        if keys - set(PROVENANCE_FIELDS[kind]) == set(fields):
            return kind
    expected = " or ".join("{" + ", ".join(f) + "} (optional: " + ", ".join(PROVENANCE_FIELDS[k]) + ")"
                           for k, f in KIND_FIELDS.items())
    raise DataFormatError(path, line, f"fields {sorted(keys)} match no feedback schema (expected {expected})")


def _text(path: Path, line: int, record: Mapping, key: str, limits: IntakeLimits) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataFormatError(path, line, f"field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise DataFormatError(path, line, f"field {key!r} is empty")
    if len(value) > limits.max_field_chars:
        raise DataFormatError(path, line, f"field {key!r} has {len(value)} characters (limit {limits.max_field_chars})")
    if "\x00" in value:
        raise DataFormatError(path, line, f"field {key!r} contains a NUL character")
    return value


def _label(path: Path, line: int, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise DataFormatError(path, line, f"field 'label' must be true or false, got {value!r}")


def _provenance(path: Path, line: int, record: Mapping, key: str) -> str:
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(path, line, f"field {key!r} must be a non-empty string, got {value!r}")
    if len(value) > MAX_PROVENANCE_CHARS:
        raise DataFormatError(path, line, f"field {key!r} has {len(value)} characters (limit {MAX_PROVENANCE_CHARS})")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise DataFormatError(path, line, f"field {key!r} contains a control character")
    return value.strip()


def canonical_row(path: Path, line: int, kind: str, record: Mapping, limits: IntakeLimits) -> dict:
    """Check one record's fields and return it with the schema's keys (prompt stripped), then the provenance
    columns it has, in ``PROVENANCE_FIELDS`` order."""
    row = {}
    for key in KIND_FIELDS[kind]:
        if key == "label":
            row[key] = _label(path, line, record[key])
        else:
            text = _text(path, line, record, key, limits)
            row[key] = text.strip() if key == "prompt" else text
    if kind == "pairs":
        check_preference_pair(row, path, line)  # chosen == rejected (ignoring surrounding space) states no preference
    row.update({key: _provenance(path, line, record, key) for key in PROVENANCE_FIELDS[kind] if key in record})
    return row


def validate_batch(path: str | Path, seen: Mapping[str, str] | None = None,
                   limits: IntakeLimits = IntakeLimits()) -> Batch:
    """Read and check one feedback file; ``seen`` maps :func:`row_key` of rows already stored (or in
    earlier files of the same intake) to where they are, so cross-batch duplicates are named."""
    path = Path(path)
    seen = seen or {}
    if path.suffix.lower() not in SUFFIXES:
        raise DataFormatError(path, None, f"unsupported file type {path.suffix!r} (use {', '.join(SUFFIXES)})")
    if not path.is_file():
        raise DataFormatError(path, None, "no such file")
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise DataFormatError(path, None, f"file has {size} bytes (limit {limits.max_file_bytes})")
    batch: Batch | None = None
    first_line: dict[str, int] = {}
    for _, line, record in iter_records(path):
        kind = detect_kind(path, line, record)
        if batch is None:
            batch = Batch(path, kind)
        elif kind != batch.kind:
            raise DataFormatError(path, line, f"a {kind} record in a file of {batch.kind} (one kind per file)")
        if len(batch.rows) >= limits.max_rows:
            raise DataFormatError(path, line, f"more than {limits.max_rows} records (limit max_rows)")
        row = canonical_row(path, line, kind, record, limits)
        key = row_key(kind, row)
        if key in first_line:
            raise DataFormatError(path, line, f"duplicate of line {first_line[key]}")
        first_line[key] = line
        batch.rows.append(row)
        batch.lines.append(line)
    if batch is None:
        raise DataFormatError(path, None, "no records")
    check_not_ingested(batch, seen)
    return batch


def check_not_ingested(batch: Batch, seen: Mapping[str, str]) -> None:
    """Refuse ``batch`` at its first row already in ``seen`` (``row_key -> where``), naming both places."""
    for row, line in zip(batch.rows, batch.lines):
        where = seen.get(row_key(batch.kind, row))
        if where is not None:
            raise DataFormatError(batch.source, line, f"duplicate of a row already ingested ({where})")


def validate_files(paths: Iterable[str | Path], seen: Mapping[str, str] | None = None,
                   limits: IntakeLimits = IntakeLimits(), ingested: Mapping[str, dict] | None = None) -> list[Batch]:
    """Validate several files as one intake: a row repeated in a later file is a duplicate too. A file that is
    exactly a batch of ``ingested`` (manifest records by sha256) is not a duplicate but that batch again: it is
    returned with ``.ingested`` set (ingesting is idempotent, as ``git add`` of an unchanged file is)."""
    known = dict(seen or {})
    batches = []
    for path in paths:
        batch = validate_batch(path, None, limits)
        batch.ingested = (ingested or {}).get(batch.sha256)
        if batch.ingested is None:
            check_not_ingested(batch, known)
        known.update({row_key(batch.kind, row): f"{path}:{line}" for row, line in zip(batch.rows, batch.lines)})
        batches.append(batch)
    return batches


def stored_keys(store: str | Path) -> dict[str, str]:
    """``row_key -> "<batch file>:<line>"`` for every row of the batches the manifest lists. A batch file the manifest
    does not list (an intake killed before recording it) is not ingested: it neither trains nor makes a duplicate."""
    store = Path(store)
    keys: dict[str, str] = {}
    for record in read_manifest(store):
        file = store / record["file"]
        if file.is_file():  # a listed batch not pulled yet cannot be compared (prepare asks for `dvc pull`)
            for _, line, row in iter_records(file):
                keys[row_key(record["kind"], row)] = f"{file}:{line}"
    return keys


def read_stored_rows(store: str | Path, batch_files: Iterable[str]) -> list[dict]:
    """Every row, provenance columns included, of the stored batches named (paths relative to ``store``), in that
    order; each file's content must still match the hash it is named by."""
    store = Path(store)
    rows = []
    for name in batch_files:
        file = store / name
        if not file.is_file():
            raise FileNotFoundError(f"{file}: a batch in the feedback manifest is missing (run `dvc pull`)")
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        if file.stem != digest:
            raise DataFormatError(file, None, f"content hash {digest} does not match the batch name (file edited?)")
        rows += [dict(r) for _, _, r in iter_records(file)]
    return rows


def read_stored_pairs(store: str | Path, batch_files: Iterable[str]) -> list[dict]:
    """The preference pairs of the stored batches named, in that order: prompt, chosen, rejected only."""
    return [{k: r[k] for k in KIND_FIELDS["pairs"]} for r in read_stored_rows(store, batch_files)]


def read_stored_ratings(store: str | Path, batch_files: Iterable[str]) -> list[dict]:
    """The unpaired ratings of the stored batches named, in that order: prompt, completion, label only."""
    return [{k: r[k] for k in KIND_FIELDS["ratings"]} for r in read_stored_rows(store, batch_files)]


def read_manifest(store: Path) -> list[dict]:
    """The manifest's records, oldest first (empty when nothing was ingested yet)."""
    path = store / MANIFEST
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def check_no_loose_files(store: Path) -> None:
    """Files dropped straight into the store are not versioned: refuse the first with the command to use."""
    loose = sorted(p.name for p in store.iterdir() if p.name not in STORE_ENTRIES) if store.is_dir() else []
    if loose:
        raise DataFormatError(store / loose[0], None, "not ingested (unversioned): feedback enters through "
                              "`python -m flows.intake FILE...` (or `make intake FILE=...`); move this file out of "
                              f"{store.name}/ and ingest it" + (f" (also loose here: {', '.join(loose[1:])})" if loose[1:] else ""))


def read_feedback_pairs(store: str | Path) -> list[dict]:
    """Every ingested preference pair, in manifest order (what ``prepare`` reads)."""
    store = Path(store)
    check_no_loose_files(store)
    files = [r["file"] for r in read_manifest(store) if r["kind"] == "pairs"]
    return read_stored_pairs(store, files)


def read_feedback_ratings(store: str | Path) -> list[dict]:
    """Every ingested unpaired rating, in manifest order (what ``prepare`` adds to KTO's ratings)."""
    store = Path(store)
    check_no_loose_files(store)
    files = [r["file"] for r in read_manifest(store) if r["kind"] == "ratings"]
    return read_stored_ratings(store, files)
