"""Provenance of a stage run: the git commit and the DVC hash of each input (tags of the MLflow run)."""

from __future__ import annotations

import hashlib
import os
import socket
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path

import yaml


def git_commit(root: str | Path) -> str:
    """``git rev-parse HEAD`` in ``root``, or ``"unknown"`` (no git, not a repository)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def md5_file(path: Path) -> str:
    """DVC's hash of a file: the md5 of its bytes."""
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def md5_dir(path: Path) -> str:
    """DVC's hash of a directory: the md5 of its sorted (relpath, md5) listing, suffixed ``.dir``."""
    entries = [{"md5": md5_file(p), "relpath": p.relative_to(path).as_posix()}
               for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def _locked_out_hashes(root: Path) -> dict[str, str]:
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    data = yaml.safe_load(lock.read_text()) or {}
    hashes = {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs", []) or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def input_hashes(root: str | Path, deps: Iterable[str]) -> dict[str, str]:
    """DVC hash of each input: from ``dvc.lock`` when an upstream stage recorded it, else computed."""
    root = Path(root)
    locked = _locked_out_hashes(root)
    hashes = {}
    for dep in deps:
        if dep in locked:
            hashes[dep] = locked[dep]
        elif (root / dep).is_file():
            hashes[dep] = md5_file(root / dep)
        elif (root / dep).is_dir():
            hashes[dep] = md5_dir(root / dep)
        else:
            hashes[dep] = "missing"
    return hashes


__all__ = ["git_commit", "input_hashes", "md5_dir", "md5_file"]


RUN_OWNER_TAGS = ("rlhf.pid", "rlhf.host")


def owner_tags() -> dict[str, str]:
    """Tags naming the process that owns an MLflow run (``tasks.run.orphans`` ends runs whose owner is gone)."""
    return {"rlhf.pid": str(os.getpid()), "rlhf.host": socket.gethostname()}
