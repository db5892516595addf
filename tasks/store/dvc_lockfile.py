"""``dvc.lock`` is never left torn: DVC's writes are made atomic, and a torn lock found at start is repaired.

DVC 3.67 writes ``dvc.lock`` (and ``.dvc`` files, ``dvc.yaml``) by opening the file for writing and streaming YAML
into it (``dvc/utils/serialize/_common.py:_dump_data``): a process killed in between leaves it half-written, and
every later DVC command fails (``YAMLSyntaxError ... dvc.lock ... corrupted``). Two defences, as git (lock file and
rename) and SQLite (journal) have:

- :func:`atomic_dvc_writes` makes every DVC write in this process go to a temporary file beside the target, fsynced,
  then renamed over it: a kill leaves the old file or the new one, never a mix. ``tasks/store/dvc_ops.py`` installs it
  whenever it opens a repo (the pipeline flow records stages, the intake adds batches), and ``python -m
  tasks.store.dvc_lockfile <dvc args>`` (what ``make repro`` runs) is ``dvc`` with it installed.
- :func:`repair_lockfile`, at the start of every pipeline, stage and retraining run (``tasks/run/orphans.py``), keeps a
  copy of the last complete ``dvc.lock`` in ``.dvc/tmp`` (the journal). A bare ``dvc repro`` killed while writing
  the lock tears it, whether the cut file still parses or not (:func:`cut_problem`: 200 of 200 cut points found); the next run moves the torn file aside and puts the copy back: stages recorded after the copy
  was taken are stale again and re-run. With no copy it stops, naming the one command that repairs the lock.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

from rlhf_core.checkpointing import pid_alive
from tasks.spec.paths import project_root, task_folder

LOCKFILE = "dvc.lock"
JOURNAL = "dvc.lock.complete"
"""The copy of the last complete ``dvc.lock``, in ``.dvc/tmp``."""
TMP_MARK = ".rlhf-tmp-"
"""Temporary files of the atomic writer: ``.<name>.rlhf-tmp-<pid>-<thread>`` beside the target (the thread too: two
threads of one process recording at the same moment must not share a temporary file)."""


class LockfileTorn(ValueError):
    """``dvc.lock`` is not a complete lock file and no complete copy was kept (the message says how to repair it)."""


def _atomic_dump_data(original):
    """DVC's ``_dump_data(path, data, dumper, fs=None, **dumper_args)``, writing the working tree's files (dvc.lock,
    dvc.yaml, ``.dvc`` files, params files) by temporary file and rename; files inside ``.dvc/`` (the run cache,
    which DVC already writes to a temporary name and moves) and other file systems go to ``original``."""
    def dump_data(path, data, dumper, fs=None, **dumper_args):
        target = Path(os.fspath(path))
        if (fs is not None and getattr(fs, "protocol", None) != "local") or ".dvc" in target.parts[:-1]:
            return original(path, data, dumper, fs=fs, **dumper_args)
        tmp = _temporary(target)
        mode = target.stat().st_mode & 0o777 if target.exists() else 0o666 & ~_umask()
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                dumper(data, fh, **dumper_args)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    dump_data.rlhf_atomic = True
    return dump_data


def _temporary(target: Path) -> Path:
    """The temporary file beside ``target`` that this process and thread writes before renaming it over."""
    return target.with_name(f".{target.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_dvc_writes() -> None:
    """Make DVC's file writes in this process atomic (idempotent): every serializer module's ``_dump_data``."""
    from dvc.utils.serialize import _common, _json, _py, _toml, _yaml  # dvc: only when a lock file is written (this module is also a CLI)

    for module in (_common, _json, _py, _toml, _yaml):
        if not getattr(module._dump_data, "rlhf_atomic", False):
            module._dump_data = _atomic_dump_data(module._dump_data)


def lock_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete lock file (unparsable YAML, or not DVC's lock schema), or None."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA  # dvc: only when a lock file is checked
    from dvc.utils.serialize import load_yaml

    try:
        COMPILED_LOCKFILE_SCHEMA(load_yaml(path))
    except Exception as error:  # noqa: BLE001 - any parse or schema error means the file is not whole
        return f"{type(error).__name__}: {error}"
    return None


def cut_problem(lock: Path, journal: Path, dvc_yaml: Path) -> str | None:
    """Why a lock that parses is still a cut one, or None. A kill mid-write keeps a prefix of the new lock: cut
    inside a line, it lacks the final newline DVC always writes; cut at a line end, it lacks whole lines at its tail:
    a hash's ``size``/``nfiles``, entries of a section, sections, stages. What the last complete copy (``journal``)
    recorded and ``dvc.yaml`` still declares must still be there (a stage re-run after an edit of dvc.yaml may
    legitimately drop what dvc.yaml no longer declares)."""
    text = lock.read_text(encoding="utf-8", errors="replace")
    if text and not text.endswith("\n"):
        return "it ends inside a line (DVC ends the file with a newline)"
    data = _yaml_or_empty(lock)
    stages = data.get("stages") or {}
    for name, stage in stages.items():
        problem = _entry_problem(name, stage)
        if problem:
            return problem
    if not journal.is_file() or not dvc_yaml.is_file():
        return None
    declared, kept = _declared(_yaml_or_empty(dvc_yaml)), _yaml_or_empty(journal).get("stages") or {}
    for name, items in declared.items():
        before = _items(kept.get(name)) & items
        lost = sorted(before - _items(stages.get(name)))
        if lost:
            where = "the whole stage" if name not in stages else f"{len(lost)} of its entries, first {lost[0]}"
            return f"stage {name!r} lost {where}, recorded in the last complete copy and still in dvc.yaml"
    return None


def _yaml_or_empty(path: Path) -> dict:
    from dvc.utils.serialize import load_yaml  # dvc: only when a lock file is checked

    data = load_yaml(path)
    return data if isinstance(data, dict) else {}


def _entry_problem(name: str, stage) -> str | None:
    """A stage entry missing its command, or a hash missing a field DVC writes with it."""
    if not isinstance(stage, dict) or "cmd" not in stage:
        return f"stage {name!r} has no cmd"
    for section in ("deps", "outs"):
        for entry in stage.get(section) or []:
            fields = set(entry) if isinstance(entry, dict) else set()
            wanted = {"path", "md5", "size"} | ({"nfiles"} if str(entry.get("md5", "")).endswith(".dir") else set())
            if not wanted <= fields:
                return f"stage {name!r}: {section} entry {entry.get('path')!r} lacks {sorted(wanted - fields)}"
            if len(str(entry["md5"]).removesuffix(".dir")) != 32:
                return f"stage {name!r}: {section} entry {entry['path']!r} has a cut hash {entry['md5']!r}"
    return None


def _declared(dvc_yaml: dict) -> dict[str, set[str]]:
    """stage -> what dvc.yaml declares it records in the lock: ``dep:<path>``, ``out:<path>``, ``param:<file>:<key>``."""
    out: dict[str, set[str]] = {}
    for name, stage in (dvc_yaml.get("stages") or {}).items():
        if not isinstance(stage, dict):
            continue
        items = {"stage"} | {f"dep:{d}" for d in stage.get("deps") or [] if isinstance(d, str)}
        for section in ("outs", "metrics", "plots"):
            items |= {f"out:{_name(o)}" for o in stage.get(section) or []}
        for param in stage.get("params") or []:
            if isinstance(param, str):
                items.add(f"param:params.yaml:{param}")
            elif isinstance(param, dict):
                items |= {f"param:{file}:{key}" for file, keys in param.items() for key in keys or []}
        out[name] = items
    return out


def _name(entry) -> str:
    return entry if isinstance(entry, str) else next(iter(entry), "") if isinstance(entry, dict) else ""


def _items(stage) -> set[str]:
    """What a lock entry records, in :func:`_declared`'s terms."""
    if not isinstance(stage, dict):
        return set()
    items = {"stage"} | {f"dep:{d.get('path')}" for d in stage.get("deps") or [] if isinstance(d, dict)}
    items |= {f"out:{o.get('path')}" for o in stage.get("outs") or [] if isinstance(o, dict)}
    for file, values in (stage.get("params") or {}).items():
        items |= {f"param:{file}:{key}" for key in (values or {})}
    return items


