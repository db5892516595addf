"""Issue 24: an intake killed at any point loses nothing and blocks nothing. The next intake finishes it (or undoes
it, when a batch file was not written whole); duplicates count only against the batches the manifest lists; the
retry of the same file succeeds. Each kill is a real SIGKILL of an intake process at the named point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _pipeline_project import make_project

from rlhf_core.feedback import read_feedback_pairs, read_manifest

PAIRS = [{"prompt": "This movie was", "chosen": " wonderful.", "rejected": " awful."},
         {"prompt": "The plot", "chosen": " gripped me.", "rejected": " bored me."}]

# Runs `python -m flows.intake ARGS` with one function of tasks/feedback/intake.py wrapped so that the process SIGKILLs
# itself at the named point (no hook in the production code).
KILLER = r"""
import os, signal, sys
import tasks.feedback.intake as intake

point, args = sys.argv[1], sys.argv[2:]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if point == "after-dvc-add-and-push":  # the batches are in the DVC cache and remote, not in the manifest
    version = intake._version
    intake._version = lambda *a, **k: (version(*a, **k), die())
elif point == "between-git-add-and-commit":  # the manifest line is written and staged, not committed
    git = intake._git
    intake._git = lambda root, *a: die() if a[0] == "commit" else git(root, *a)
elif point == "after-the-first-batch-file":  # two files: the second batch is never written
    write = intake._write_batch
    intake._write_batch = lambda *a, calls=[]: (calls.append(1), write(*a))[1] if not calls else die()
elif point == "in-the-batch-rename":  # the batch's temp file is written, the rename never happens
    replace = os.replace
    os.replace = lambda src, dst: die() if str(dst).endswith(".jsonl") else replace(src, dst)
