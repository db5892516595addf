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
    """Why ``command`` would not run as typed in a clone after ``make run`` (empty when it would)."""
    first, *rest = command.split()
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