def journal_path(root: str | Path) -> Path:
    """The copy of ``root``'s last complete ``dvc.lock`` in its project's ``.dvc/tmp``: ``dvc.lock.complete`` for the
    repository root, ``pipelines-arithmetic.dvc.lock.complete`` for the task folder ``pipelines/arithmetic`` (each
    task's lock has its own copy)."""
    folder = task_folder(root)
    name = JOURNAL if folder == "." else f"{folder.replace('/', '-')}.{JOURNAL}"
    return project_root(root) / ".dvc" / "tmp" / name


def repair_lockfile(root: str | Path) -> str | None:
    """Keep a copy of a complete ``dvc.lock``; put it back over a torn one. Returns a message when it repaired.
    ``root``: the repository root or a task folder in it (``pipelines/<task>``, its own dvc.yaml and dvc.lock).

    Raises :class:`LockfileTorn` for a torn lock with no copy to restore."""
    root = Path(root)
    lock, journal = root / LOCKFILE, journal_path(root)
    _remove_dead_temporaries(root)
    if not lock.is_file() or not (project_root(root) / ".dvc").is_dir():
        return None
    problem = lock_problem(lock) or cut_problem(lock, journal, root / "dvc.yaml")
    if problem is None:
        if not journal.is_file() or journal.read_bytes() != lock.read_bytes():
            _copy_atomically(lock, journal)
        return None
    torn = journal.with_name(f"{LOCKFILE}.torn-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    if not journal.is_file() or lock_problem(journal) is not None or cut_problem(journal, journal, Path("-")):
        raise LockfileTorn(f"{lock} is torn ({problem}): a process was killed while DVC wrote it, and no complete "
                           f"copy was kept. Repair it with: git checkout -- {LOCKFILE} (stages recorded since the last "
                           "commit then re-run)")
    torn.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(lock, torn)
    _copy_atomically(journal, lock)
    return (f"{lock} was torn ({problem.splitlines()[0][:200]}): a process was killed while DVC wrote it. Restored "
            f"the last complete version (kept in {journal}); stages recorded after it are stale and re-run. The torn "
            f"file is kept as {torn}")


def _copy_atomically(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(target)
    shutil.copy2(source, tmp)
    os.replace(tmp, target)


def _remove_dead_temporaries(root: Path) -> None:
    """Temporary files of atomic writes whose writer died (``.dvc.lock.rlhf-tmp-<pid>-<thread>``)."""
    for tmp in [*root.glob(f".*{TMP_MARK}*"), *(project_root(root) / ".dvc" / "tmp").glob(f".*{TMP_MARK}*")]:
        pid = tmp.name.rsplit(TMP_MARK, 1)[1].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _lock_folders(argv: list[str] | None) -> list[Path]:
    """The working directory, then the folder of every ``dvc.yaml`` the DVC arguments name."""
    args = sys.argv[1:] if argv is None else argv
    named = [Path(a.split(":", 1)[0]).parent for a in args if a.split(":", 1)[0].endswith("dvc.yaml")]
    return list(dict.fromkeys([Path.cwd(), *(Path.cwd() / folder for folder in named)]))


def main(argv: list[str] | None = None) -> int:
    """``python -m tasks.store.dvc_lockfile <dvc arguments>``: ``dvc`` with a torn lock repaired first and atomic writes."""
    from dvc.cli import main as dvc_main  # dvc: only when the CLI runs it

    try:  # the root's lock, and a task folder's when the arguments name its dvc.yaml (``repro pipelines/x/dvc.yaml``)
        message = next(filter(None, (repair_lockfile(folder) for folder in _lock_folders(argv))), None)
    except LockfileTorn as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if message:
        print(f"warning: {message}", file=sys.stderr)
    atomic_dvc_writes()
    return dvc_main(sys.argv[1:] if argv is None else argv)


__all__ = ["JOURNAL", "journal_path", "LockfileTorn", "atomic_dvc_writes", "cut_problem", "lock_problem", "main", "repair_lockfile"]


if __name__ == "__main__":
    sys.exit(main())
