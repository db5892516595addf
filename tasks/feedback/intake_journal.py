"""The intake's journal and lock: what lets the next intake finish or undo one that was killed (issue 24).

An intake changes several things that cannot move together: batch files, their ``.dvc`` files and ``.gitignore``
lines (``dvc add``), the DVC remote (``dvc push``), the manifest, and a git commit. Before it writes anything it
records what it is about to do in ``rlhf-intake.journal`` in ``.dvc/tmp`` (as SQLite writes its journal before the
database): the manifest records it will add, the options it runs with, and the store files it may change as they
were. The next intake rolls a killed one forward when every batch file it was writing is whole (``dvc add``, the
push, the manifest write in one rename, and the git commit are redone or completed: each is idempotent), and back
when one is not (what it wrote is removed, ``.gitignore`` lines and the manifest put back; the user's files were
never recorded, and the log says to ingest them again). One intake at a time holds ``rlhf-intake.lock`` in ``.dvc/tmp``
(a ``flock``: a killed holder's lock is free at once), so no intake recovers another that is still running.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.store.outputs import write_atomic

JOURNAL = "rlhf-intake.journal"
LOCK = "rlhf-intake.lock"


def scratch_dir(root: Path) -> Path:
    """``.dvc/tmp`` (git-ignored, DVC's own scratch), where the checkout lock lives too."""
    return root / ".dvc" / "tmp"


def journal_path(root: Path) -> Path:
    return scratch_dir(root) / JOURNAL


def intake_lock(root: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the intake lock for the block; a second intake waits (an intake takes seconds)."""
    return scratch_lock(root, LOCK)


@contextlib.contextmanager
def scratch_lock(root: Path, name: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``name`` in the scratch folder for the block; a second holder waits. The kernel
    drops it when the holder dies (even on ``kill -9``), so a killed process never leaves it taken."""
    path = scratch_dir(root) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


def write_journal(root: Path, records: list[dict], before: dict[Path, bytes | None], options: dict[str, Any]) -> None:
    """Record an intake about to start: its manifest records, options, and the store files as they were."""
    entry = {"pid": os.getpid(), "records": records, "options": options,
             "before": {str(p): (None if c is None else c.decode("utf-8")) for p, c in before.items()}}
    write_atomic(journal_path(root), json.dumps(entry, ensure_ascii=False))


def read_journal(root: Path) -> dict | None:
    """The journal of an intake that did not finish, or None. An unreadable journal (a kill while the journal
    itself was written, before anything else) is no journal."""
    path = journal_path(root)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except ValueError:
        path.unlink(missing_ok=True)
        return None
    entry["before"] = {Path(p): (None if c is None else c.encode("utf-8")) for p, c in entry["before"].items()}
    return entry


def clear_journal(root: Path) -> None:
    journal_path(root).unlink(missing_ok=True)


__all__ = ["JOURNAL", "clear_journal", "intake_lock", "journal_path", "read_journal", "scratch_lock",
           "write_journal"]
