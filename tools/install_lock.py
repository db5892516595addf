"""Install ``requirements.lock`` into the venv: with uv when the venv has it (the same pinned versions; measured on 2
cores, ``make setup`` took 0:47 from an empty uv cache against 1:52 with pip), else, or when uv fails, with pip.

    .venv/bin/python tools/install_lock.py requirements.lock

uv does not read pip's configuration, so this passes it on: the index URLs, find-links, constraint files and
certificate that ``pip config list`` shows (pip.conf files and ``PIP_*`` variables), so uv sees the packages pip
would (a local registry, local wheels, the machine's torch cap). pip searches every index for the best version;
uv's ``unsafe-best-match`` does the same. Every line of the lock pins one version (``==``), so both install the same
set; torch is installed by pip first (``make setup``), and its ``2.13.0+cpu`` satisfies the lock's pin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LISTS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}
"""pip settings that uv takes as options, each value (a space-separated list in pip) one option."""


def pip_settings(python: str) -> dict[str, list[str]]:
    """``pip config list`` of ``python``'s pip: ``{key: [values]}`` (``global.find-links`` and ``:env:.find-links``
    both under ``find-links``; later scopes add to earlier ones, duplicates dropped)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout
    settings: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, sep, raw = line.partition("=")
        if not sep:
            continue
        key = name.rsplit(".", 1)[-1].strip()
        for value in raw.strip().strip("'\"").split():
            if value not in settings.setdefault(key, []):
                settings[key].append(value)
    return settings


def uv_command(uv: str, python: str, lock: str, settings: dict[str, list[str]]) -> list[str]:
    command = [uv, "pip", "install", "--python", python, "-r", lock, "--index-strategy", "unsafe-best-match"]
    for key, option in LISTS.items():
        for value in settings.get(key, []):
            command += [option, value]
    if settings.get("no-index", ["false"])[-1].lower() in ("1", "true", "yes", "on"):
        command.append("--no-index")
    return command


def uv_environment(settings: dict[str, list[str]]) -> dict[str, str]:
    env = dict(os.environ)
    if settings.get("cert") and "SSL_CERT_FILE" not in env:
        env["SSL_CERT_FILE"] = settings["cert"][-1]
    if settings.get("default-timeout") and "UV_HTTP_TIMEOUT" not in env:
        env["UV_HTTP_TIMEOUT"] = settings["default-timeout"][-1]
    return env


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_file():
        print("usage: python tools/install_lock.py requirements.lock", file=sys.stderr)
        return 2
    lock, python = args[0], sys.executable
    uv = Path(python).with_name("uv")
    if uv.is_file() and os.access(uv, os.X_OK):
        settings = pip_settings(python)
        code = subprocess.run(uv_command(str(uv), python, lock, settings), env=uv_environment(settings),
                              check=False).returncode
        if code == 0:
            return 0
        print(f"uv could not install {lock} (exit {code}): installing it with pip instead", file=sys.stderr)
    return subprocess.run([python, "-m", "pip", "install", "--disable-pip-version-check", "-r", lock],
                          check=False).returncode


if __name__ == "__main__":
    raise SystemExit(main())
