"""tools/install_lock.py: pip's own index settings passed on to uv (a local registry, local wheels, the machine's
constraint file), and pip taking over when uv is missing or fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("install_lock", ROOT / "tools" / "install_lock.py")
install_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_lock)

PIP_CONFIG = """:env:.find-links='/srv/wheels'
:env:.default-timeout='180'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///srv/pypi/simple file:///srv/pypi-more/simple'
global.find-links='/srv/wheels'
"""


def test_pip_settings_reach_uv_as_options(monkeypatch):
    monkeypatch.setattr(install_lock.subprocess, "run",
                        lambda *a, **k: SimpleNamespace(stdout=PIP_CONFIG, returncode=0))
    settings = install_lock.pip_settings("python")
    assert settings["find-links"] == ["/srv/wheels"]  # the env and the file say the same: once
    assert settings["extra-index-url"] == ["file:///srv/pypi/simple", "file:///srv/pypi-more/simple"]
    command = install_lock.uv_command("uv", "py", "requirements.lock", settings)
    assert command[:7] == ["uv", "pip", "install", "--python", "py", "-r", "requirements.lock"]
    pairs = list(zip(command[7::2], command[8::2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs  # pip's search over every index
    assert ("--extra-index-url", "file:///srv/pypi-more/simple") in pairs
    assert ("--find-links", "/srv/wheels") in pairs and ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    env = install_lock.uv_environment(settings)
    assert env.get("UV_HTTP_TIMEOUT") == "180"


def test_pip_installs_the_lock_when_uv_is_missing_or_fails(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text("six==1.17.0\n")
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        if command[1:4] == ["-m", "pip", "config"]:
            return SimpleNamespace(stdout="", returncode=0)
        return SimpleNamespace(returncode=1 if command[0].endswith("uv") else 0, stdout="")

    monkeypatch.setattr(install_lock.subprocess, "run", run)
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    monkeypatch.setattr(install_lock.sys, "executable", str(python))
    assert install_lock.main([str(lock)]) == 0  # no uv beside the venv's python: pip
    assert calls == [[str(python), "-m", "pip", "install", "--disable-pip-version-check", "-r", str(lock)]]
    uv = python.with_name("uv")
    uv.write_text("#!/bin/sh\nexit 1\n")
    uv.chmod(0o755)
    calls.clear()
    assert install_lock.main([str(lock)]) == 0  # uv failed: pip after it
    assert [c[0] for c in calls] == [str(python), str(uv), str(python)] and calls[-1][1:3] == ["-m", "pip"]
    assert install_lock.main([str(tmp_path / "missing.lock")]) == 2


def test_make_setup_installs_the_lock_through_it():
    makefile = (ROOT / "Makefile").read_text()
    assert "$(PY) tools/install_lock.py requirements.lock" in makefile
    assert '|| echo "no uv: pip installs the lock"' in makefile  # an index without uv still sets up
