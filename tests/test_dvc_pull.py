"""``make pull``: a hash found nowhere is named, with why and what to run (issue 33)."""

from __future__ import annotations

import shutil
import subprocess

import sys

from _dvc_project import ROOT, dvc_env, init_dvc_project, run_dvc

DVC_YAML = """stages:
  make:
    cmd: python -c "import pathlib; pathlib.Path('models').mkdir(exist_ok=True); pathlib.Path('models/a.txt').write_text('a')"
    outs:
    - models
"""


def _pull(root):
    """``make pull``'s command in ``root``, this checkout's code."""
    return subprocess.run([sys.executable, "-m", "tasks.store.dvc_pull"], cwd=root, capture_output=True, text=True,
                          env={**dvc_env(), "PYTHONPATH": str(ROOT)}, timeout=300)


def test_a_hash_in_neither_cache_nor_remote_is_named_with_why_and_what_to_run(tmp_path):
    """Issue 33: a fresh clone's `dvc pull` failed on models/grpo ("Checkout failed ... Is your cache up to date?"):
    its recorded bytes had never been pushed. `make pull` names the output, its hash and stage, the remote, and says
    what to run; with the bytes pushed it restores them."""
    root = init_dvc_project(tmp_path / "proj", DVC_YAML)
    remote = tmp_path / "remote"
    remote.mkdir()
    assert run_dvc(root, "remote", "add", "-d", "shared", str(remote)).returncode == 0
    assert run_dvc(root, "repro", "-q").returncode == 0
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    lock = (root / "dvc.lock").read_text()
    recorded = lock.split("md5: ")[-1].split()[0]
    shutil.rmtree(root / "models")  # a fresh clone: no workspace copy, no cache, and the run never pushed
    shutil.rmtree(root / ".dvc" / "cache")
    out = _pull(root)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"models  (md5 {recorded}, recorded by stage make in dvc.lock)" in out.stderr
    assert f"shared: {remote}" in out.stderr and "did not push" in out.stderr
    assert "`make push` on the machine that made them" in out.stderr and "`.venv/bin/dvc repro make`" in out.stderr
    assert "Traceback" not in out.stderr
    assert run_dvc(root, "repro", "-q").returncode == 0 and run_dvc(root, "push", "-q").returncode == 0
    shutil.rmtree(root / "models")
    shutil.rmtree(root / ".dvc" / "cache")
    out = _pull(root)
    assert out.returncode == 0, out.stderr
    assert (root / "models" / "a.txt").read_text() == "a" and "1 added" in out.stdout
