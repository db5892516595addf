"""DVC bookkeeping for the Prefect flows: is a stage stale, record a stage, push to the remote.

The flow asks DVC before running a stage's task and records the stage in ``dvc.lock`` (caching its
outputs) after, so ``python -m flows.pipeline`` and ``dvc repro`` share one record: after either,
``dvc status`` is clean and the other finds nothing to do. These touch disk, so they retry.

A stage is recorded only with the inputs it ran on (issue 12.1): ``inputs_unchanged`` snapshots the stage's
params (the keys ``dvc.yaml`` lists) and dependency contents when it starts and raises
:class:`StageInputsChanged`, naming what changed, if they differ when it ends. The pipeline flow then skips
``record_stage`` (the stage stays stale in ``dvc status``); under ``dvc repro`` the stage command
(``flows.stage``) exits non-zero, so DVC, which hashes deps and params only after the command and would record
the edited values, records nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.process.logs import get_logger, single_dvc_output
from tasks.process.outcome import StageInputsChanged
from tasks.spec.paths import project_root
from tasks.store.dvc_lockfile import atomic_dvc_writes, repair_lockfile


@contextlib.contextmanager
def _repo(root: str | Path) -> Iterator:
    """Open the DVC repo at ``root`` with the working directory inside it (DVC resolves stage paths
    against the current directory; from outside the repo its outputs look foreign)."""
    from dvc.repo import Repo  # dvc: loads only when a stage asks DVC something (seconds at start otherwise)

    single_dvc_output()  # each DVC message printed once
    atomic_dvc_writes()  # dvc.lock and .dvc files by temporary file and rename: a kill never tears them

    previous = os.getcwd()
    os.chdir(root)
    try:
        with Repo(str(root)) as repo:
            yield repo
    finally:
        os.chdir(previous)


@task(name="dvc-status", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def stage_status(root: str, stage: str) -> dict:
    """What changed for ``stage`` (``{}`` when it is up to date: deps, params and outs match dvc.lock)."""
    with _repo(root) as repo:
        return repo.status(targets=[stage])


_RECORDING = threading.Lock()
"""One recorder at a time in this process (the file lock below is per open file, so it also orders threads, but
a thread waiting here costs no polling)."""


@contextlib.contextmanager
def one_recorder(root: str | Path) -> Iterator[None]:
    """Hold the checkout's recording lock (``rlhf-record.lock`` in ``.dvc/tmp``) for the block: stages that end at the same
    moment (side by side, or two processes) update dvc.lock one after another. DVC's own repo lock would make the
    second recorder fail after a few retries rather than wait, and dvc.lock is read, changed and written whole, so
    two unordered writers would lose an entry."""
    path = project_root(root) / ".dvc" / "tmp" / "rlhf-record.lock"  # a task folder's dvc.lock: the checkout's lock
    path.parent.mkdir(parents=True, exist_ok=True)
    with _RECORDING, open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)  # released when the file closes
        yield


@task(name="dvc-commit", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def record_stage(root: str, stage: str) -> None:
    """Write ``stage``'s dvc.lock entry and cache its outputs (only after the stage succeeded)."""
    with one_recorder(root):
        with _repo(root) as repo:
            repo.commit(stage, force=True)
        repair_lockfile(root)  # the complete lock, kept: a torn one later goes back to this
    get_logger().info("dvc: recorded stage %s in dvc.lock", stage)


@task(name="dvc-push", retries=3, retry_delay_seconds=5, cache_policy=NO_CACHE)
def push_outputs(root: str, remote: str | None = None) -> int:
    """Push cached data and models to the DVC remote (``.dvc-remote/`` by default); returns files pushed."""
    with _repo(root) as repo:
        pushed = repo.push(remote=remote)
    get_logger().info("dvc: pushed %s file(s) to the %s remote", pushed, remote or "default")
    return int(pushed or 0)


def _stage_spec(root: Path, stage: str) -> dict:
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages") or {}
    if stage not in stages:
        raise KeyError(f"{root / 'dvc.yaml'}: no stage {stage!r}")
    return stages[stage]


def _param_values(root: Path, entries: list) -> dict[str, Any]:
    """``{"<file>:<dotted key>": value}`` for dvc.yaml ``params`` entries (``key`` or ``{file: [keys]}``)."""
    wanted: list[tuple[str, str]] = []
    for entry in entries or []:
        if isinstance(entry, dict):
            wanted += [(file, key) for file, keys in entry.items() for key in (keys or [])]
        else:
            wanted.append(("params.yaml", str(entry)))
    values, loaded = {}, {}
    for file, key in wanted:
        if file not in loaded:
            path = root / file
            loaded[file] = yaml.safe_load(path.read_text()) if path.exists() else None
        node: Any = loaded[file]
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        values[f"{file}:{key}"] = node
    return values


def _content_hash(path: Path) -> str | None:
    """sha256 of a file, or of a directory's sorted (relative path, content) pairs; None when missing."""
    if path.is_file():
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        return digest.hexdigest()
    if path.is_dir():
        digest = hashlib.sha256()
        for child in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(child.relative_to(path).as_posix().encode() + b"\0" + _content_hash(child).encode())
        return digest.hexdigest()
    return None


def stage_snapshot(root: str | Path, stage: str) -> dict[str, Any]:
    """What ``stage`` reads, per dvc.yaml: each listed param's value and each dependency's content hash."""
    root = Path(root)
    spec = _stage_spec(root, stage)
    deps = [next(iter(d)) if isinstance(d, dict) else str(d) for d in spec.get("deps") or []]
    return {**_param_values(root, spec.get("params")), **{dep: _content_hash(root / dep) for dep in deps}}


def changed_inputs(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The params (``file:key was -> now``) and dependencies (path) that differ between two snapshots."""
    changed = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            is_param = ":" in key and key.split(":", 1)[0].endswith((".yaml", ".yml", ".json", ".toml"))
            changed.append(f"{key} ({before.get(key)!r} -> {after.get(key)!r})" if is_param else key)
    return changed


@contextlib.contextmanager
def inputs_unchanged(root: str | Path, stage: str) -> Iterator[dict[str, Any]]:
    """Snapshot ``stage``'s inputs around the block; :class:`StageInputsChanged` if they differ at its end
    (an exception from the block propagates unchecked)."""
    before = stage_snapshot(root, stage)
    yield before
    changed = changed_inputs(before, stage_snapshot(root, stage))
    if changed:
        get_logger().warning("stage %s: %s changed while it ran: NOT recorded in dvc.lock (the stage stays stale)",
                             stage, ", ".join(changed))
        raise StageInputsChanged(stage, changed)
