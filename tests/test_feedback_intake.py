"""Reviewers' judgements (MLflow assessments on served traces) become versioned feedback batches: the rows and their
provenance, what is left out and why, collecting twice, and a collection killed before its commit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _pipeline_project import make_project

from rlhf_core.feedback import read_manifest, read_stored_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables and nothing else (creating the tables takes seconds: copied per test)."""
    import mlflow

    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    mlflow.MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture()
def project(tmp_path, monkeypatch, empty_store):
    """A git + DVC project with its MLflow store, the experiment active (mlflow points at the store)."""
    import shutil

    import mlflow

    from tasks.store.mlflow_runs import mlflow_setup

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = make_project(tmp_path / "proj")
    shutil.copy(empty_store, root / "mlflow.db")

    mlflow.set_experiment(experiment_id=mlflow_setup(root))
    return root


def served(prompt: str, completion: str, version: str = "1") -> str:
    """A trace as the served policy writes it (tasks.serving.answer.traced_generation); returns its id."""
    from tasks.serving.answer import LoadedVersion, trace_tags, traced_generation

    loaded = LoadedVersion(version, None, "dpo", None, None)
    return traced_generation(prompt, 8, 0, lambda p, n, s: completion, trace_tags("rlhf-policy", loaded, "champion"))[1]


def human(name: str):
    from mlflow.entities import AssessmentSource, AssessmentSourceType

    return AssessmentSource(source_type=AssessmentSourceType.HUMAN, source_id=name)


def _commits(root: Path) -> int:
    return int(subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout)


def _batch_rows(root: Path, kind: str) -> list[dict]:
    store = root / "incoming"
    return read_stored_rows(store, [r["file"] for r in read_manifest(store) if r["kind"] == kind])


def test_judgements_become_batches_with_their_provenance_once(project):
    import mlflow

    from tasks.feedback.collect import collect
    from tasks.feedback.assessments import record_preference, record_rating

    client = mlflow.MlflowClient()
    good, bad = served("The film", " was great fun."), served("The film", " was a bore.")
    fine, empty = served("It was", " fine, really."), served("I think", "")
    alice = record_rating(client, good, True, "alice")
    bob = mlflow.log_feedback(trace_id=fine, name="good", value=False, source=human("bob"))  # MLflow's own API
    carol = record_preference(client, good, bad, "carol")
    # record_rating refuses an empty answer at once; MLflow's own API (its UI) records it, and the intake refuses it
    refused = mlflow.log_feedback(trace_id=empty, name="good", value=False, source=human("alice"))
    judge = mlflow.log_feedback(trace_id=fine, name="good", value=True)  # a CODE judge, not a reviewer: ignored
    before = _commits(project)

    first = collect(project, push=True)

    assert {r["kind"]: r["rows"] for r in first.records} == {"ratings": 2, "pairs": 1}
    assert _commits(project) == before + 1  # one intake commit: manifest + .dvc files
    assert _batch_rows(project, "ratings") == [
        {"prompt": "The film", "completion": " was great fun.", "label": True, "trace_id": good,
         "assessment_id": alice.assessment_id, "reviewer": "alice"},
        {"prompt": "It was", "completion": " fine, really.", "label": False, "trace_id": fine,
         "assessment_id": bob.assessment_id, "reviewer": "bob"}]
    assert _batch_rows(project, "pairs") == [
        {"prompt": "The film", "chosen": " was great fun.", "rejected": " was a bore.", "chosen_trace_id": good,
         "rejected_trace_id": bad, "assessment_id": carol.assessment_id, "reviewer": "carol"}]
    assert [(r.assessment_id, r.trace_id) for r in first.refused] == [(refused.assessment_id, empty)]
    assert "field 'completion' is empty" in first.refused[0].reason
    sha = {r["kind"]: r["sha256"] for r in first.records}
    tags = client.get_trace(good).info.tags
    assert tags[f"rlhf.intake.{alice.assessment_id}"] == f"ratings batch {sha['ratings']}"  # trace -> batch
    assert tags[f"rlhf.intake.{carol.assessment_id}"] == f"pairs batch {sha['pairs']}"
    assert client.get_trace(bad).info.tags[f"rlhf.intake.{carol.assessment_id}"] == f"pairs batch {sha['pairs']}"
    assert client.get_trace(empty).info.tags[f"rlhf.intake.{refused.assessment_id}"].startswith("refused: ")
    assert f"rlhf.intake.{judge.assessment_id}" not in client.get_trace(fine).info.tags

    again = collect(project, push=True)
    assert again.records == [] and again.refused == [] and _commits(project) == before + 1  # nothing twice

    later = record_rating(client, bad, False, "dave")
    third = collect(project, push=True)
    assert [r["rows"] for r in third.records] == [1]
    assert _batch_rows(project, "ratings")[-1]["assessment_id"] == later.assessment_id


