"""Feedback intake: validate new feedback files, version them with DVC, record them, announce them.

The store is ``paths.incoming`` (``incoming/``), a git-tracked directory:

    incoming/manifest.jsonl            one line per batch: sha256, kind, file, rows, source, ingested_at, user
    incoming/pairs/<sha256>.jsonl      a preference batch (DVC-tracked: <sha256>.jsonl.dvc beside it)
    incoming/ratings/<sha256>.jsonl    an unpaired-ratings batch (KTO data), stored apart from the pairs

A batch is named by the SHA-256 of its canonical bytes, so every batch is recoverable by hash (``git
checkout <ref> && dvc pull``). ``prepare`` reads the pair batches the manifest lists, never loose files.
An intake is all or nothing: every file is validated first; if writing, ``dvc add`` or ``dvc push`` fails,
what was written is removed. Then the manifest and ``.dvc`` files are committed to git (only those paths)
and, with a Prefect server configured, the event ``rlhf.feedback.ingested`` is emitted (the retraining
deployment's trigger in prefect.yaml).

A killed intake is finished or undone by the next one (``tasks/feedback/intake_journal.py``): rolled forward when every
batch file it was writing is whole (``dvc add``, push, manifest and commit redone: each is idempotent), rolled back
when one is not. Duplicates are counted only against the batches the manifest lists, and a file that is exactly an
ingested batch is reported as such (exit 0): retrying a killed intake never loses or refuses what the user sent.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import subprocess
from pathlib import Path

from rlhf_core.feedback import (
    MANIFEST,
    Batch,
    IntakeLimits,
    canonical_bytes,
    read_manifest,
    stored_keys,
    validate_files,
)
from tasks.feedback.intake_journal import clear_journal, intake_lock, read_journal, scratch_dir, write_journal
from tasks.process.logs import get_logger
from tasks.store.dvc_ops import _repo
from tasks.store.outputs import temp_folder, write_atomic

EVENT = "rlhf.feedback.ingested"


class IntakeError(RuntimeError):
    """The intake could not version a validated batch (DVC or git failed); nothing was ingested."""


def _write_batch(store: Path, batch: Batch, scratch: Path) -> Path:
    """The batch file, written in ``scratch`` and renamed into the store (a kill before the rename leaves nothing in
    the store: it is a dependency of prepare, and a stray file there changed its hash)."""
    target = store / batch.kind / f"{batch.sha256}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(target, scratch) / f".{target.name}.tmp-{os.getpid()}"
    tmp.write_bytes(canonical_bytes(batch.rows))
    os.replace(tmp, target)
    return target


def intake_scratch(root: Path) -> Path:
    """Where the intake writes before renaming into the store: ``intake`` in ``.dvc/tmp`` (git-ignored, outside DVC's
    dependency paths)."""
    return scratch_dir(root) / "intake"


def clear_debris(store: Path, scratch: Path) -> list[Path]:
    """Remove what killed intakes left: temp files in ``scratch``, and any beside the store's files (where intakes
    before issue 33 wrote them). Called under the intake lock, so no intake is writing. Returns what was removed."""
    found = [p for p in scratch.glob(".*.tmp-*") if p.is_file()] if scratch.is_dir() else []
    if store.is_dir():
        found += [p for p in store.rglob(".*.tmp-*") if p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
        get_logger().warning("intake: removed %s, left by an intake that was killed before its rename", path)
    return found


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise IntakeError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
    return out.stdout.strip()


def _snapshot(store: Path, batches: list[Batch]) -> dict[Path, bytes | None]:
    """What an intake may change besides its new files: each kind's .gitignore and the manifest."""
    paths = {store / b.kind / ".gitignore" for b in batches} | {store / MANIFEST}
    return {p: p.read_bytes() if p.is_file() else None for p in paths}


def _rollback(written: list[Path], before: dict[Path, bytes | None]) -> None:
    """Remove the batches and their .dvc files; put .gitignore files and the manifest back as they were."""
    for data in written:
        data.unlink(missing_ok=True)
        data.with_name(data.name + ".dvc").unlink(missing_ok=True)
    for path, content in before.items():
        if content is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(content)
    for folder in {p.parent for p in written}:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _record(batch: Batch, now: str, user: str) -> dict:
    return {"sha256": batch.sha256, "kind": batch.kind, "file": f"{batch.kind}/{batch.sha256}.jsonl",
            "rows": len(batch.rows), "source": str(batch.source.resolve()), "ingested_at": now, "user": user}


