"""Every command the README, the docs and the end of ``make run`` print works as typed from a fresh clone.

Fast: each command line in their code blocks is a ``make`` target the Makefile defines, or a tool of the project's
venv spelled ``.venv/bin/<tool>`` (which finds the venv's other tools: tools/venv_path.py): never a bare ``dvc``,
``python`` or ``mlflow`` that only works in an activated venv. Slow (tests/test_pipeline_e2e.py): the end block's
commands run after a pipeline run in a project laid out as a clone."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from flows.summary import NEXT_COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
VENV_ONLY = ("dvc", "python", "python3", "mlflow", "prefect", "pytest", "accelerate", "torchrun", "pip")
"""Programs that exist only in the project's venv (or would be the system's, without its packages)."""


def code_lines(text: str) -> list[str]:
    """The lines of a Markdown text's code: indented blocks (4 spaces) and fenced ``` blocks."""
    lines = re.findall(r"^    (\S.*)$", text, re.M)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        lines += [line.strip() for line in block.splitlines()]
    return lines


def commands(lines: list[str]) -> list[str]:
    """The lines that are shell commands (their comments dropped), not output or file contents."""
    found = []
    for line in lines:
        command = line.split(" #", 1)[0].strip()
        first = command.split(" ", 1)[0]
        if first in ("make", "git", "bash", *VENV_ONLY) or first.startswith((".venv/bin/", "bench/")):
            found.append(command)
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][a-zA-Z0-9_-]*):", (ROOT / "Makefile").read_text(), re.M))


def problems_of(command: str, targets: set[str], venv_bin: Path) -> list[str]:
    """Why ``command`` would not run as typed in a clone after ``make run`` (empty when it would); ``<...>`` is a
    placeholder the reader fills in."""
    first, *rest = re.sub(r"<[^>]*>", "PLACEHOLDER", command).split()
    if first in VENV_ONLY:
        return [f"`{command}`: bare {first} works only in an activated venv; write .venv/bin/{first} or a make target"]
    if first == "make":
        named = [w for w in rest if not w.startswith("-") and "=" not in w]
        return [f"`{command}`: no make target {t!r}" for t in named if t not in targets]
    if first.startswith(".venv/bin/") and not (venv_bin / first.removeprefix(".venv/bin/")).exists():
        return [f"`{command}`: {first} is not a tool of the project's venv"]
    return []


def test_commands_are_read_from_code_blocks():
    text = "intro `dvc status` inline\n\n    make run     # comment\n    dvc repro\n\n```bash\n.venv/bin/dvc pull\n```\n"
    assert commands(code_lines(text)) == ["make run", "dvc repro", ".venv/bin/dvc pull"]
    targets, venv_bin = {"run"}, Path(sys.prefix) / "bin"
    assert problems_of("make run", targets, venv_bin) == []
    assert problems_of("make nope FILE=x", targets, venv_bin) == ["`make nope FILE=x`: no make target 'nope'"]
    assert "activated venv" in problems_of("dvc repro", targets, venv_bin)[0]
    assert problems_of("make run DVC_REMOTE=<the team URL>", targets, venv_bin) == []


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the project's venv (make setup)")
@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_command_a_document_prints_runs_as_typed(document):
    targets, venv_bin = make_targets(), Path(sys.prefix) / "bin"
    found = commands(code_lines((ROOT / document).read_text(encoding="utf-8")))
    problems = [p for command in found for p in problems_of(command, targets, venv_bin)]
    assert not problems, f"{document}:\n  " + "\n  ".join(problems)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the project's venv (make setup)")
def test_the_end_of_make_run_prints_runnable_commands():
    targets, venv_bin = make_targets(), Path(sys.prefix) / "bin"
    problems = [p for command, _ in NEXT_COMMANDS for p in problems_of(command, targets, venv_bin)]
    assert not problems and len(NEXT_COMMANDS) >= 4, problems


# --------------------------------------------------------------------------------------------
# slow: the end block's commands, run as typed in a clone after a (tiny) pipeline run
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_and_probe(cmd: list[str], cwd: Path, url: str, env: dict, timeout: float = 120) -> str:
    """Start a server command (its own process group), wait until ``url`` answers 200, stop it by PID; returns
    what it printed."""
    import os
    import signal
    import subprocess

    from flows.serve import wait_http

    log = cwd / f".serve-{abs(hash(url))}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        try:
            wait_http(url, timeout, proc, log)
        except (RuntimeError, TimeoutError) as error:
            pytest.fail(f"{cmd}: {error}:\n{log.read_text()[-3000:]}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return log.read_text()


@pytest.mark.slow
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the project's venv (make setup)")
def test_the_end_blocks_commands_work_in_a_clone_after_a_pipeline_run(tmp_path):
    """A clone (the project's venv linked in, tiny params), one pipeline run, then every command the end block
    prints, as typed, from a shell whose PATH has no venv: the dvc lines, make mlflow-ui, make prefect-ui."""
    import os
    import subprocess

    from _pipeline_project import TINY
    from tasks.spec.params import apply_overrides, read_raw

    import yaml

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / ".venv").symlink_to(Path(sys.prefix))
    raw = apply_overrides(read_raw(clone / "params.yaml"), TINY)
    (clone / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RLHF_PARENT_RUN_ID",
                                                             "PREFECT_API_URL")}
    env.update(PATH="/usr/bin:/bin", PREFECT_HOME=str(tmp_path / "prefect-home"))  # a shell with no venv on PATH

    def sh(command: str, timeout: float = 900) -> str:
        out = subprocess.run(["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True,
                             timeout=timeout)
        assert out.returncode == 0, f"`{command}` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        return out.stdout + out.stderr

    end = sh(".venv/bin/python -m flows.pipeline")
    for command, _ in NEXT_COMMANDS:
        if command.startswith(".venv/bin/"):
            sh(command)
    assert (clone / "dvc_plots" / "index.html").is_file()  # .venv/bin/dvc plots show, offline template
    assert "cdn.jsdelivr" not in (clone / "dvc_plots" / "index.html").read_text()
    assert "Next:" in end and "make mlflow-ui" in end
    make = ["make", "-o", ".venv/.installed"]  # the venv is the test's own: setup is not re-run here
    port = _free_port()
    printed = _serve_and_probe([*make, "mlflow-ui", f"MLFLOW_PORT={port}"], clone, f"http://127.0.0.1:{port}/health", env)
    assert f"http://127.0.0.1:{port}/#/experiments/" in printed and "workflowType=machine_learning" in printed
    assert "side by side" in printed and "compare-runs" in printed
    port = _free_port()
    _serve_and_probe([*make, "prefect-ui", f"PREFECT_PORT={port}"], clone, f"http://127.0.0.1:{port}/api/health", env)
