"""Issue 24: a killed retraining run's worktree (24 MB, registered in `git worktree list`) is removed by the next run;
the worktrees of live runs and people's own worktrees are left alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _pipeline_project import make_project

from tasks.run import worktree


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def _listed(root: Path) -> list[str]:
    return [line.split(" ", 1)[1] for line in _git(root, "worktree", "list", "--porcelain").splitlines()
            if line.startswith("worktree ")][1:]


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _add(root: Path, path: Path, reason: str | None) -> str:
    lock = ["--lock", "--reason", reason] if reason else []
    _git(root, "worktree", "add", "--detach", *lock, str(path), "HEAD")
    return str(path)


def test_worktrees_of_dead_retraining_runs_are_pruned_and_no_others(tmp_path):
    root = make_project(tmp_path / "proj")
    host = socket.gethostname()
    temp = Path(tempfile.mkdtemp(prefix="rlhf-test-wt-"))  # stands in for the system temporary folder below
    try:
        dead = _add(root, Path(tempfile.gettempdir()) / f"rlhf-retrain-dead-{os.getpid()}",
                    f"rlhf-retrain pid={_dead_pid()} host={host}")
        live = _add(root, temp / "live", f"rlhf-retrain pid={os.getpid()} host={host}")
        elsewhere = _add(root, temp / "other-host", f"rlhf-retrain pid={_dead_pid()} host=not-{host}")
        legacy = _add(root, Path(tempfile.gettempdir()) / f"rlhf-retrain-legacy-{os.getpid()}", None)  # c870da2
        own = _add(root, tmp_path / "my-feature", None)  # a person's worktree
        locked = _add(root, temp / "kept", "on a USB disk")
        assert worktree.prune_dead_worktrees(root) == [dead, legacy]
        assert sorted(_listed(root)) == sorted([live, elsewhere, own, locked])
        assert not Path(dead).exists() and not Path(legacy).exists() and Path(own).is_dir()
        assert worktree.prune_dead_worktrees(root) == []  # nothing left to prune
    finally:
        for path in _listed(root):
            subprocess.run(["git", "worktree", "remove", "--force", "--force", path], cwd=root, capture_output=True)
        subprocess.run(["rm", "-rf", str(temp)])


def test_a_closed_worktree_is_unregistered_though_locked(tmp_path):
    root = make_project(tmp_path / "proj")
    path = worktree.open_worktree.fn(str(root), "main", "test")
    assert f"rlhf-retrain pid={os.getpid()}" in _git(root, "worktree", "list", "--porcelain")
    worktree.close_worktree.fn(str(root), path)
    assert _listed(root) == [] and not Path(path).exists()


@pytest.mark.slow
def test_the_worktree_of_a_killed_retrain_is_removed_by_the_next_run(tmp_path):
    """A real `python -m flows.retrain`, SIGKILLed once its worktree exists; the next run's open_worktree prunes it."""
    root = make_project(tmp_path / "proj")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "MLFLOW_TRACKING_URI": ""}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([sys.executable, "-m", "flows.retrain", "--no-push", "--root", str(root)], cwd=root,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not _listed(root) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        (killed,) = _listed(root)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started (its Prefect server)
        proc.wait()
    assert Path(killed).is_dir()
    path = worktree.open_worktree.fn(str(root), "main", "next")
    try:
        assert _listed(root) == [path] and not Path(killed).exists()
    finally:
        worktree.close_worktree.fn(str(root), path)
