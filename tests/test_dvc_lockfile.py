"""Issue 24: `kill -9` while DVC rewrites dvc.lock. In-process (the pipeline flow recording a stage) and under
`make repro` the write is atomic, so the lock stays whole; a lock torn by a bare `dvc repro` is restored at the next
start from the last complete copy, or, with none, the error names the one command that repairs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _dvc_project import init_dvc_project, run_dvc, run_python

from tasks.store.dvc_lockfile import JOURNAL, LockfileTorn, lock_problem, repair_lockfile
from tasks.run.orphans import clean_after_dead_runs

ROOT = Path(__file__).resolve().parents[1]

# Runs PYTHON_CODE with DVC's YAML dumper replaced by one that, when it writes dvc.lock, writes half of the
# document, flushes it to the file and SIGKILLs the process: a kill in the middle of DVC rewriting dvc.lock (no hook
# in production code).
HALF_WRITE_THEN_KILL = r"""
import io, os, signal, sys
sys.path.insert(0, sys.argv[1])
from dvc.utils.serialize import _yaml

dump = _yaml._dump

def half_then_kill(data, stream, **kwargs):
    if "dvc.lock" not in os.path.basename(getattr(stream, "name", "")):
        return dump(data, stream, **kwargs)
    text = io.StringIO()
    dump(data, text)
    stream.write(text.getvalue()[: len(text.getvalue()) // 2])
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)

_yaml._dump = half_then_kill
"""

DVC_YAML = """stages:
  a:
    cmd: echo a > a.txt
    outs: [a.txt]
  b:
    cmd: cat a.txt a.txt > b.txt
    deps: [a.txt]
    outs: [b.txt]
"""


_run, _dvc = run_python, run_dvc


@pytest.fixture
def project(tmp_path) -> Path:
    """A git + DVC project with two stages, both recorded in dvc.lock; then b's dependency changes (b is stale)."""
    root = init_dvc_project(tmp_path / "proj", DVC_YAML)
    assert _dvc(root, "repro").returncode == 0
    assert "b:" in (root / "dvc.lock").read_text()
    (root / "dvc.yaml").write_text(DVC_YAML.replace("echo a >", "echo A >"))
    assert _dvc(root, "repro", "a").returncode == 0  # a recorded anew; b (its dep changed) is stale
    return root


def _kill_while_writing(root: Path, python_code: str) -> None:
    out = _run(root, "-c", HALF_WRITE_THEN_KILL + python_code, str(ROOT))
    assert out.returncode == -9, out.stderr  # killed inside the write, not failed before it


def test_a_kill_while_the_pipeline_records_a_stage_leaves_dvc_lock_whole(project):
    before = (project / "dvc.lock").read_bytes()
    mode = (project / "dvc.lock").stat().st_mode
    (project / "b.txt").write_text("A\nA\n")  # what stage b's command makes: record it as the pipeline flow does
    _kill_while_writing(project, "from tasks.store.dvc_ops import record_stage; record_stage.fn(sys.argv[1] and '.', 'b')")
    assert (project / "dvc.lock").read_bytes() == before and lock_problem(project / "dvc.lock") is None
    assert (project / "dvc.lock").stat().st_mode == mode
    repair_lockfile(project)  # the next start also removes the dead writer's temporary file
    assert sorted(p.name for p in project.iterdir() if p.name.startswith(".dvc.lock")) == []
    status = _dvc(project, "status")
    assert status.returncode == 0 and "b:" in status.stdout  # still stale: the next run records it


def test_a_kill_under_make_repro_leaves_dvc_lock_whole(project):
    before = (project / "dvc.lock").read_bytes()
    _kill_while_writing(project, "from tasks.store.dvc_lockfile import main; main(['repro'])")  # what `make repro` runs
    assert (project / "dvc.lock").read_bytes() == before
    out = _run(project, "-m", "tasks.store.dvc_lockfile", "repro")  # and the retry records b
    assert out.returncode == 0, out.stderr
    assert _dvc(project, "status").stdout.strip().endswith("up to date.")


def test_a_lock_torn_by_a_bare_dvc_repro_is_restored_at_the_next_start(project, monkeypatch):
    assert repair_lockfile(project) is None  # a run's start: the complete lock is kept
    complete = (project / "dvc.lock").read_bytes()
    assert (project / ".dvc" / "tmp" / JOURNAL).read_bytes() == complete
    _kill_while_writing(project, "from dvc.cli import main; main(['repro'])")  # plain DVC, as `dvc repro` runs
    torn = (project / "dvc.lock").read_bytes()
    assert torn != complete and lock_problem(project / "dvc.lock") is not None
    assert "'./dvc.lock' is invalid" in _dvc(project, "status").stderr  # what every DVC command says until repaired

    import logging

    from tasks.run import orphans

    warnings: list[str] = []
    logger = logging.getLogger("rlhf-test-dvc-lockfile")
    monkeypatch.setattr(logger, "warning", lambda message, *args: warnings.append(message % args if args else message))
    monkeypatch.setattr(orphans, "get_logger", lambda: logger)  # (Prefect's log handlers vary with the tests run before)
    clean_after_dead_runs(project)  # the next pipeline, stage or retraining run
    warned = "\n".join(warnings)
    assert (project / "dvc.lock").read_bytes() == complete
    (kept,) = (project / ".dvc" / "tmp").glob("dvc.lock.torn-*")
    assert kept.read_bytes() == torn  # nothing lost: the torn file is kept for inspection
    assert "dvc.lock was torn" in warned and f"Restored the last complete version (kept in {project}" in warned
    status = _dvc(project, "status")
    assert status.returncode == 0 and "b:" in status.stdout and "a:" not in status.stdout  # b re-runs, a does not


def test_a_torn_lock_with_no_complete_copy_names_the_command_that_repairs_it(project):
    lock = project / "dvc.lock"
    lock.write_bytes(lock.read_bytes()[: len(lock.read_bytes()) // 2])
    with pytest.raises(LockfileTorn, match=r"dvc\.lock is torn .*Repair it with: git checkout -- dvc\.lock"):
        repair_lockfile(project)
    out = _run(project, "-m", "tasks.store.dvc_lockfile", "status")
    assert out.returncode == 1 and "Repair it with: git checkout -- dvc.lock" in out.stderr


def _cut_project(tmp_path: Path) -> tuple[Path, str]:
    """A folder with the repository's dvc.yaml, its dvc.lock, and that lock kept as the last complete copy."""
    root = tmp_path / "cut"
    (root / ".dvc" / "tmp").mkdir(parents=True)
    (root / "dvc.yaml").write_bytes((ROOT / "dvc.yaml").read_bytes())
    text = (ROOT / "dvc.lock").read_text()
    (root / "dvc.lock").write_text(text)
    assert repair_lockfile(root) is None  # complete: kept as the copy
    return root, text


def test_a_cut_lock_that_still_parses_is_found_at_every_cut_point(tmp_path):
    """Issue 33: a dvc.lock cut by a bare `dvc repro` that still parsed (153 of 200 cut points) was accepted, copied
    over the saved good copy, and 5 stages retrained silently. Every cut is found now: inside a line (no final
    newline) or at a line end (lines lost at its tail: fields, entries, sections, stages the copy has)."""
    from tasks.store.dvc_lockfile import cut_problem

    root, text = _cut_project(tmp_path)
    lock, journal = root / "dvc.lock", root / ".dvc" / "tmp" / JOURNAL
    lines = text.splitlines(keepends=True)
    cuts = [len(text) * i // 25 for i in range(1, 25)] + [len("".join(lines[:j])) for j in range(7, len(lines), 41)]
    parsed = 0
    for cut in cuts:
        lock.write_text(text[:cut])
        if lock_problem(lock) is None:  # what DVC itself would accept
            parsed += 1
            assert cut_problem(lock, journal, root / "dvc.yaml") is not None, f"cut at {cut} accepted"
    assert parsed >= 30  # most cuts parse: the check is what finds them


def test_a_cut_lock_that_parses_is_restored_from_the_complete_copy_with_a_message(tmp_path):
    root, text = _cut_project(tmp_path)
    last = re.findall(r"^  (\w+):\n", text, re.MULTILINE)[-1]  # the lock's last entry (DVC appends new stages)
    cut = text[:text.index(f"  {last}:\n")]  # cut between two stages: parses, every field of every entry there
    (root / "dvc.lock").write_text(cut)
    message = repair_lockfile(root)
    assert message and f"stage '{last}' lost the whole stage" in message and "Restored the last complete version" in message
    assert (root / "dvc.lock").read_text() == text
    assert [p.read_text() for p in (root / ".dvc" / "tmp").glob("dvc.lock.torn-*")] == [cut]


def test_a_lock_behind_an_edited_dvc_yaml_is_not_taken_for_a_cut_one(tmp_path):
    """A stage declared since (no entry yet), or an entry dvc.yaml no longer declares and the re-run dropped, is a
    stale or changed lock, not a cut one."""
    from tasks.store.dvc_lockfile import cut_problem

    root, text = _cut_project(tmp_path)
    lock, journal = root / "dvc.lock", root / ".dvc" / "tmp" / JOURNAL
    yaml_text = (root / "dvc.yaml").read_text()
    (root / "dvc.yaml").write_text(yaml_text.replace("      - tasks/stages/prepare.py\n",
                                                     "      - tasks/stages/prepare.py\n      - tasks/new_dep.py\n", 1))
    assert cut_problem(lock, journal, root / "dvc.yaml") is None  # a new dep: the stage is stale, not torn
    (root / "dvc.yaml").write_text(yaml_text.replace("      - tasks/stages/prepare.py\n", "", 1))
    lines = text.splitlines(keepends=True)
    start = lines.index("    - path: tasks/stages/prepare.py\n")
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith("      "))
    lock.write_text("".join(lines[:start] + lines[end:]))  # the re-run dropped its entry
    assert cut_problem(lock, journal, root / "dvc.yaml") is None
