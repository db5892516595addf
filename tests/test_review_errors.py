"""Errors from user configuration name the parameter and suggest the fix; a tiny corpus gets a warning."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlhf_core.data import DataFormatError, read_text_records
from tasks.spec.params import PARAMS_FILE
from tasks.stages.common.source import check_source, load_source
from tasks.stages import load_params
from tasks.stages.prepare import RECOMMENDED_REVIEWS, size_warning


@pytest.fixture(scope="module")
def prepare_params():
    from pathlib import Path

    return load_params(Path(__file__).resolve().parents[1] / PARAMS_FILE).prepare


def test_missing_source_file_names_the_parameter(prepare_params, tmp_path):
    p = dataclasses.replace(prepare_params, source=str(tmp_path / "x.jsonl"))
    with pytest.raises(FileNotFoundError) as info:
        check_source(p, tmp_path)
    assert str(info.value).startswith(f"prepare.source: {tmp_path / 'x.jsonl'}: no such file")
    assert "Fix: point `prepare.source`" in str(info.value)


def test_missing_text_field_suggests_the_field_that_holds_the_text(prepare_params, tmp_path):
    data = tmp_path / "reviews.jsonl"
    data.write_text(json.dumps({"review": "a long enough review text here", "stars": 4, "id": "r1"}) + "\n")
    p = dataclasses.replace(prepare_params, source="reviews.jsonl", text_field="text")
    for call in (check_source, load_source):
        with pytest.raises(DataFormatError) as info:
            call(p, tmp_path)
        message = str(info.value)
        assert message.startswith(f"prepare.source: {data}:1: missing field 'text' (fields: review, stars, id)")
        assert "Fix: set `prepare.text_field: review` in params.yaml (now 'text')" in message
        assert info.value.line == 1 and info.value.hint_field == "review"


def test_json_error_shows_line_and_column(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine review here"}\n{"text": oops}\n')
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: invalid JSON at column 10 \(Expecting value\)"):
        read_text_records(data)


def test_synthetic_and_hub_sources_are_not_checked_locally(prepare_params, tmp_path):
    check_source(dataclasses.replace(prepare_params, source="synthetic"), tmp_path)
    check_source(dataclasses.replace(prepare_params, source="hub:imdb"), tmp_path)


def test_small_corpus_warning_says_what_size_is_needed():
    assert size_warning(RECOMMENDED_REVIEWS) is None
    warning = size_warning(300)
    assert f"only 300 reviews; at least {RECOMMENDED_REVIEWS} are needed" in warning


def test_pipeline_main_stops_on_a_bad_source_before_anything_starts(tmp_path, capsys, monkeypatch):
    import shutil
    from pathlib import Path

    import flows.pipeline as fp
    from tasks.run.supervisor import EXIT_USAGE

    root = Path(__file__).resolve().parents[1]
    shutil.copy(root / PARAMS_FILE, tmp_path / PARAMS_FILE)
    text = (tmp_path / PARAMS_FILE).read_text().replace("\n  source: synthetic\n", "\n  source: /nonexistent/x.jsonl\n", 1)
    (tmp_path / PARAMS_FILE).write_text(text)
    monkeypatch.setattr(fp, "pipeline", lambda *a, **k: pytest.fail("the flow must not start"))
    assert fp.main(["--root", str(tmp_path)]) == EXIT_USAGE == 2
    assert "error: prepare.source: /nonexistent/x.jsonl: no such file" in capsys.readouterr().err


def test_editing_the_source_file_makes_prepare_stale(prepare_params, tmp_path):
    from tasks.stages.common.source import SOURCE_FINGERPRINT, source_changed, source_fingerprint

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    source = tmp_path / "reviews.jsonl"
    source.write_text(json.dumps({"text": "a good film with a plot"}) + "\n")
    p = dataclasses.replace(prepare_params, source="reviews.jsonl")
    assert source_changed(p, tmp_path, data_dir) == "prepare.source reviews.jsonl: no recorded fingerprint"
    (data_dir / SOURCE_FINGERPRINT).write_text(json.dumps(source_fingerprint(p, tmp_path)))
    assert source_changed(p, tmp_path, data_dir) is None
    source.write_text(source.read_text() + json.dumps({"text": "a bad film with no plot"}) + "\n")
    assert source_changed(p, tmp_path, data_dir) == "prepare.source reviews.jsonl: content changed"
    assert source_changed(dataclasses.replace(prepare_params, source="synthetic"), tmp_path, data_dir) is None


def test_prepare_task_records_the_source_fingerprint(tmp_path, monkeypatch):
    from _pipeline_project import make_project, write_params

    from tasks.stages.common.source import SOURCE_FINGERPRINT, source_changed
    from tasks.run.stage_task import run_stage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    project = make_project(tmp_path / "proj", git_dvc=False)
    source = tmp_path / "reviews.jsonl"
    words = ["great", "awful", "fine", "dull", "superb", "weak"]
    source.write_text("".join(json.dumps({"text": f"the film was {w} and the cast was {v}"}) + "\n"
                              for w in words for v in words))
    write_params(project, {"prepare.source": str(source)})
    run_stage("prepare", str(project))
    p = load_params(project / PARAMS_FILE).prepare
    assert json.loads((project / "data" / SOURCE_FINGERPRINT).read_text())["source"] == str(source)
    assert source_changed(p, project, project / "data") is None
    source.write_text(source.read_text() + json.dumps({"text": "one more review of the film"}) + "\n")
    assert source_changed(p, project, project / "data").endswith("content changed")
