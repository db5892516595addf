"""Feedback intake: validation names file and line, nothing is ingested on failure, batches are versioned
by hash with DVC, recorded in the manifest and committed; prepare reads only ingested pairs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest
from _pipeline_project import make_project

from rlhf_core.data import DataFormatError
from rlhf_core.feedback import (
    IntakeLimits,
    canonical_bytes,
    check_no_loose_files,
    read_feedback_pairs,
    row_key,
    validate_batch,
    validate_files,
)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


PAIR = {"prompt": "This movie was", "chosen": " wonderful.", "rejected": " awful."}


def test_pairs_are_canonical_and_hashed(tmp_path):
    batch = validate_batch(_jsonl(tmp_path / "a.jsonl", [{"rejected": " bad.", "chosen": " good.", "prompt": " The film "}]))
    assert batch.kind == "pairs" and batch.lines == [1]
    assert batch.rows == [{"prompt": "The film", "chosen": " good.", "rejected": " bad."}]  # schema order, prompt stripped
    assert canonical_bytes(batch.rows) == b'{"prompt": "The film", "chosen": " good.", "rejected": " bad."}\n'
    assert batch.sha256 == hashlib.sha256(canonical_bytes(batch.rows)).hexdigest()


def test_ratings_from_csv_with_labels(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text('prompt,completion,label\nThis movie was, great.,true\n"The film,\nwas", dull.,0\n', encoding="utf-8")
    batch = validate_batch(path)
    assert batch.kind == "ratings"
    assert [r["label"] for r in batch.rows] == [True, False]
    assert batch.rows[1]["prompt"] == "The film,\nwas"


def test_ratings_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"prompt": ["A", "B"], "completion": [" x", " y"], "label": [True, False]}), path)
    assert [r["label"] for r in validate_batch(path).rows] == [True, False]
    pq.write_table(pa.table({"prompt": ["A", None], "completion": [" x", " y"], "label": [True, False]}), path)
    with pytest.raises(DataFormatError, match=r"r\.parquet:2: field 'prompt' must be a string"):
        validate_batch(path)


@pytest.mark.parametrize("rows, message", [
    ([PAIR, {"prompt": "x", "chosen": " a"}], r"bad\.jsonl:2: fields \['chosen', 'prompt'\] match no feedback schema"),
    ([PAIR, {**PAIR, "chosen": "   "}], r"bad\.jsonl:2: field 'chosen' is empty"),
    ([{**PAIR, "prompt": ""}], r"bad\.jsonl:1: field 'prompt' is empty"),
    ([PAIR, {**PAIR, "rejected": " wonderful. "}], r"bad\.jsonl:2: 'chosen' and 'rejected' are the same text"),
    ([PAIR, {**PAIR, "chosen": 3}], r"bad\.jsonl:2: field 'chosen' must be a string, got int"),
    ([PAIR, {"prompt": "p", "completion": " c", "label": True}], r"bad\.jsonl:2: a ratings record in a file of pairs"),
    ([{"prompt": "p", "completion": " c", "label": "maybe"}], r"bad\.jsonl:1: field 'label' must be true or false"),
    ([PAIR, {**PAIR, "extra": 1}], r"bad\.jsonl:2: fields .* match no feedback schema"),
    ([PAIR, "{not json"], r"bad\.jsonl:2: invalid JSON"),
    ([PAIR, PAIR], r"bad\.jsonl:2: duplicate of line 1"),
    ([{"prompt": "p", "completion": " c", "label": True}, {"prompt": "p", "completion": " c", "label": False}],
     r"bad\.jsonl:2: duplicate of line 1"),  # a contradicting label is a duplicate too
    ([], r"bad\.jsonl: no records"),
])
def test_bad_files_name_file_and_line(tmp_path, rows, message):
    with pytest.raises(DataFormatError, match=message):
        validate_batch(_jsonl(tmp_path / "bad.jsonl", rows))


def test_not_utf8_and_size_limits(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(json.dumps(PAIR).encode() + b"\n" + '{"prompt": "caf\xe9", "chosen": " a", "rejected": " b"}\n'.encode("latin-1"))
    with pytest.raises(DataFormatError, match=r"latin\.jsonl:2: .*UTF-8"):
        validate_batch(path)
    rows = [{**PAIR, "chosen": f" good {i}."} for i in range(3)]
    with pytest.raises(DataFormatError, match=r"big\.jsonl:3: more than 2 records"):
        validate_batch(_jsonl(tmp_path / "big.jsonl", rows), limits=IntakeLimits(max_rows=2))
    with pytest.raises(DataFormatError, match=r"big\.jsonl:1: field 'prompt' has 14 characters \(limit 10\)"):
        validate_batch(tmp_path / "big.jsonl", limits=IntakeLimits(max_field_chars=10))
    with pytest.raises(DataFormatError, match=r"big\.jsonl: file has \d+ bytes \(limit 100\)"):
        validate_batch(tmp_path / "big.jsonl", limits=IntakeLimits(max_file_bytes=100))
    with pytest.raises(DataFormatError, match=r"x\.txt: unsupported file type"):
        validate_batch(tmp_path / "x.txt")


def test_duplicates_across_files_and_stored_batches(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [PAIR])
    b = _jsonl(tmp_path / "b.jsonl", [{**PAIR, "chosen": " great."}, PAIR])
    with pytest.raises(DataFormatError, match=r"b\.jsonl:2: duplicate of a row already ingested \(.*a\.jsonl:1\)"):
        validate_files([a, b])
    stored = {row_key("pairs", PAIR): "incoming/pairs/x.jsonl:7"}
    with pytest.raises(DataFormatError, match=r"a\.jsonl:1: duplicate of a row already ingested \(incoming/pairs/x\.jsonl:7\)"):
        validate_batch(a, stored)


def test_prepare_reads_ingested_pairs_only(tmp_path):
    store = tmp_path / "incoming"
    (store / "pairs").mkdir(parents=True)
    data = canonical_bytes([PAIR])
    sha = hashlib.sha256(data).hexdigest()
    (store / "pairs" / f"{sha}.jsonl").write_bytes(data)
    (store / "manifest.jsonl").write_text(json.dumps({"sha256": sha, "kind": "pairs", "file": f"pairs/{sha}.jsonl"}) + "\n")
    assert read_feedback_pairs(store) == [PAIR]
    (store / "pairs" / f"{sha}.jsonl").write_bytes(data.replace(b"awful", b"AWFUL"))
    with pytest.raises(DataFormatError, match="does not match the batch name"):
        read_feedback_pairs(store)
    (store / "pairs" / f"{sha}.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="run `dvc pull`"):
        read_feedback_pairs(store)
    (store / "loose.jsonl").write_text("{}\n")
    with pytest.raises(DataFormatError, match=r"incoming/loose\.jsonl: not ingested \(unversioned\): .*`python -m flows.intake"):
        check_no_loose_files(store)


RATED = {"prompt": "The film", "completion": " bored me.", "label": False, "trace_id": "tr-1", "assessment_id": "a-1",
         "reviewer": "alice"}
JUDGED_PAIR = {**PAIR, "chosen_trace_id": "tr-2", "rejected_trace_id": "tr-3", "assessment_id": "a-2",
               "reviewer": "bob"}


def test_provenance_columns_are_checked_and_kept_in_schema_order(tmp_path):
    shuffled = {"reviewer": " bob ", "assessment_id": "a-2", **PAIR, "rejected_trace_id": "tr-3",
                "chosen_trace_id": "tr-2"}
    batch = validate_batch(_jsonl(tmp_path / "pairs.jsonl", [shuffled]))
    assert batch.kind == "pairs" and batch.rows == [JUDGED_PAIR]  # schema fields, then provenance, stripped
    assert list(batch.rows[0]) == ["prompt", "chosen", "rejected", "chosen_trace_id", "rejected_trace_id",
                                   "assessment_id", "reviewer"]
    ratings = validate_batch(_jsonl(tmp_path / "ratings.jsonl", [{"prompt": "The film", "completion": " ok.",
                                                                   "label": True, "reviewer": "carol"}]))
    assert ratings.kind == "ratings" and ratings.rows[0]["reviewer"] == "carol"  # any subset of the columns
    bare = validate_batch(_jsonl(tmp_path / "bare.jsonl", [PAIR]))
    assert bare.sha256 != batch.sha256 and canonical_bytes(bare.rows) == canonical_bytes([PAIR])  # old batches: same bytes


@pytest.mark.parametrize("row, message", [
    ({**PAIR, "trace_id": "tr-1"}, r"fields .* match no feedback schema"),  # a ratings column in a pair
    ({**RATED, "reviewer": ""}, r"field 'reviewer' must be a non-empty string"),
    ({**RATED, "assessment_id": 7}, r"field 'assessment_id' must be a non-empty string, got 7"),
    ({**RATED, "reviewer": "a\nb"}, r"field 'reviewer' contains a control character"),
    ({**RATED, "trace_id": "t" * 300}, r"field 'trace_id' has 300 characters \(limit 256\)"),
])
def test_bad_provenance_names_file_and_line(tmp_path, row, message):
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:1: " + message):
        validate_batch(_jsonl(tmp_path / "bad.jsonl", [row]))


def test_a_row_judged_twice_is_a_duplicate_whatever_its_provenance(tmp_path):
    first = _jsonl(tmp_path / "a.jsonl", [JUDGED_PAIR])
    again = _jsonl(tmp_path / "b.jsonl", [{**JUDGED_PAIR, "assessment_id": "a-9", "reviewer": "carol"}])
    with pytest.raises(DataFormatError, match=r"b\.jsonl:1: duplicate of a row already ingested"):
        validate_files([first, again])


def _store(tmp_path: Path, batches: list[tuple[str, list[dict]]]) -> Path:
    store = tmp_path / "incoming"
    lines = []
    for kind, rows in batches:
        data = canonical_bytes(rows)
        sha = hashlib.sha256(data).hexdigest()
        (store / kind).mkdir(parents=True, exist_ok=True)
        (store / kind / f"{sha}.jsonl").write_bytes(data)
        lines.append(json.dumps({"sha256": sha, "kind": kind, "file": f"{kind}/{sha}.jsonl"}) + "\n")
    (store / "manifest.jsonl").write_text("".join(lines))
    return store


def test_prepare_reads_schema_fields_only_ratings_included(tmp_path):
    from rlhf_core.feedback import read_feedback_ratings

    store = _store(tmp_path, [("pairs", [JUDGED_PAIR]), ("ratings", [RATED, {**RATED, "completion": " fine."}])])
    assert read_feedback_pairs(store) == [PAIR]  # provenance stays in the batch, never reaches training
    assert read_feedback_ratings(store) == [{"prompt": "The film", "completion": " bored me.", "label": False},
                                            {"prompt": "The film", "completion": " fine.", "label": False}]


@pytest.mark.parametrize("setting", ["keep", "agree"])
def test_prepare_adds_ingested_ratings_overruled_by_the_judge_only_when_asked(tmp_path, monkeypatch, setting):
    """Issue 33: human judgements the sentiment lexicon disagreed with were dropped silently. By default
    (``prepare.incoming_judge: keep``) every one trains; ``agree`` keeps the old rule, counting each drop."""
    import yaml

    from tasks.run.stage_task import run_stage

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    root = make_project(tmp_path / "proj", git_dvc=False)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["prepare"]["incoming_judge"] = setting
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    agreed = [{**RATED, "completion": " was wonderful, I loved it.", "label": True, "assessment_id": "a-3"},
              {**RATED, "completion": " was awful and boring.", "label": False, "assessment_id": "a-4"}]
    disagreed = {**RATED, "completion": " was terrible, the worst.", "label": True, "assessment_id": "a-5"}
    _store(root, [("ratings", agreed + [disagreed])])
    metrics = run_stage("prepare", str(root))
    trained = agreed + [disagreed] if setting == "keep" else agreed
    assert metrics["num_incoming_ratings"] == 3 and metrics["num_dropped_incoming_ratings"] == 3 - len(trained)
    rows = [json.loads(line) for line in (root / "data" / "ratings.jsonl").read_text().splitlines()]
    assert [{k: r[k] for k in ("prompt", "completion", "label")} for r in rows[-len(trained):]] == [
        {k: r[k] for k in ("prompt", "completion", "label")} for r in trained]  # after the generated ratings
    assert metrics["num_ratings"] == len(rows) and not any("reviewer" in r for r in rows)


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def test_intake_versions_records_commits_and_refuses_atomically(tmp_path, monkeypatch):
    from flows.intake import EXIT_BAD_INPUT, main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("RLHF_INTAKE_USER", "alice")
    root = make_project(tmp_path / "proj")
    good = _jsonl(tmp_path / "good.jsonl", [PAIR, {**PAIR, "chosen": " lovely."}])
    ratings = _jsonl(tmp_path / "ratings.jsonl", [{"prompt": "The film", "completion": " bored me.", "label": False}])
    bad = _jsonl(tmp_path / "bad.jsonl", [{**PAIR, "chosen": " fun."}, {**PAIR, "chosen": " fun."}])
    head = _git(root, "rev-parse", "HEAD")

    # one bad file among good ones: nothing is written, nothing committed
    assert main([str(good), str(bad), "--root", str(root)]) == EXIT_BAD_INPUT
    assert _git(root, "rev-parse", "HEAD") == head
    assert sorted(p.name for p in (root / "incoming").iterdir()) == ["README.md"]

    assert main([str(good), str(ratings), "--root", str(root), "--no-retrain"]) == 0
    manifest = [json.loads(line) for line in (root / "incoming" / "manifest.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["rows"], r["user"], r["source"]) for r in manifest] == [
        ("pairs", 2, "alice", str(good)), ("ratings", 1, "alice", str(ratings))]
    for r in manifest:
        stored = root / "incoming" / r["file"]
        assert stored.name == f"{r['sha256']}.jsonl" and (root / "incoming" / (r["file"] + ".dvc")).is_file()
    assert read_feedback_pairs(root / "incoming") == [PAIR, {**PAIR, "chosen": " lovely."}]  # ratings kept apart
    # committed: the manifest and .dvc files are in git, the data is not (DVC has it), the tree is clean
    assert _git(root, "status", "--porcelain") == ""
    tracked = _git(root, "ls-files", "incoming").split()
    assert f"incoming/{manifest[0]['file']}.dvc" in tracked and f"incoming/{manifest[0]['file']}" not in tracked
    assert "feedback: ingest 2 batch(es)" in _git(root, "log", "-1", "--format=%B")
    # pushed: the remote holds every batch under the md5 its .dvc file records
    for r in manifest:
        md5 = hashlib.md5((root / "incoming" / r["file"]).read_bytes()).hexdigest()
        assert f"md5: {md5}" in (root / "incoming" / (r["file"] + ".dvc")).read_text()
        assert (root / ".dvc-remote" / "files" / "md5" / md5[:2] / md5[2:]).is_file()
    # the same file again is that batch again: nothing to do, nothing committed (issue 24: ingesting is idempotent,
    # so a retry after a killed intake is never refused); a file repeating one of its rows is a duplicate
    head = _git(root, "rev-parse", "HEAD")
    assert main([str(good), "--root", str(root), "--no-retrain"]) == 0
    assert _git(root, "rev-parse", "HEAD") == head and len(manifest) == len(
        (root / "incoming" / "manifest.jsonl").read_text().splitlines())
    overlap = _jsonl(tmp_path / "overlap.jsonl", [{**PAIR, "chosen": " superb."}, PAIR])
    assert main([str(overlap), "--root", str(root)]) == EXIT_BAD_INPUT


def test_failed_push_ingests_nothing(tmp_path, monkeypatch):
    from flows.intake import EXIT_NOT_VERSIONED, main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = make_project(tmp_path / "proj")
    (root / "not-a-dir").write_text("a file where the remote's directory should be\n")
    with open(root / ".dvc" / "config", "a") as fh:
        fh.write(f"['remote \"broken\"']\n    url = {root / 'not-a-dir' / 'store'}\n")
    head = _git(root, "rev-parse", "HEAD")
    good = _jsonl(tmp_path / "good.jsonl", [PAIR])
    assert main([str(good), "--root", str(root), "--remote", "broken"]) == EXIT_NOT_VERSIONED
    assert _git(root, "rev-parse", "HEAD") == head
    assert [p.name for p in (root / "incoming").rglob("*")] == ["README.md"]


@pytest.mark.slow
def test_intake_event_reaches_the_prefect_server(monkeypatch):
    """The event the retraining deployment's trigger waits for arrives at the server, with the batch hash."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter
    from prefect.testing.utilities import prefect_test_harness

    from tasks.feedback.intake import EVENT, emit_ingested

    record = {"sha256": "ab" * 32, "kind": "pairs", "file": f"pairs/{'ab' * 32}.jsonl", "rows": 3,
              "source": "/data/new.jsonl", "user": "alice"}
    assert emit_ingested([record]) == 0  # no server configured: nothing to trigger, nothing sent
    with prefect_test_harness(server_startup_timeout=120):
        assert emit_ingested([record]) == 1
        events = []
        for _ in range(60):  # the server persists events asynchronously
            with get_client(sync_client=True) as client:
                events = client.read_events(EventFilter(event=EventNameFilter(name=[EVENT])), limit=50).events
            if events:
                break
            time.sleep(0.5)
    assert len(events) == 1
    assert events[0].resource.id == f"rlhf.feedback.{record['sha256']}"
    assert events[0].payload["sha256"] == record["sha256"] and events[0].payload["rows"] == 3


