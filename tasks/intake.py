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
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import subprocess
from pathlib import Path

from rlhf_core.feedback import MANIFEST, Batch, IntakeLimits, canonical_bytes, stored_keys, validate_files
from tasks.dvc_ops import _repo
from tasks.tracking import get_logger

EVENT = "rlhf.feedback.ingested"


class IntakeError(RuntimeError):
    """The intake could not version a validated batch (DVC or git failed); nothing was ingested."""


def _write_batch(store: Path, batch: Batch) -> Path:
    target = store / batch.kind / f"{batch.sha256}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_bytes(canonical_bytes(batch.rows))
    os.replace(tmp, target)
    return target


def _git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise IntakeError(f"git {' '.join(args)} failed in {root}: {out.stderr.strip()}")
    return out.stdout.strip()


def _rollback(written: list[Path], created_dirs: list[Path]) -> None:
    """Remove the batches, their .dvc files and the kind directories this intake created (with the
    .gitignore DVC wrote there)."""
    for data in written:
        data.unlink(missing_ok=True)
        data.with_name(data.name + ".dvc").unlink(missing_ok=True)
    for folder in created_dirs:
        (folder / ".gitignore").unlink(missing_ok=True)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _record(batch: Batch, now: str, user: str) -> dict:
    return {"sha256": batch.sha256, "kind": batch.kind, "file": f"{batch.kind}/{batch.sha256}.jsonl",
            "rows": len(batch.rows), "source": str(batch.source.resolve()), "ingested_at": now, "user": user}


def ingest(root: str | Path, files: list[str | Path], store_dir: str = "incoming", push: bool = True,
           commit: bool = True, emit: bool = True, remote: str | None = None,
           limits: IntakeLimits = IntakeLimits()) -> list[dict]:
    """Validate ``files`` and add each as one batch to the store; returns the manifest records added.

    Raises :class:`~rlhf_core.data.DataFormatError` (bad input: nothing written) or :class:`IntakeError`."""
    root = Path(root).resolve()
    store = root / store_dir
    log = get_logger()
    batches = validate_files(files, stored_keys(store), limits)  # everything checked before anything is written
    now = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    user = os.environ.get("RLHF_INTAKE_USER") or getpass.getuser()
    records = [_record(b, now, user) for b in batches]
    created_dirs = sorted({store / b.kind for b in batches if not (store / b.kind).exists()})
    written = [_write_batch(store, b) for b in batches]
    try:
        with _repo(root) as repo:
            repo.add([str(p) for p in written])
            if push:
                repo.push(targets=[str(p) for p in written], remote=remote)
    except Exception as err:  # noqa: BLE001 - any DVC failure undoes the intake
        _rollback(written, created_dirs)
        raise IntakeError(f"intake: versioning {', '.join(map(str, written))} failed, nothing ingested: {err}") from err
    with open(store / MANIFEST, "a", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if commit:
        paths = [str(store / MANIFEST)] + [str(p) + ".dvc" for p in written] + [str(p.parent / ".gitignore") for p in written]
        paths = sorted(set(paths))
        _git(root, "add", "--", *paths)
        _git(root, "commit", "-q", "-m", _commit_message(records), "--", *paths)
    for r in records:
        log.info("intake: %s batch %s (%d rows) from %s", r["kind"], r["sha256"], r["rows"], r["source"])
    if emit:
        emit_ingested(records)
    return records


def _commit_message(records: list[dict]) -> str:
    lines = [f"feedback: ingest {len(records)} batch(es)", ""]
    lines += [f"- {r['kind']} {r['sha256'][:12]} ({r['rows']} rows) from {r['source']}" for r in records]
    return "\n".join(lines)


def emit_ingested(records: list[dict]) -> int:
    """Emit ``rlhf.feedback.ingested`` per batch to the Prefect server of ``PREFECT_API_URL``; returns how many
    were sent. Without a server configured there is nobody to trigger: nothing is sent (the cron still runs)."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():  # the environment variable or the active Prefect profile
        get_logger().info("intake: PREFECT_API_URL not set: no %s event sent (retraining runs on its cron)", EVENT)
        return 0
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    sent = 0
    for r in records:
        event = emit_event(event=EVENT, resource={"prefect.resource.id": f"rlhf.feedback.{r['sha256']}",
                                                  "prefect.resource.name": r["file"]},
                           payload={k: r[k] for k in ("sha256", "kind", "file", "rows", "source", "user")})
        sent += event is not None
    EventsWorker.drain_all()
    return sent
