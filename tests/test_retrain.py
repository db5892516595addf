"""Retraining from the committed state, triggered by data, leaving a trace in git.

Slow: two retraining runs of a tiny project (a clean worktree of ``main`` each time; the second after a
feedback intake re-runs only what the new pairs feed), then a fresh clone at the tag of a registered
version restores its data and weights with ``dvc pull`` and ``dvc status`` is clean. Fast: prefect.yaml's
deployments (cron + event trigger) validate against Prefect's own schemas."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from _pipeline_project import ROOT, make_project, mlflow_client, run, write_params

DVC = str(ROOT / ".venv" / "bin" / "dvc")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_prefect_yaml_defines_pipeline_and_retraining_on_cron_and_feedback_event():
    from pydantic import TypeAdapter

    from prefect.events.schemas.deployment_triggers import DeploymentTriggerTypes
    from tasks.feedback.intake import EVENT

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in config["deployments"]}
    assert deployments["rlhf-pipeline"]["entrypoint"] == "flows/pipeline.py:pipeline"
    retrain = deployments["rlhf-retrain"]
    assert retrain["entrypoint"] == "flows/retrain.py:retrain"
    assert len(retrain["schedules"][0]["cron"].split()) == 5
    triggers = [TypeAdapter(DeploymentTriggerTypes).validate_python(t) for t in retrain["triggers"]]
    assert [t.expect for t in triggers] == [{EVENT}]
    assert triggers[0].match.root == {"prefect.resource.id": "rlhf.feedback.*"}
    assert triggers[0].posture == "Reactive" and triggers[0].threshold == 1
    collect = deployments["rlhf-collect-feedback"]  # reviewers' judgements -> batches (its event: the trigger above)
    assert collect["entrypoint"] == "flows/collect_feedback.py:collect_feedback"
    assert len(collect["schedules"][0]["cron"].split()) == 5
    for d in deployments.values():
        path, func = d["entrypoint"].split(":")
        assert f"def {func}(" in (ROOT / path).read_text()
        assert set(d.get("parameters", {})) <= set(_flow_parameters(path, func))


def _flow_parameters(path: str, func: str) -> list[str]:
    import importlib
    import inspect

    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    return list(inspect.signature(getattr(module, func).fn).parameters)


def test_retrain_cli_documents_serve():
    from flows.retrain import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert Path(ROOT / "flows" / "retrain.py").read_text().count("retrain.serve(") == 1


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.mark.slow
def test_retraining_from_committed_state_records_and_restores(harness, tmp_path, monkeypatch):
    from flows.retrain import retrain
    from tasks.feedback.intake import ingest

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = make_project(tmp_path / "proj")
    remote = tmp_path / "shared-remote"  # outside the working copy, as the project's default is
    run([DVC, "remote", "modify", "local", "url", str(remote)], root)
    _git(root, "commit", "-qam", "remote outside the working copy")
    (root / "uncommitted.txt").write_text("someone's edit in progress\n")  # the retrain must not see or touch it

    head = _git(root, "rev-parse", "HEAD")
    first = retrain(str(root))
    assert first["registry"]["decision"] == "promote"
    assert first["pushed"] > 0 and any(p.is_file() for p in remote.rglob("*"))
    v1 = first["registry"]["version"]
    assert first["git"]["tag"] == f"rlhf-policy-v{v1}" and first["git"]["branch"].startswith("retrain/")
    assert set(_git(root, "show", "--name-only", "--format=", first["git"]["branch"]).split()) >= {
        "dvc.lock", "metrics/evaluate.json", "plots/ppo.csv"}
    # landed: main fast-forwarded to the record, its outputs restored; someone's uncommitted edit untouched
    assert first["git"]["landed"] and _git(root, "rev-parse", "HEAD") == first["git"]["commit"]
    assert _git(root, "rev-parse", "HEAD^") == head
    assert _git(root, "status", "--porcelain") == "?? uncommitted.txt"
    assert json.loads(run([DVC, "status", "--json"], root)) == {}  # main's committed state is up to date
    assert _git(root, "worktree", "list").count("\n") == 0

    # new feedback is ingested (committed on main); this time the challenger cannot win
    pairs = [{"prompt": "This movie was", "chosen": f" wonderful, truly {w}.", "rejected": f" awful and {w}."}
             for w in ("fun", "sweet", "smart", "lovely")]
    batch = tmp_path / "2026-11-batch.jsonl"
    batch.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    ingest(root, [batch], emit=False)
    write_params(root, {"registry.min_improvement": 10.0})
    _git(root, "commit", "-qam", "registry: a margin out of reach")
    second = retrain(str(root))
    assert "prepare" in second["ran"] and "reward_model" in second["ran"] and "dpo" in second["ran"]
    assert "evaluate" in second["ran"]
    assert "sft" not in second["ran"]  # restored from the first run's record: only what the pairs feed re-ran
    assert second["git"]["landed"] and json.loads(run([DVC, "status", "--json"], root)) == {}
    record = second["registry"]
    assert record["registered"] and record["version"] != v1
    assert record["decision"] == "keep" and "min_improvement" in record["reason"]
    client = mlflow_client(root)
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == v1
    metrics = json.loads(_git(root, "show", f"{second['git']['tag']}:metrics/prepare.json"))
    assert metrics["num_incoming_pairs"] == 4

    # a teammate: fresh clone at the champion's tag + dvc pull restores it; nothing needs training
    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(root), str(clone)], tmp_path)
    run(["git", "checkout", "-q", first["git"]["tag"]], clone)
    run([DVC, "pull", "-q"], clone)
    assert json.loads(run([DVC, "status", "--json"], clone)) == {}
    assert (clone / "models" / "ppo").is_dir() and (clone / "data" / "preferences.jsonl").is_file()


@pytest.mark.slow
def test_a_retrain_whose_branch_moved_is_landed_by_one_command(harness, tmp_path, monkeypatch):
    """main gets a commit while the retrain runs: the record stays on retrain/<stamp>, the reason names
    `make land-retrain`, and that command (flows.retrain --land) merges it and restores the outputs."""
    from flows import retrain as retrain_module
    from flows.retrain import main as retrain_main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    root = make_project(tmp_path / "proj")
    real_pipeline = retrain_module.pipeline

    def pipeline_while_main_moves(worktree):
        summary = real_pipeline(worktree)
        (root / "NOTES.md").write_text("a teammate's commit during the retrain\n")
        _git(root, "add", "NOTES.md")
        _git(root, "commit", "-qm", "notes")
        return summary

    monkeypatch.setattr(retrain_module, "pipeline", pipeline_while_main_moves)
    summary = retrain_module.retrain(str(root), push=False)
    record = summary["git"]
    assert not record["landed"] and f"make land-retrain REF={record['branch']}" in record["reason"]
    assert not (root / "dvc.lock").exists()  # main untouched

    assert retrain_main(["--root", str(root), "--land", record["branch"]]) == 0
    assert (root / "dvc.lock").is_file() and (root / "NOTES.md").is_file()
    assert json.loads(run([DVC, "status", "--json"], root)) == {}
    assert retrain_main(["--root", str(root), "--land", "retrain/none"]) != 0  # a bad ref: refused, named


def test_land_retrain_names_the_local_changes_in_the_way(tmp_path):
    """Issue 33: `make land-retrain` failed on local edits with git's partial list and advised `make retrain`. It
    names every file in the way and says to commit or stash them; nothing changes."""
    from flows.retrain import land
    from tasks.run.worktree import GitError

    root = tmp_path / "repo"
    root.mkdir()
    for args in (["init", "-q", "-b", "main"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *args], cwd=root, check=True)
    for name in ("dvc.lock", "README.md", "notes.txt"):
        (root / name).write_text("old\n")
    subprocess.run(["git", "add", "."], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "base"], cwd=root, check=True)
    subprocess.run(["git", "switch", "-qc", "retrain/1"], cwd=root, check=True)
    (root / "dvc.lock").write_text("new\n")
    (root / "README.md").write_text("new\n")
    (root / "metrics.json").write_text("{}\n")
    subprocess.run(["git", "add", "."], cwd=root, check=True)
    subprocess.run(["git", "commit", "-qm", "record"], cwd=root, check=True)
    subprocess.run(["git", "switch", "-q", "main"], cwd=root, check=True)
    (root / "dvc.lock").write_text("edited\n")  # local edits: two the record changes, one it does not
    (root / "metrics.json").write_text("mine\n")  # untracked, and the record adds it
    (root / "notes.txt").write_text("edited\n")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout
    with pytest.raises(GitError, match=r"local changes to dvc.lock, metrics.json would be overwritten by retrain/1 "
                                       r".*Commit or stash them \(`git stash`\), then run `make land-retrain "
                                       r"REF=retrain/1` again") as error:
        land(str(root), "retrain/1")
    assert "make retrain`" not in str(error.value)
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout == head
    assert (root / "dvc.lock").read_text() == "edited\n"


def test_a_stage_run_by_hand_names_the_command_that_records_it(monkeypatch):
    """Issue 33: `python -m flows.stage ppo` trained but did not record dvc.lock, silently: the next pipeline
    trained it again. Typed by hand it now names the recording command; under DVC (which records it) it says nothing."""
    from flows.stage import unrecorded_note

    monkeypatch.delenv("DVC_STAGE", raising=False)
    assert "python -m tasks.store.dvc_lockfile commit --force ppo" in unrecorded_note("ppo")
    monkeypatch.setenv("DVC_STAGE", "ppo")
    assert unrecorded_note("ppo") is None
    monkeypatch.delenv("DVC_STAGE")
    monkeypatch.setenv("RLHF_RECORDED_BY_PIPELINE", "1")  # launched side by side: the pipeline records it
    assert unrecorded_note("ppo") is None


def test_the_pipeline_entry_point_refreshes_a_stale_readme_table(tmp_path, capsys):
    """Issue 33: README's results table went stale after `python -m flows.pipeline` (only `make run` rewrote it)."""
    import shutil

    from flows.report import note_readme
    from flows.report import results_block

    (tmp_path / "metrics").mkdir()
    shutil.copy(ROOT / "metrics" / "evaluate.json", tmp_path / "metrics" / "evaluate.json")
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    readme = (ROOT / "README.md").read_text()
    block = results_block(ROOT)
    assert block in readme
    header, rows = block.split("|", 1)
    (tmp_path / "README.md").write_text(readme.replace(block, header + "| stale " + rows, 1))
    note_readme(tmp_path)
    assert (tmp_path / "README.md").read_text() == readme  # the table, rewritten from metrics/evaluate.json
    assert "results table rewritten from metrics/evaluate.json" in capsys.readouterr().out
    note_readme(tmp_path)  # up to date: nothing said
    assert capsys.readouterr().out == ""