def test_failed_commit_ingests_nothing(tmp_path, monkeypatch):
    from flows.intake import EXIT_NOT_VERSIONED, main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = make_project(tmp_path / "proj")
    hook = root / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\necho 'refused by hook' >&2\nexit 1\n")
    hook.chmod(0o755)
    good = _jsonl(tmp_path / "good.jsonl", [PAIR])
    assert main([str(good), "--root", str(root), "--no-push"]) == EXIT_NOT_VERSIONED
    assert [p.name for p in (root / "incoming").rglob("*")] == ["README.md"]
    assert _git(root, "status", "--porcelain") == ""


def test_a_byte_order_mark_is_stripped_from_jsonl_and_excel_csv(tmp_path):
    """Excel's "CSV UTF-8" export starts with a BOM (and ends lines with CRLF); some editors save JSONL with one."""
    csv_path = tmp_path / "excel.csv"
    csv_path.write_bytes(b"\xef\xbb\xbfprompt,chosen,rejected\r\nThis movie was, wonderful., awful.\r\n")
    jsonl_path = tmp_path / "bom.jsonl"
    jsonl_path.write_bytes(b"\xef\xbb\xbf" + json.dumps(PAIR).encode() + b"\n")
    for path in (csv_path, jsonl_path):
        batch = validate_batch(path)
        assert batch.rows == [PAIR] and batch.lines == [2 if path is csv_path else 1]
        assert canonical_bytes(batch.rows).startswith(b'{"prompt"')  # the stored batch has no BOM


