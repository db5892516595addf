"""Stage tasks through ``.fn()`` on temporary directories (no Prefect orchestration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_project import make_project, write_params

from rlhf_core.data import DataFormatError
from tasks.store.outputs import atomic_dir
from tasks.store.provenance import input_hashes

RT_POLARITY = Path(__file__).resolve().parents[2] / "shared" / "data" / "rt-polarity"
DATA_FILES = ("sft_train", "heldout", "prompts_train", "prompts_eval", "preferences", "ratings")


@pytest.fixture
def project(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    return make_project(tmp_path / "proj", git_dvc=False)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_prepare_synthetic(project):
    from tasks.run.stage_task import run_stage

    metrics = run_stage("prepare", str(project))
    data = project / "data"
    for name in DATA_FILES:
        assert (data / f"{name}.jsonl").is_file()
    train, held = _lines(data / "sft_train.jsonl"), _lines(data / "heldout.jsonl")
    assert len(train) + len(held) == 240 and metrics["num_train"] == len(train)
    assert not {r["text"] for r in train} & {r["text"] for r in held}
    pairs = _lines(data / "preferences.jsonl")
    assert pairs and all(p["chosen_score"] - p["rejected_score"] >= 0.3 for p in pairs)
    prompts = _lines(data / "prompts_eval.jsonl")
    assert all(2 <= len(p["query"].split()) <= 4 for p in prompts)
    assert -1 < metrics["gold_mean"] < 1 and 0 < metrics["share_positive"] < 1
    assert json.loads((project / "metrics" / "prepare.json").read_text()) == metrics
    assert (project / "plots" / "prepare.csv").read_text().startswith("gold_bin,count")
    assert not list(data.glob(".*tmp*"))  # no temp files left behind
    from rlhf_core.data import read_ratings
    from rlhf_core.rewards import GoldJudge

    ratings = read_ratings(data / "ratings.jsonl")  # the KTO data: validated rows from the training reviews
    assert len(ratings) == metrics["num_ratings"] and 0 < metrics["num_desirable"] < len(ratings)
    train_texts = {r["text"] for r in train}
    scores = GoldJudge()([r["prompt"] + r["completion"] for r in ratings])
    for row, score in zip(ratings, scores):
        assert row["prompt"] + row["completion"] in train_texts
        assert row["label"] == (score > 0) and abs(score) >= 0.05


def test_prepare_merges_incoming_pairs(project):
    from rlhf_core.feedback import canonical_bytes, validate_batch
    from tasks.run.stage_task import run_stage

    new = {"prompt": "The new film", "chosen": " was a delight.", "rejected": " was a bore."}
    source = project / "batch1.jsonl"
    source.write_text(json.dumps(new) + "\n")
    batch = validate_batch(source)  # what `python -m flows.intake` stores (without its DVC and git steps)
    (project / "incoming" / "pairs").mkdir()
    (project / "incoming" / "pairs" / f"{batch.sha256}.jsonl").write_bytes(canonical_bytes(batch.rows))
    (project / "incoming" / "manifest.jsonl").write_text(
        json.dumps({"sha256": batch.sha256, "kind": "pairs", "file": f"pairs/{batch.sha256}.jsonl"}) + "\n")
    metrics = run_stage("prepare", str(project))
    assert metrics["num_incoming_pairs"] == 1
    pairs = _lines(project / "data" / "preferences.jsonl")
    assert {k: pairs[-1][k] for k in new} == new


def test_malformed_input_stops_prepare_and_writes_nothing(project):
    from tasks.run.stage_task import run_stage

    run_stage("prepare", str(project))
    before = {n: (project / "data" / f"{n}.jsonl").read_bytes() for n in DATA_FILES}
    metrics_before = (project / "metrics" / "prepare.json").read_bytes()
    bad = project / "incoming" / "broken.jsonl"  # dropped by hand instead of ingested
    bad.write_text('{"prompt": "a", "chosen": " b", "rejected": " c"}\n{"prompt": "a", "chosen": \n')
    with pytest.raises(DataFormatError) as err:
        run_stage("prepare", str(project))
    assert str(err.value).startswith(f"{bad}: not ingested")
    assert {n: (project / "data" / f"{n}.jsonl").read_bytes() for n in DATA_FILES} == before
    assert (project / "metrics" / "prepare.json").read_bytes() == metrics_before


def test_malformed_source_file_names_file_and_line(project, tmp_path):
    from tasks.run.stage_task import run_stage

    source = tmp_path / "reviews.csv"
    source.write_text("text,label\ngood film,1\nbad, film,0\n")
    write_params(project, {"prepare.source": str(source)})
    with pytest.raises(DataFormatError, match=r"reviews.csv:3: expected 2 fields, got 3"):
        run_stage("prepare", str(project))
    assert not (project / "data").exists()


@pytest.mark.skipif(not RT_POLARITY.is_dir(), reason="../shared/data/rt-polarity not present")
def test_prepare_reads_rt_polarity(project):
    from tasks.run.stage_task import run_stage

    write_params(project, {"prepare.source": str(RT_POLARITY), "prepare.num_reviews": 400})
    metrics = run_stage("prepare", str(project))
    assert metrics["num_train"] + metrics["num_heldout"] == 400
    assert metrics["num_pairs"] > 0


def test_sft_then_failing_stage_leaves_outputs_untouched(project):
    from tasks.run.stage_task import run_stage

    run_stage("prepare", str(project))
    metrics = run_stage("sft", str(project))
    sft_dir = project / "models" / "sft"
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= {p.name for p in sft_dir.iterdir()}
    assert "_trainer" not in {p.name for p in sft_dir.iterdir()}
    assert metrics["steps"] > 0 and metrics["final_loss"] > 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(sft_dir).config.n_embd == 32
    # a stage that fails (here: no preference pairs) writes nothing and leaves earlier outputs alone
    snapshot = {p.name: p.read_bytes() for p in sft_dir.iterdir()}
    (project / "data" / "preferences.jsonl").write_text("")
    with pytest.raises(ValueError, match="no preference pairs"):
        run_stage("dpo", str(project))
    assert not (project / "models" / "dpo").exists()
    assert {p.name: p.read_bytes() for p in sft_dir.iterdir()} == snapshot


def test_atomic_dir_keeps_the_old_output_on_error(tmp_path):
    target = tmp_path / "models" / "ppo"
    target.mkdir(parents=True)
    (target / "weights").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "weights").write_text("half")
            raise RuntimeError("training diverged")
    assert (target / "weights").read_text() == "old"
    assert [p.name for p in target.parent.iterdir()] == ["ppo"]
    with atomic_dir(target) as tmp:
        (tmp / "weights").write_text("new")
    assert (target / "weights").read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["ppo"]


def test_input_hashes_match_dvc_file_hashes(tmp_path):
    import hashlib

    (tmp_path / "a.txt").write_text("hello")
    hashes = input_hashes(tmp_path, ["a.txt", "missing"])
    assert hashes == {"a.txt": hashlib.md5(b"hello").hexdigest(), "missing": "missing"}


DDPO_TINY = {"ddpo.num_epochs": 2, "ddpo.sample_num_steps": 2, "ddpo.sample_batch_size": 4,
             "ddpo.sample_num_batches_per_epoch": 1, "ddpo.train_batch_size": 2, "ddpo.enabled": True}


def test_ddpo_stage_trains_from_params_and_logs_through_its_stage_run(project):
    pytest.importorskip("diffusers")
    import csv

    import mlflow

    from tasks.run.stage_task import run_stage
    from tasks.store.mlflow_runs import mlflow_setup

    write_params(project, {**DDPO_TINY, "ddpo.enabled": False})  # off (the default): a placeholder, in a blink
    assert run_stage("ddpo", str(project)) == {"enabled": False}
    assert [p.name for p in (project / "models" / "ddpo").iterdir()] == ["DISABLED"]
    write_params(project, DDPO_TINY)
    metrics = run_stage("ddpo", str(project))
    assert metrics["epochs"] == 2 and metrics["reward_gain"] == metrics["reward_last"] - metrics["reward_first"]
    assert json.loads((project / "metrics" / "ddpo.json").read_text()) == metrics
    rows = list(csv.DictReader((project / "plots" / "ddpo.csv").open()))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    assert float(rows[0]["reward_mean"]) == pytest.approx(metrics["reward_first"])
    assert (project / "models" / "ddpo" / "model_index.json").is_file()  # the whole pipeline (use_lora: false)
    client = mlflow.MlflowClient()
    mlflow_setup(project)
    (run,) = client.search_runs([mlflow_setup(project)], "tags.`rlhf.stage` = 'ddpo'")
    assert run.info.status == "FINISHED"
    assert run.data.params["ddpo.train_learning_rate"] == "0.003" and run.data.params["ddpo.num_epochs"] == "2"
    history = client.get_metric_history(run.info.run_id, "reward_mean")  # the trainer's own step metrics
    assert [round(m.value, 6) for m in sorted(history, key=lambda m: m.step)] == \
        [round(float(r["reward_mean"]), 6) for r in rows]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert len(artifacts) == 2


def test_policy_stages_train_or_leave_placeholders_and_evaluate_scores_the_enabled(project):
    """grpo/rloo/kto train from the SFT model (TRL 1.16 configs from params.yaml); a disabled policy stage writes
    placeholders in a blink, evaluate skips it and the registry's candidates are the enabled policies."""
    import csv

    from tasks.store.placeholders import PLACEHOLDER, is_placeholder
    from tasks.stages.common.scoring import policy_results
    from tasks.run.stage_task import run_stage

    write_params(project, {"ppo.enabled": False, "grpo.reward": "gold"})
    for stage in ("prepare", "sft", "reward_model"):
        run_stage(stage, str(project))
    assert run_stage("ppo", str(project)) == {"enabled": False}
    assert is_placeholder(project / "models" / "ppo")
    assert [p.name for p in (project / "models" / "ppo").iterdir()] == [PLACEHOLDER]
    assert json.loads((project / "metrics" / "ppo.json").read_text()) == {"enabled": False}
    assert (project / "plots" / "ppo.csv").read_text() == "step,reward_mean,kl,kl_coef\n"
    for stage in ("grpo", "rloo", "kto"):
        metrics = run_stage(stage, str(project))
        out = project / "models" / stage
        assert metrics["enabled"] is True and metrics["steps"] >= 1, stage
        assert not is_placeholder(out) and (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
        assert json.loads((project / "metrics" / f"{stage}.json").read_text()) == metrics
        rows = list(csv.DictReader((project / "plots" / f"{stage}.csv").open()))
        assert len(rows) == metrics["steps"], stage  # one row per optimizer step (logging_steps 1)
        assert stage == "kto" or all(r["reward"] for r in rows), stage  # a re-used batch carries its reward
    assert json.loads((project / "metrics" / "grpo.json").read_text())["completions_per_step"] == 8

    write_params(project, {"ppo.enabled": False, "dpo.enabled": False, "grpo.reward": "gold"})
    run_stage("dpo", str(project))
    results = policy_results(run_stage("evaluate", str(project)))
    assert list(results) == ["sft", "grpo", "rloo", "kto"]  # the disabled ppo and dpo are skipped
    from tasks.spec.params import RegistryParams
    from tasks.registry.gate import pick_challenger

    rule = RegistryParams(model_name="m", candidates=["ppo", "dpo", "grpo", "rloo", "kto"], metric="gold_reward",
                          min_improvement=0.0, max_kl=1e9, max_kl_increase=1e9, significance=0.05,
                          bootstrap_samples=100, seed=0)
    best = max(("grpo", "rloo", "kto"), key=lambda n: results[n]["gold_reward"])
    assert pick_challenger(results, rule) == best


def test_dpo_stage_trains_with_a_non_default_loss_type_that_evaluate_then_scores(project):
    from tasks.run.stage_task import run_stage

    off = {f"{stage}.enabled": False for stage in ("ppo", "grpo", "rloo", "kto")}
    write_params(project, {**off, "dpo.loss_type": "apo_zero", "dpo.sample_every": 0})
    for stage in ("prepare", "sft", "reward_model", "ppo", "grpo", "rloo", "kto"):
        run_stage(stage, str(project))
    metrics = run_stage("dpo", str(project))
    # the trainer used APO-zero: from policy == reference its loss starts at 1 - sigmoid(0) + sigmoid(0) = 1 (the DPO
    # sigmoid loss at log 2 = 0.69); the tiny run's 1-2 steps move it by a few hundredths (0.97 measured)
    assert metrics["steps"] >= 1 and abs(metrics["train_loss"] - 1.0) < 0.1
    assert "| loss_type | apo_zero |" in (project / "models" / "dpo" / "README.md").read_text()
    results = run_stage("evaluate", str(project))
    assert list(results) == ["sft", "dpo", "scored"] and set(results["dpo"]) == set(results["sft"])


def test_a_trainer_stage_keeps_its_resume_state_until_its_outputs_are_written(project, monkeypatch):
    """Issue 31: the training tail (tasks/stages/common/resume.py train_and_save) leaves the resumable state to the
    StageResult's ``finish``: a failure while the wrapper writes metrics/plots keeps it for the next run (kto, grpo
    and rloo removed it before their metrics were written)."""
    from tasks.run import stage_task

    run_stage, real_write = stage_task.run_stage, stage_task.write_result
    run_stage("prepare", str(project))
    run_stage("sft", str(project))

    def failing_write(*args, **kwargs):
        raise OSError("disk full while writing metrics")

    monkeypatch.setattr(stage_task, "write_result", failing_write)
    with pytest.raises(OSError, match="disk full"):
        run_stage("kto", str(project))
    assert list((project / ".checkpoints").glob("kto-*")), "the resume state went before the outputs were written"
    monkeypatch.setattr(stage_task, "write_result", real_write)
    run_stage("kto", str(project))
    assert not list((project / ".checkpoints").glob("kto-*"))
    assert json.loads((project / "metrics" / "kto.json").read_text())["enabled"] is True
