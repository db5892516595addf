"""A command typed as ``.venv/bin/<tool>`` finds the venv's other tools without an activated venv
(tools/venv_path.py, installed by ``make setup``): MLflow's scoring server runs ``uvicorn``, DVC runs ``python``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("venv_path", ROOT / "tools" / "venv_path.py")
venv_path = importlib.util.module_from_spec(spec)
spec.loader.exec_module(venv_path)


def _path_seen_by(python: str, path: str) -> list[str]:
    out = subprocess.run([python, "-c", "import os; print(os.environ['PATH'])"], env={**os.environ, "PATH": path},
                         capture_output=True, text=True, check=True)
    return out.stdout.strip().split(os.pathsep)


def test_the_pth_line_puts_the_interpreters_bin_first_once(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    pth = venv_path.install(site)
    assert pth.name == "rlhf_venv_bin.pth" and pth.read_text().startswith("import ")  # run at interpreter start
    env = {**os.environ, "PYTHONPATH": ""}
    code = f"import site; site.addsitedir({str(site)!r}); import os; print(os.environ['PATH'])"
    bin_dir = os.path.join(sys.prefix, "bin")
    for start in ("/usr/bin:/bin", f"{bin_dir}:/usr/bin"):
        out = subprocess.run([sys.executable, "-c", code], env={**env, "PATH": start}, capture_output=True,
                             text=True, check=True).stdout.strip().split(os.pathsep)
        assert out[0] == bin_dir and out.count(bin_dir) == 1


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the project's venv (make setup)")
def test_the_project_venv_finds_its_own_tools():
    bin_dir = Path(sys.prefix) / "bin"
    assert _path_seen_by(str(bin_dir / "python"), "/usr/bin:/bin")[0] == str(bin_dir)
    found = subprocess.run([str(bin_dir / "python"), "-c", "import shutil; print(shutil.which('uvicorn'))"],
                           env={**os.environ, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == str(bin_dir / "uvicorn")  # what `mlflow models serve` runs


def test_setup_says_what_it_installs_and_shows_pips_progress():
    """Issue 33: `make setup` was ~10 minutes of silence (every pip call -q). The long installs now print their step
    and pip's own per-package lines."""
    from pathlib import Path

    recipe = (Path(__file__).resolve().parents[1] / "Makefile").read_text().split("$(STAMP): ", 1)[1].split("\n\n")[0]
    long_installs = [line for line in recipe.splitlines()  # torch, then the lock (uv lists every package it installs)
                     if line.startswith("\t$(PY)") and ("torch==" in line or "install_lock.py" in line)]
    assert len(long_installs) == 2 and not any(" -q " in line for line in long_installs)
    assert [line.strip().split('"')[1].split(":")[0] for line in recipe.splitlines() if "@echo" in line] == [
        "setup 1/3", "setup 2/3", "setup 3/3"]