HOLD_CHECKOUT = ("import sys, time\n"
                 "from tasks.process.locking import checkout_lock\n"
                 "with checkout_lock(sys.argv[1], 'python -m flows.retrain'):\n"
                 "    print('held', flush=True)\n"
                 "    time.sleep(float(sys.argv[2]))\n")


def test_a_batch_committed_while_a_retrain_runs_is_retrained_when_it_finishes(tmp_path, monkeypatch, capsys):
    """Issue 33: collecting feedback while a retrain held the checkout exited 73 after committing, and the batch
    stayed untrained until `make retrain`. The intake's retrain now queues behind the run holding the checkout
    (it waits for the lock), and says so."""
    import argparse
    import subprocess
    import sys
    import time

    import flows.retrain
    from flows.intake import QUEUE_WAIT_S, retrain_now
    from tasks.process.locking import checkout_lock

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    (tmp_path / ".dvc").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_CHECKOUT, str(tmp_path), "3"], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        started, acquired = time.monotonic(), []

        def retrain_main(argv):  # the retrain's own first step: the checkout lock, with the wait it was given
            wait = float(argv[argv.index("--wait") + 1])
            with checkout_lock(tmp_path, "python -m flows.retrain", wait_s=wait):
                acquired.append(time.monotonic() - started)
            return 0

        monkeypatch.setattr(flows.retrain, "main", retrain_main)
        args = argparse.Namespace(no_retrain=False, no_commit=False, no_push=True)
        assert retrain_now(tmp_path, args) == 0
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr().out
    assert "another run holds this checkout (pid" in out and "retraining on it is queued" in out
    assert f"waiting up to {QUEUE_WAIT_S // 3600} h" in out
    assert acquired and acquired[0] > 1.0  # it waited for the holder, then ran (not exit 73)
