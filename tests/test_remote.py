"""The default DVC remote is a per-user folder outside the working copy, named in the git-tracked config."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_default_remote_is_outside_the_working_copy(monkeypatch, tmp_path):
    from dvc.config import Config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw = configparser.ConfigParser()
    raw.read(ROOT / ".dvc" / "config")
    assert raw["core"]["remote"] == "shared"
    assert raw['\'remote "shared"\'']["url"] == "~/.cache/rlhf-pipeline/dvc-remote"  # DVC expands ~, not $VARS
    config = Config(ROOT / ".dvc", validate=True)  # what DVC resolves (a per-user .dvc/config.local may override)
    url = Path(config.load_one("repo")["remote"]["shared"]["url"])
    assert url == tmp_path / "home" / ".cache" / "rlhf-pipeline" / "dvc-remote"
    assert ROOT not in url.parents
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert not any("dvc-remote" in line for line in ignored)  # never a git-ignored folder inside the repo


def test_make_run_pushes_and_remote_target_writes_config_local():
    makefile = (ROOT / "Makefile").read_text()
    run_recipe = makefile.split("\nrun: ", 1)[1].split("\n\n", 1)[0]
    assert "remote" in run_recipe.splitlines()[0] and "push" in run_recipe
    assert "remote modify --local shared url" in makefile