def test_a_changed_or_repeated_judgement_is_not_ingested_twice(project):
    import mlflow

    from tasks.feedback.collect import collect
    from tasks.feedback.assessments import record_rating

    client = mlflow.MlflowClient()
    trace = served("The film", " was great fun.")
    first = record_rating(client, trace, False, "alice")
    changed = mlflow.override_feedback(trace_id=trace, assessment_id=first.assessment_id, value=True,
                                       source=human("alice"))  # a change, as MLflow's UI records it
    second = record_rating(client, trace, True, "bob")  # the same answer judged by someone else
    collection = collect(project, push=False)
    (row,) = _batch_rows(project, "ratings")
    assert row["assessment_id"] == changed.assessment_id and row["label"] is True  # the change, not the original
    assert [r.assessment_id for r in collection.refused] == [second.assessment_id]
    assert "duplicate" in collection.refused[0].reason


def test_a_pair_of_different_prompts_or_a_foreign_trace_is_refused_with_why(project):
    import mlflow

    from tasks.feedback.collect import collect
    from tasks.feedback.assessments import JudgementError, record_preference

    client = mlflow.MlflowClient()
    a, b = served("The film", " was great."), served("I think", " it was dull.")
    with pytest.raises(JudgementError, match="answer different prompts"):
        record_preference(client, a, b, "alice")  # refused before anything is written
    with mlflow.start_span(name="something else") as span:  # a trace the served policy did not write
        foreign = span.trace_id
    mlflow.flush_trace_async_logging()
    by_api = mlflow.log_feedback(trace_id=a, name="preferred", value=True, source=human("bob"),
                                 metadata={"rejected_trace_id": b})
    on_foreign = mlflow.log_feedback(trace_id=foreign, name="good", value=True, source=human("bob"))
    collection = collect(project, push=False)
    assert collection.records == []
    assert [r.assessment_id for r in collection.refused] == [by_api.assessment_id]
    assert "answer different prompts" in collection.refused[0].reason
    assert on_foreign.assessment_id not in {r.assessment_id for r in collection.refused}  # not ours: not searched


KILLER = textwrap.dedent("""
    import os, signal, sys
    import {module} as target
    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
    target.{name} = die
    from tasks.feedback.collect import collect
    collect(sys.argv[1], push=True)
""")


