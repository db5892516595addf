"""A throwaway git + DVC project for tests of dvc.lock handling (tests/test_dvc_lockfile.py, test_parallel_stages.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dvc_env() -> dict:
    """The environment the project's DVC runs in: the venv's tools first on PATH, no analytics."""
    return {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}


def run_python(root: Path, *code_or_args: str) -> subprocess.CompletedProcess:
    """This interpreter with ``code_or_args`` in ``root``, output captured."""
    return subprocess.run([sys.executable, *code_or_args], cwd=root, env=dvc_env(), capture_output=True, text=True,
                          timeout=300)


def run_dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return run_python(root, "-m", "dvc", *args)


def init_dvc_project(root: Path, dvc_yaml: str) -> Path:
    """``root`` made a git + DVC project whose dvc.yaml is ``dvc_yaml`` (nothing recorded yet)."""
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    assert run_dvc(root, "init", "-q").returncode == 0
    (root / "dvc.yaml").write_text(dvc_yaml)
    return root