from flows.intake import main
sys.exit(main(args))
"""


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def _feedback(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _kill_intake(root: Path, point: str, *files: Path) -> None:
    out = subprocess.run([sys.executable, "-c", KILLER, point, *map(str, files), "--root", str(root)], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stderr  # killed at the point, not failed before it


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    return make_project(tmp_path / "proj")


def _assert_ingested_once_and_committed(root: Path, head: str, rows: list[dict]) -> None:
    manifest = read_manifest(root / "incoming")
    assert [r["rows"] for r in manifest] == [len(rows)]  # exactly one record: recorded once
    assert read_feedback_pairs(root / "incoming") == rows  # what prepare trains on
    assert _git(root, "status", "--porcelain") == ""  # nothing staged or left over
    assert _git(root, "rev-list", "--count", f"{head}..HEAD") == "1"  # one intake commit on top
    assert f"incoming/{manifest[0]['file']}.dvc" in _git(root, "ls-files", "incoming").split()
    assert not (root / ".dvc" / "tmp" / "rlhf-intake.journal").exists()


@pytest.mark.parametrize("point", ["after-dvc-add-and-push", "between-git-add-and-commit"])
def test_a_killed_intake_is_finished_by_the_retry_of_the_same_file(project, tmp_path, point):
    from flows.intake import main

    head = _git(project, "rev-parse", "HEAD")
    pairs = _feedback(tmp_path / "pairs.jsonl", PAIRS)
    _kill_intake(project, point, pairs)
    listed = [r["sha256"] for r in read_manifest(project / "incoming")]
    assert listed == ([] if point == "after-dvc-add-and-push" else listed[:1]) and len(listed) <= 1
    assert _git(project, "rev-parse", "HEAD") == head  # the kill left it uncommitted

    assert main([str(pairs), "--root", str(project), "--no-retrain"]) == 0  # the retry: not refused as a duplicate
    _assert_ingested_once_and_committed(project, head, PAIRS)
    # and once more: already ingested, nothing new
    assert main([str(pairs), "--root", str(project), "--no-retrain"]) == 0
    _assert_ingested_once_and_committed(project, head, PAIRS)


@pytest.mark.slow
def test_a_killed_intake_is_finished_by_the_next_intake_of_another_file(project, tmp_path):
    from flows.intake import main

    head = _git(project, "rev-parse", "HEAD")
    _kill_intake(project, "between-git-add-and-commit", _feedback(tmp_path / "a.jsonl", PAIRS[:1]))
    assert main([str(_feedback(tmp_path / "b.jsonl", PAIRS[1:])), "--root", str(project), "--no-retrain"]) == 0
    assert [r["rows"] for r in read_manifest(project / "incoming")] == [1, 1]
    assert read_feedback_pairs(project / "incoming") == PAIRS  # the killed intake's pair is kept, first
    assert _git(project, "status", "--porcelain") == ""
    assert _git(project, "rev-list", "--count", f"{head}..HEAD") == "2"


@pytest.mark.slow
def test_an_intake_killed_while_writing_its_batches_is_undone_and_the_retry_ingests(project, tmp_path):
    from flows.intake import main

    head = _git(project, "rev-parse", "HEAD")
    files = [_feedback(tmp_path / "a.jsonl", PAIRS[:1]), _feedback(tmp_path / "b.jsonl", PAIRS[1:])]
    _kill_intake(project, "after-the-first-batch-file", *files)
    assert len(list((project / "incoming" / "pairs").glob("*.jsonl"))) == 1  # half an intake on disk
    assert main([str(f) for f in files] + ["--root", str(project), "--no-retrain"]) == 0
    assert [r["rows"] for r in read_manifest(project / "incoming")] == [1, 1]
    assert read_feedback_pairs(project / "incoming") == PAIRS
    assert _git(project, "status", "--porcelain") == "" and _git(project, "rev-list", "--count", f"{head}..HEAD") == "1"


@pytest.mark.slow
def test_an_orphan_batch_without_a_journal_is_not_a_duplicate(project, tmp_path):
    """What an intake killed at c870da2 (before the journal) left: a batch file, its .dvc file and .gitignore line,
    no manifest record. It is not ingested data: the retry is not refused, and ingests the file once."""
    from flows.intake import main

    head = _git(project, "rev-parse", "HEAD")
    pairs = _feedback(tmp_path / "pairs.jsonl", PAIRS)
    _kill_intake(project, "after-dvc-add-and-push", pairs)
    (project / ".dvc" / "tmp" / "rlhf-intake.journal").unlink()
    assert main([str(pairs), "--root", str(project), "--no-retrain"]) == 0
    _assert_ingested_once_and_committed(project, head, PAIRS)


def test_an_intake_that_doubles_the_training_data_says_what_it_costs(project, tmp_path, caplog):
    from flows.intake import main

    (project / "metrics").mkdir()
    (project / "metrics" / "prepare.json").write_text(json.dumps({"num_pairs": 2, "num_ratings": 100}))
    with caplog.at_level("WARNING"):
        assert main([str(_feedback(tmp_path / "pairs.jsonl", PAIRS + [{**PAIRS[0], "chosen": " grand."}])),
                     "--root", str(project), "--no-retrain"]) == 0
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning == ("intake: 3 pairs more: the next retraining trains reward_model and dpo on up to 5 pairs instead "
                       "of 2 (about 2x the training time of those stages; prepare.json of the last run)")
    caplog.clear()
    ratings = [{"prompt": "A film", "completion": f" scene {i}.", "label": i % 2 == 0} for i in range(99)]
    with caplog.at_level("WARNING"):  # 99 more ratings on 100: under double, no warning
        assert main([str(_feedback(tmp_path / "ratings.jsonl", ratings)), "--root", str(project), "--no-retrain"]) == 0
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def _store_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "incoming").rglob("*") if p.is_file())


def test_an_intake_killed_in_its_batch_rename_leaves_nothing_in_the_store(project, tmp_path):
    """Issue 33: the temp file of a batch killed before its rename was left in incoming/ (a dependency of prepare:
    its hash changed, prepare and everything after it would retrain). It is written in the folder intake of .dvc/tmp now, and the
    next intake removes it, with a message."""
    from flows.intake import main

    head, before = _git(project, "rev-parse", "HEAD"), _store_files(project)
    pairs = _feedback(tmp_path / "pairs.jsonl", PAIRS)
    _kill_intake(project, "in-the-batch-rename", pairs)
    assert _store_files(project) == before  # prepare's dependency is untouched
    assert len(list((project / ".dvc" / "tmp" / "intake").glob(".*.tmp-*"))) == 1  # the debris is in the scratch
    assert main([str(pairs), "--root", str(project), "--no-retrain"]) == 0
    _assert_ingested_once_and_committed(project, head, PAIRS)
    assert list((project / ".dvc" / "tmp" / "intake").glob(".*.tmp-*")) == []