@pytest.mark.parametrize("module, name", [
    ("tasks.feedback.collect", "ingest"),  # judgements read, batch files written for the intake, nothing ingested
    ("tasks.feedback.intake", "_commit"),  # batch versioned (DVC) and in the manifest, killed before the git commit
])
def test_a_collection_killed_before_its_commit_loses_and_duplicates_nothing(project, module, name):
    import mlflow

    from tasks.feedback.collect import collect
    from tasks.feedback.assessments import record_preference, record_rating

    client = mlflow.MlflowClient()
    a, b = served("The film", " was great fun."), served("The film", " was a bore.")
    ids = {record_rating(client, a, True, "alice").assessment_id,
           record_preference(client, a, b, "carol").assessment_id}
    before = _commits(project)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    killed = subprocess.run([sys.executable, "-c", KILLER.format(module=module, name=name), str(project)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert _commits(project) == before  # nothing committed yet

    collect(project, push=True)  # finishes the killed intake, or collects the same judgements again
    collect(project, push=True)  # and again: nothing new

    rows = _batch_rows(project, "ratings") + _batch_rows(project, "pairs")
    assert sorted(r["assessment_id"] for r in rows) == sorted(ids)  # each judgement once
    assert len(read_manifest(project / "incoming")) == 2 and _commits(project) == before + 1
    status = subprocess.run(["git", "status", "--porcelain", "incoming"], cwd=project, capture_output=True, text=True)
    assert status.stdout == ""  # everything of the intake is committed


def test_the_command_lists_what_it_ingested_and_left_out(project, capsys):
    import mlflow

    from flows.collect_feedback import main
    from tasks.feedback.assessments import record_rating

    client = mlflow.MlflowClient()
    record_rating(client, served("The film", " was great fun."), True, "alice")
    empty = served("I think", "")
    mlflow.log_feedback(trace_id=empty, name="good", value=True, source=human("alice"))  # as MLflow's UI records it
    assert main(["--root", str(project), "--no-retrain", "--no-push"]) == 0
    out = capsys.readouterr().out
    assert "ingested ratings batch" in out and "(1 judgements)" in out
    assert f"(trace {empty}): " in out and "field 'completion' is empty" in out
    assert main(["--root", str(project), "--no-retrain", "--no-push"]) == 0
    assert "no new judgements" in capsys.readouterr().out
    manifest = read_manifest(project / "incoming")
    assert len(manifest) == 1 and json.loads(json.dumps(manifest[0]))["rows"] == 1


def test_a_judgement_of_another_experiments_trace_is_refused_at_entry(project):
    """Issue 33: a rating of another experiment's trace showed "Recorded" but was never collected."""
    import mlflow

    from tasks.feedback.assessments import JudgementError, record_preference, record_rating

    client = mlflow.MlflowClient()
    ours = mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id
    mlflow.set_experiment("someone-else")
    other, other_b = served("The film", " was great."), served("The film", " was dull.")
    mlflow.set_experiment(experiment_id=ours)
    with pytest.raises(JudgementError, match=rf"belongs to experiment \d+, not the project's \({ours}\): its "
                                             "judgements would never be collected"):
        record_rating(client, other, True, "alice", experiment_id=ours)
    with pytest.raises(JudgementError, match="would never be collected"):
        record_preference(client, other, other_b, "alice", experiment_id=ours)
    assert client.get_trace(other).info.assessments == []  # nothing written
    assert record_rating(client, served("I think", " so."), True, "alice", experiment_id=ours).value is True


@pytest.mark.parametrize("typed, recorded", [("ａｌｉｃｅ", "alice"), ("  alice   smith ", "alice smith"),
                                             ("ﬁona", "fiona")])
def test_reviewer_names_are_normalised(typed, recorded):
    from tasks.feedback.assessments import check_reviewer

    assert check_reviewer(typed) == recorded


@pytest.mark.parametrize("name, words", [("ali\u200bce", "invisible or control character (U+200B)"),
                                         ("\u202eecila", "a direction control (U+202E)"),
                                         ("bob\u2066", "a direction control (U+2066)"), ("a\x00b", "U+0000")])
def test_reviewer_names_with_invisible_or_direction_characters_are_refused(name, words):
    from tasks.feedback.assessments import JudgementError, check_reviewer

    with pytest.raises(JudgementError, match=re.escape(words)):
        check_reviewer(name)


def test_a_reviewers_latest_judgement_of_the_same_answer_or_pair_wins(project):
    """Issue 33: rating Good then Bad kept the first and refused the correction as a duplicate; A over B then B over
    A ingested both opposite pairs. The later judgement wins; the earlier is marked superseded on its trace."""
    import time

    import mlflow

    from tasks.feedback.collect import MARK, collect
    from tasks.feedback.assessments import record_preference, record_rating

    client = mlflow.MlflowClient()
    trace = served("The film", " was great fun.")
    good = record_rating(client, trace, True, "alice")
    time.sleep(0.01)  # (judgement order is creation time)
    bad = record_rating(client, trace, False, "alice")  # the correction
    a, b = served("I think", " it was lovely."), served("I think", " it was dull.")
    a_over_b = record_preference(client, a, b, "carol")
    time.sleep(0.01)
    b_over_a = record_preference(client, b, a, "carol")  # changed her mind
    collection = collect(project, push=False)
    (rating,) = _batch_rows(project, "ratings")
    assert rating["assessment_id"] == bad.assessment_id and rating["label"] is False
    (pair,) = _batch_rows(project, "pairs")
    assert pair["assessment_id"] == b_over_a.assessment_id and pair["chosen"] == " it was dull."
    reasons = {r.assessment_id: r.reason for r in collection.refused}
    assert reasons[good.assessment_id] == f"superseded by {bad.assessment_id}, alice's later judgement of the same answer"
    assert reasons[a_over_b.assessment_id].startswith(f"superseded by {b_over_a.assessment_id}")
    assert client.get_trace(trace).info.tags[MARK + good.assessment_id].startswith("refused: superseded by")


def test_reading_judgements_raises_no_deprecation_warning(project):
    """Issue 33: `search_traces(experiment_ids=...)` printed MLflow's FutureWarning at every collection."""
    import warnings

    import mlflow

    from tasks.feedback.collect import find_judgements
    from tasks.feedback.assessments import record_rating, recent_generations

    client = mlflow.MlflowClient()
    experiment = mlflow.get_experiment_by_name("rlhf-pipeline").experiment_id
    record_rating(client, served("The film", " was fine."), True, "alice")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        assert len(recent_generations(client, experiment)) == 1
        found, _ = find_judgements(client, experiment, set())
    assert len(found) == 1