def test_the_evaluate_stage_run_alone_refreshes_the_readme_table(tmp_path, monkeypatch, capsys):
    """Issue 33: `python -m flows.stage evaluate` alone (or under `dvc repro`) wrote new metrics/evaluate.json and
    left README's table stale. The stage's command now rewrites it after evaluate, and only after evaluate."""
    import contextlib
    import shutil

    import flows.stage
    from flows.report import results_block

    (tmp_path / "metrics").mkdir()
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copy(ROOT / "metrics" / "evaluate.json", tmp_path / "metrics" / "evaluate.json")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    evaluate = json.loads((ROOT / "metrics" / "evaluate.json").read_text())
    policy = next(iter(evaluate))
    metric = next(iter(evaluate[policy]))
    evaluate[policy][metric] = 123.456  # what a new evaluation would write

    def run_stage(name, root):  # the stage's outputs without training a model (the stage body has its own tests)
        (Path(root) / "metrics" / "evaluate.json").write_text(json.dumps(evaluate))

    monkeypatch.setattr(flows.stage, "PipelineRun", lambda *args, **kwargs: contextlib.nullcontext())
    monkeypatch.setattr(flows.stage, "stage", run_stage)
    monkeypatch.setenv("DVC_STAGE", "evaluate")  # as under dvc repro: no recording note
    assert flows.stage.main(["sft", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "README.md").read_text() == (ROOT / "README.md").read_text()  # sft: the table untouched
    assert flows.stage.main(["evaluate", "--root", str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert results_block(tmp_path) in readme and "123.456" in readme
    assert "results table rewritten from metrics/evaluate.json" in capsys.readouterr().out
