"""A registered version names the feedback that taught it: version -> batches -> traces and judgements."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from test_registry import project  # noqa: F401  (the fixture: a tiny evaluated project, registry candidate ppo)

from rlhf_core.feedback import canonical_bytes
from tasks.feedback.lineage import LINEAGE_FILE, TAG_LIMIT, feedback_kinds, feedback_lineage, feedback_tags
from tasks.stages import load_params, stage_files

ROOT = Path(__file__).resolve().parents[1]
PAIR = {"prompt": "The film", "chosen": " was great.", "rejected": " was dull.", "chosen_trace_id": "tr-1",
        "rejected_trace_id": "tr-2", "assessment_id": "a-1", "reviewer": "carol"}
RATING = {"prompt": "The film", "completion": " was great.", "label": True, "trace_id": "tr-1",
          "assessment_id": "a-2", "reviewer": "alice"}
FILE_PAIR = {"prompt": "I think", "chosen": " it was fun.", "rejected": " it was bad."}  # `make intake` of a file


def _ingested(root: Path, batches: list[tuple[str, list[dict]]]) -> list[str]:
    """Batches as the intake stores them (files named by hash, listed in the manifest); returns their hashes."""
    store = root / "incoming"
    shas, lines = [], []
    for kind, rows in batches:
        data = canonical_bytes(rows)
        sha = hashlib.sha256(data).hexdigest()
        (store / kind).mkdir(parents=True, exist_ok=True)
        (store / kind / f"{sha}.jsonl").write_bytes(data)
        lines.append(json.dumps({"sha256": sha, "kind": kind, "file": f"{kind}/{sha}.jsonl", "rows": len(rows),
                                 "ingested_at": "2026-01-01T00:00:00+00:00", "user": "ci"}) + "\n")
        shas.append(sha)
    (store / "manifest.jsonl").write_text("".join(lines))
    return shas


def _prepared(root: Path, pairs: list[dict] = (), ratings: list[dict] = ()) -> None:
    """``data/preferences.jsonl`` and ``data/ratings.jsonl`` as ``prepare`` writes them: the schema's fields and the
    gold scores (no provenance), after a generated row."""
    (root / "data").mkdir(parents=True, exist_ok=True)
    generated_pair = {"prompt": "A", "chosen": " good", "rejected": " bad", "chosen_score": 0.5, "rejected_score": -0.5}
    rows = [generated_pair] + [{k: p[k] for k in ("prompt", "chosen", "rejected")} | {"chosen_score": 0.1,
                                                                                    "rejected_score": 0.0} for p in pairs]
    (root / "data" / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rows = [{"prompt": "A", "completion": " good", "label": True, "score": 0.5}] + [
        {k: r[k] for k in ("prompt", "completion", "label")} | {"score": 0.2} for r in ratings]
    (root / "data" / "ratings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_kinds_of_feedback_that_reach_each_stage():
    paths = load_params(ROOT / "params.yaml").paths
    assert feedback_kinds(paths, stage_files(paths), "dpo") == ["pairs"]
    assert feedback_kinds(paths, stage_files(paths), "kto") == ["ratings"]
    for stage in ("ppo", "grpo", "rloo"):  # through the reward model, trained on the pairs
        assert feedback_kinds(paths, stage_files(paths), stage) == ["pairs"]
    assert feedback_kinds(paths, stage_files(paths), "sft") == []


def test_the_lineage_lists_the_batches_with_their_judgements(tmp_path):
    paths = load_params(ROOT / "params.yaml").paths
    pairs, ratings, plain = _ingested(tmp_path, [("pairs", [PAIR]), ("ratings", [RATING]), ("pairs", [FILE_PAIR])])
    _prepared(tmp_path, [PAIR, FILE_PAIR], [RATING])
    lineage = feedback_lineage(tmp_path, paths, stage_files(paths), "dpo")
    assert [b["sha256"] for b in lineage["batches"]] == [pairs, plain]  # DPO trains on pairs, not ratings
    assert lineage["batches"][0]["judgements"] == [{k: PAIR[k] for k in ("chosen_trace_id", "rejected_trace_id",
                                                                         "assessment_id", "reviewer")}]
    assert lineage["batches"][1]["judgements"] == []  # a file's rows name no trace
    assert [b["rows_trained"] for b in lineage["batches"]] == [1, 1] and lineage["rows_not_trained"] == 0
    assert lineage["batches"][0]["dvc_md5"] == hashlib.md5(canonical_bytes([PAIR])).hexdigest()  # DVC's hash
    assert lineage["manifest_md5"] == hashlib.md5((tmp_path / "incoming" / "manifest.jsonl").read_bytes()).hexdigest()
    tags = feedback_tags(lineage)
    assert tags["feedback.batches"] == f"{pairs},{plain}" and tags["feedback.judgements"] == "1"
    assert tags["feedback.reviewers"] == "carol" and tags["feedback.kinds"] == "pairs"
    kto = feedback_tags(feedback_lineage(tmp_path, paths, stage_files(paths), "kto"))
    assert kto["feedback.batches"] == ratings and kto["feedback.reviewers"] == "alice"


def test_tags_keep_the_newest_batches_that_fit():
    lineage = {"kinds": ["pairs"], "manifest_md5": "m",
               "batches": [{"sha256": f"{i:064x}", "judgements": []} for i in range(100)]}
    batches = feedback_tags(lineage)["feedback.batches"]
    assert len(batches) <= TAG_LIMIT and batches.endswith(f"{99:064x}")
    assert batches.startswith(f"(the oldest {100 - batches.count(',')} in {LINEAGE_FILE}),")


def test_a_registered_version_names_its_batches_and_their_traces(project):  # noqa: F811
    import mlflow

    from tasks.registry.gate import registry_task

    pairs, _, plain = _ingested(project, [("pairs", [PAIR]), ("ratings", [RATING]), ("pairs", [FILE_PAIR])])
    _prepared(project, [PAIR, FILE_PAIR], [RATING])  # prepare ran after the intake
    record = registry_task.fn(str(project))
    client = mlflow.MlflowClient()
    version = client.get_model_version("rlhf-policy", str(record["version"]))
    assert version.tags["feedback.batches"] == f"{pairs},{plain}"  # ppo: the pairs, through the reward model
    assert version.tags["feedback.judgements"] == "1" and version.tags["feedback.reviewers"] == "carol"
    path = mlflow.artifacts.download_artifacts(run_id=version.run_id, artifact_path=LINEAGE_FILE)
    lineage = json.loads(Path(path).read_text())
    assert lineage["policy"] == "ppo" and lineage["batches"][0]["judgements"][0]["chosen_trace_id"] == "tr-1"


def test_the_lineage_names_only_the_rows_that_entered_training(tmp_path):
    """Issue 33: the lineage named every ingested row, also those `prepare.incoming_judge: agree` left out (the gold
    judge disagreed) and those of a batch ingested after prepare ran: reviewers credited for judgements that never
    trained. Now a row is named only if it is a row of the prepared file the policy read; the rest are counted."""
    paths = load_params(ROOT / "params.yaml").paths
    dropped = {**PAIR, "chosen": " was dull.", "rejected": " was great.", "assessment_id": "a-3", "reviewer": "dora"}
    late = {**PAIR, "prompt": "Later", "assessment_id": "a-4", "reviewer": "eve"}
    first, _ = _ingested(tmp_path, [("pairs", [PAIR, dropped]), ("pairs", [late])])
    _prepared(tmp_path, [PAIR])  # prepare (agree) kept PAIR, dropped `dropped`; `late` came after it ran
    lineage = feedback_lineage(tmp_path, paths, stage_files(paths), "dpo")
    assert [b["sha256"] for b in lineage["batches"]] == [first]  # the late batch taught nothing
    assert lineage["batches"][0]["rows"] == 2 and lineage["batches"][0]["rows_trained"] == 1
    assert [j["assessment_id"] for j in lineage["batches"][0]["judgements"]] == ["a-1"]
    assert lineage["rows_not_trained"] == 2
    tags = feedback_tags(lineage)
    assert tags["feedback.judgements"] == "1" and tags["feedback.reviewers"] == "carol"
    assert tags["feedback.batches"] == first
    rating = {**RATING, "label": False}  # the same texts with the other label: not the row that trained
    _ingested(tmp_path, [("ratings", [rating])])
    _prepared(tmp_path, [], [RATING])
    assert feedback_lineage(tmp_path, paths, stage_files(paths), "kto")["batches"] == []


def test_a_missing_prepared_file_is_named(tmp_path):
    paths = load_params(ROOT / "params.yaml").paths
    _ingested(tmp_path, [("pairs", [PAIR])])
    with pytest.raises(FileNotFoundError, match=r"data/preferences.jsonl: missing.*dvc pull"):
        feedback_lineage(tmp_path, paths, stage_files(paths), "dpo")


@pytest.mark.parametrize("stage", ["dpo"])
def test_no_feedback_is_said_plainly(tmp_path, stage):
    paths = load_params(ROOT / "params.yaml").paths
    tags = feedback_tags(feedback_lineage(tmp_path, paths, stage_files(paths), stage))
    assert tags["feedback.batches"] == "none" and tags["feedback.judgements"] == "0"
    assert tags["feedback.manifest_md5"] == "none"