def _version(root: Path, written: list[Path], push: bool, remote: str | None) -> None:
    """``dvc add`` the batches (cache + .dvc files) and push them to the remote."""
    try:
        with _repo(root) as repo:
            repo.add([str(p) for p in written])
            if push:
                repo.push(targets=[str(p) for p in written], remote=remote)
    except Exception as err:  # noqa: BLE001 - any DVC failure undoes the intake
        raise IntakeError(f"intake: versioning {', '.join(map(str, written))} failed, nothing ingested: {err}") from err


def _commit(root: Path, store: Path, written: list[Path], records: list[dict]) -> None:
    """Commit the manifest, the .dvc files and DVC's .gitignore entries (only those paths); nothing when they are
    committed already (an intake killed after its commit, rolled forward)."""
    paths = sorted({str(store / MANIFEST)} | {f"{p}.dvc" for p in written} | {str(p.parent / ".gitignore") for p in written})
    _git(root, "add", "--", *paths)
    if not _git(root, "diff", "--cached", "--name-only", "--", *paths):
        return
    try:
        _git(root, "commit", "-q", "-m", _commit_message(records), "--", *paths)
    except IntakeError:
        subprocess.run(["git", "reset", "-q", "--", *paths], cwd=root, capture_output=True)
        raise


def _append_manifest(store: Path, records: list[dict], scratch: Path | None = None) -> None:
    """Add ``records`` to the manifest in one rename (the intake's commit point: a kill leaves it whole, with or
    without them); records already there (by sha256) are not added twice."""
    path = store / MANIFEST
    listed = {r["sha256"] for r in read_manifest(store)}
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    new = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records if r["sha256"] not in listed)
    write_atomic(path, old + ("" if not old or old.endswith("\n") else "\n") + new, scratch)


def _store_batches(root: Path, store: Path, written: list[Path], records: list[dict], options: dict) -> None:
    """Version, record and commit batch files already written (the steps after ``_write_batch``)."""
    _version(root, written, options["push"], options["remote"])
    _append_manifest(store, records, intake_scratch(root))
    if options["commit"]:
        _commit(root, store, written, records)


def ingest(root: str | Path, files: list[str | Path], store_dir: str = "incoming", push: bool = True,
           commit: bool = True, emit: bool = True, remote: str | None = None,
           limits: IntakeLimits = IntakeLimits(), metrics_dir: str = "metrics") -> list[dict]:
    """Validate ``files`` and add each as one batch to the store; returns the manifest records added (a file that
    is exactly a batch already ingested adds nothing: it is logged as such).

    Raises :class:`~rlhf_core.data.DataFormatError` (bad input: nothing written) or :class:`IntakeError`
    (DVC or git failed: what was written is undone). An intake killed earlier is finished or undone first."""
    root = Path(root).resolve()
    store = root / store_dir
    options = {"push": push, "remote": remote, "commit": commit, "emit": emit}
    with intake_lock(root):
        recover_interrupted(root, store)
        clear_debris(store, intake_scratch(root))
        ingested = {r["sha256"]: r for r in read_manifest(store)}
        batches = validate_files(files, stored_keys(store), limits, ingested)  # all checked before anything is written
        for batch in (b for b in batches if b.ingested):
            get_logger().info("intake: %s is batch %s, already ingested (%s by %s): nothing to do", batch.source,
                              batch.sha256, batch.ingested.get("ingested_at"), batch.ingested.get("user"))
        batches = [b for b in batches if not b.ingested]
        if not batches:
            return []
        for warning in growth_warnings(root / metrics_dir / "prepare.json", batches):
            get_logger().warning("intake: %s", warning)
        now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        records = [_record(b, now, os.environ.get("RLHF_INTAKE_USER") or getpass.getuser()) for b in batches]
        before = _snapshot(store, batches)
        write_journal(root, records, before, options)  # from here on, a kill is finished or undone by the next intake
        written = [_write_batch(store, b, intake_scratch(root)) for b in batches]
        try:
            _store_batches(root, store, written, records, options)
        except BaseException:
            _rollback(written, before)
            clear_journal(root)
            raise
        clear_journal(root)
    for r in records:
        get_logger().info("intake: %s batch %s (%d rows) from %s", r["kind"], r["sha256"], r["rows"], r["source"])
    if emit:
        emit_ingested(records)
    return records


def recover_interrupted(root: Path, store: Path) -> list[dict]:
    """Finish or undo an intake that was killed (its journal is left; the caller holds the intake lock): rolled
    forward when it had written the manifest or every batch file is whole, else rolled back. Returns the records it
    completed ([] when there was nothing to do, or it rolled back)."""
    journal = read_journal(root)
    if journal is None:
        return []
    log, records = get_logger(), journal["records"]
    written = [store / r["file"] for r in records]
    listed = {r["sha256"] for r in read_manifest(store)}
    whole = all(p.is_file() and hashlib.sha256(p.read_bytes()).hexdigest() == p.stem for p in written)
    if all(r["sha256"] in listed for r in records) or whole:
        _store_batches(root, store, written, records, journal["options"])
        clear_journal(root)
        log.warning("intake: finished the intake of pid %s that was stopped before it completed: %s", journal["pid"],
                    ", ".join(f"{r['kind']} batch {r['sha256'][:12]} ({r['rows']} rows from {r['source']})"
                              for r in records))
        if journal["options"]["emit"]:
            emit_ingested(records)
        return records
    _rollback(written, journal["before"])
    clear_journal(root)
    log.warning("intake: undid the intake of pid %s that was stopped while writing its batches (nothing of it was "
                "recorded): ingest %s again", journal["pid"], ", ".join(r["source"] for r in records))
    return []


def growth_warnings(prepare_metrics: Path, batches: list[Batch]) -> list[str]:
    """What this intake does to the training data of the next retraining, per kind, when it at least doubles it:
    the pair count of reward_model and dpo, the rating count of kto (from the last ``metrics/prepare.json``)."""
    try:
        counts = json.loads(prepare_metrics.read_text())
    except (OSError, ValueError):
        return []
    warnings = []
    for kind, key, stages in (("pairs", "num_pairs", "reward_model and dpo"), ("ratings", "num_ratings", "kto")):
        added = sum(len(b.rows) for b in batches if b.kind == kind)
        now = counts.get(key)
        if added and isinstance(now, int) and added >= now:
            warnings.append(f"{added:,} {kind} more: the next retraining trains {stages} on up to {now + added:,} "
                            f"{kind} instead of {now:,} (about {(now + added) / max(now, 1):.0f}x the training time "
                            f"of those stages; {prepare_metrics.name} of the last run)")
    return warnings


def _commit_message(records: list[dict]) -> str:
    lines = [f"feedback: ingest {len(records)} batch(es)", ""]
    lines += [f"- {r['kind']} {r['sha256'][:12]} ({r['rows']} rows) from {r['source']}" for r in records]
    return "\n".join(lines)


def emit_ingested(records: list[dict]) -> int:
    """Emit ``rlhf.feedback.ingested`` per batch to the Prefect server of ``PREFECT_API_URL``; returns how many
    were sent. Without a server configured there is nobody to trigger: nothing is sent (the cron still runs)."""
    from prefect.settings import PREFECT_API_URL  # prefect: only when an event is emitted

    if not PREFECT_API_URL.value():  # the environment variable or the active Prefect profile
        get_logger().info("intake: PREFECT_API_URL not set: no %s event sent (no Prefect server to trigger: the "
                          "local intake retrains itself unless --no-retrain; `make retrain` trains later)", EVENT)
        return 0
    from prefect.events import emit_event  # (prefect)
    from prefect.events.worker import EventsWorker

    sent = 0
    for r in records:
        event = emit_event(event=EVENT, resource={"prefect.resource.id": f"rlhf.feedback.{r['sha256']}",
                                                  "prefect.resource.name": r["file"]},
                           payload={k: r[k] for k in ("sha256", "kind", "file", "rows", "source", "user")})
        sent += event is not None
    EventsWorker.drain_all()
    return sent
