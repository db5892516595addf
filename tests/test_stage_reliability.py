"""Issue 6 wired into the pipeline stages: stop on SIGTERM and resume exactly, train through a tracking outage,
keep secrets out of the tracked params. Tasks through ``.fn()`` on a temporary project with tiny parameters."""

from __future__ import annotations

import json
import os
import signal
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from _pipeline_project import make_project, mlflow_client, write_params
from safetensors.torch import load_file

from rlhf_core.checkpointing import Preempted
from tasks.process.outcome import EXIT_STOPPED, classify


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """A project where prepare, sft and reward_model have run (shared: they are inputs only)."""
    from tasks.run.stage_task import run_stage

    saved = {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "RLHF_PARENT_RUN_ID")}
    root = make_project(tmp_path_factory.mktemp("rel") / "proj", git_dvc=False)
    run_stage("prepare", str(root))
    run_stage("sft", str(root))
    run_stage("reward_model", str(root))
    yield root
    os.environ.update({k: v for k, v in saved.items() if v is not None})


@pytest.fixture
def project(upstream, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    return upstream


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _assert_same_weights(a: Path, b_weights: dict[str, torch.Tensor]) -> None:
    a_weights = _weights(a)
    assert a_weights.keys() == b_weights.keys()
    for key in a_weights:
        assert torch.equal(a_weights[key], b_weights[key]), key


def _sigterm_on_call(monkeypatch, cls, method: str, when) -> list[int]:
    """Wrap ``cls.method``: once ``when(call_number, args)`` holds, the process sends itself SIGTERM."""
    original = getattr(cls, method)
    calls: list[int] = []

    def wrapped(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append(1)
        if when(len(calls), args):
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(cls, method, wrapped)
    return calls


def _checkpoints(root: Path, stage: str) -> list[Path]:
    """The stage's checkpoint directories (not the sample-window points kept beside them as ``<dir>.samples.json``)."""
    base = root / ".checkpoints"
    return sorted(p for p in base.glob(f"{stage}-*") if p.is_dir()) if base.is_dir() else []


def test_ppo_sigterm_saves_and_resume_equals_a_straight_run(project, monkeypatch):
    from rlhf_core import PPOTrainer
    from tasks.run.stage_task import run_stage

    write_params(project, {"ppo.total_steps": 4})
    straight = run_stage("ppo", str(project))
    straight_weights = _weights(project / "models" / "ppo")
    straight_curve = (project / "plots" / "ppo.csv").read_text()
    assert not _checkpoints(project, "ppo")  # deleted once the outputs are written

    with monkeypatch.context() as patch:
        _sigterm_on_call(patch, PPOTrainer, "step", lambda n, args: n == 2)
        with pytest.raises(Preempted) as stopped:
            run_stage("ppo", str(project))
    assert classify(stopped.value).exit_status == EXIT_STOPPED == 75  # what the CLIs exit with
    assert stopped.value.step == 2 and stopped.value.signal_name == "SIGTERM"
    (state,) = _checkpoints(project, "ppo")
    assert json.loads((state / "trainer_state.json").read_text())["extra"]["next_step"] == 2
    _assert_same_weights(project / "models" / "ppo", straight_weights)  # the earlier output is untouched
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))

    resumed = run_stage("ppo", str(project))  # the re-run continues at step 2, not from scratch
    assert resumed == straight
    _assert_same_weights(project / "models" / "ppo", straight_weights)
    assert (project / "plots" / "ppo.csv").read_text() == straight_curve
    assert not _checkpoints(project, "ppo")


def test_sft_sigterm_saves_a_checkpoint_and_resume_equals_a_straight_run(project, monkeypatch):
    from rlhf_core.trainers.base import GracefulStopCallback
    from tasks.run.stage_task import run_stage

    straight = run_stage("sft", str(project))
    straight_weights = _weights(project / "models" / "sft")
    straight_card = (project / "models" / "sft" / "README.md").read_text()
    assert straight["steps"] > 3
    assert not _checkpoints(project, "sft")

    with monkeypatch.context() as patch:
        _sigterm_on_call(patch, GracefulStopCallback, "on_step_end", lambda n, args: args[1].global_step == 2)
        with pytest.raises(Preempted) as stopped:
            run_stage("sft", str(project))
    assert classify(stopped.value).exit_status == EXIT_STOPPED and stopped.value.step == 3
    (state,) = _checkpoints(project, "sft")
    assert (state / "checkpoint-3" / "trainer_state.json").is_file()

    assert json.loads((state / "checkpoint-3" / "rlhf_loss_sum.json").read_text())["global_step"] == 3

    resumed = run_stage("sft", str(project))
    assert resumed == straight  # train_loss too: the mean over all steps, not over the resumed ones only
    _assert_same_weights(project / "models" / "sft", straight_weights)
    assert (project / "models" / "sft" / "README.md").read_text() == straight_card  # so the model's hash is the same
    assert not _checkpoints(project, "sft")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends: connections are refused


def test_stages_complete_against_a_refusing_tracking_server_and_upload_later(project, monkeypatch, tmp_path):
    import mlflow

    from flows.tracking import main as tracking_cli
    from tasks.run.stage_task import run_stage

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    spool_dir = project / "tracking-spool"
    before = set(spool_dir.glob("*.jsonl")) if spool_dir.is_dir() else set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = run_stage("prepare", str(project))
        trained = run_stage("sft", str(project))
    assert trained["steps"] > 0 and (project / "models" / "sft" / "model.safetensors").is_file()
    outage = [w for w in caught if issubclass(w.category, RuntimeWarning) and "unreachable" in str(w.message)]
    assert len(outage) == 2  # one per stage
    assert "make tracking-upload" in str(outage[0].message)

    spools = sorted(set(spool_dir.glob("*.jsonl")) - before)
    assert [p.name.split("-")[0] for p in spools] == ["prepare", "sft"]
    records = {p.name.split("-")[0]: [json.loads(line) for line in p.read_text().splitlines()] for p in spools}
    sft_metrics = [r for r in records["sft"] if r["kind"] == "metrics"]
    assert any("train_loss" in r["data"] and r["step"] == trained["steps"] for r in sft_metrics)  # the Trainer's
    assert any(r["data"].get("final/steps") == trained["steps"] for r in sft_metrics)
    assert any(r["data"].get("final/num_train") == prepared["num_train"] for r in records["prepare"] if r["kind"] == "metrics")
    params = {k: v for r in records["sft"] if r["kind"] == "params" for k, v in r["data"].items()}
    assert params["sft.hidden_size"] == "32" and params["tag.rlhf.stage"] == "sft"
    assert records["sft"][-1]["kind"] == "finish"

    store = f"sqlite:///{tmp_path / 'server.db'}"
    assert tracking_cli(["upload", str(spool_dir), "--tracking-uri", store]) == 0
    client = mlflow.MlflowClient(tracking_uri=store)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])}
    assert {"prepare", "sft"} <= set(runs)
    sft_run = runs["sft"]
    assert sft_run.data.metrics["final/steps"] == trained["steps"] and sft_run.info.status == "FINISHED"
    assert client.get_metric_history(sft_run.info.run_id, "train_loss")[0].step == trained["steps"]
    assert sft_run.data.params["sft.hidden_size"] == "32"
    assert runs["prepare"].data.metrics["final/num_train"] == prepared["num_train"]
    assert not list(spool_dir.glob("*.jsonl"))  # uploaded spools are renamed, never sent twice


@dataclass(frozen=True)
class _SectionWithSecrets:
    learning_rate: float = 0.1
    hub_token: str = "hf_abcdef"
    db_password: str = "hunter2"
    api_key: str = "sk-123"


def test_secret_looking_params_are_never_logged(project, monkeypatch):
    from tasks.store.stage_run import stage_run

    with stage_run("guarded", project, _SectionWithSecrets(), []) as run:
        run_id = run.run_id
    logged = mlflow_client(project).get_run(run_id).data.params
    assert logged == {"guarded.learning_rate": "0.1"}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with stage_run("guarded", project, _SectionWithSecrets(), []) as run:
            spool = run.spool_path
    text = spool.read_text()
    assert "guarded.learning_rate" in text
    assert not any(s in text for s in ("hf_abcdef", "hunter2", "sk-123", "hub_token", "password", "api_key"))
    spool.unlink()


@pytest.mark.slow
def test_pipeline_cli_sigterm_exits_75_records_nothing_and_resumes(tmp_path, monkeypatch):
    """The flow's CLI: SIGTERM in ppo -> exit 75, earlier stages recorded, ppo not, no registry; re-run resumes."""
    import yaml
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import main
    from rlhf_core import PPOTrainer

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    root = make_project(tmp_path / "proj", overrides={"ppo.total_steps": 3})
    with prefect_test_harness(server_startup_timeout=120):
        with monkeypatch.context() as patch:
            calls = _sigterm_on_call(patch, PPOTrainer, "step", lambda n, args: n == 1)
            assert main(["--root", str(root)]) == EXIT_STOPPED
        assert len(calls) == 1  # stopped at the first step boundary after the signal
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        assert set(lock) == {"prepare", "sft", "label", "reward_model"}  # label: placeholders under sentiment
        assert not (root / "models" / "ppo").exists() and len(_checkpoints(root, "ppo")) == 1
        client = mlflow_client(root)
        assert not client.search_registered_models()
        runs = client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])
        assert {r.info.status for r in runs if r.data.tags.get("rlhf.stage") == "ppo"} == {"KILLED"}
        assert {r.info.status for r in runs if r.data.tags.get("rlhf.kind") == "pipeline"} == {"KILLED"}

        with monkeypatch.context() as patch:
            resumed = _sigterm_on_call(patch, PPOTrainer, "step", lambda n, args: False)
            assert main(["--root", str(root)]) == 0
        assert len(resumed) == 2  # steps 1 and 2 only: resumed, not restarted
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert {"ppo", "dpo", "evaluate"} <= set(lock)
    assert not _checkpoints(root, "ppo")
    assert client.search_registered_models()


@pytest.mark.slow
def test_dvc_repro_sigterm_then_repro_resumes(tmp_path, monkeypatch):
    """``dvc repro`` with SIGTERM to the stage process during ppo: it exits 75 and is not recorded; the next
    ``dvc repro`` resumes ppo from its saved state (not from step 0) and then records it."""
    import subprocess
    import sys

    import psutil
    import yaml
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from _pipeline_project import ROOT

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    root = make_project(tmp_path / "proj", overrides={"ppo.total_steps": 30})
    dvc = str(ROOT / ".venv" / "bin" / "dvc")
    with prefect_test_harness(server_startup_timeout=120):
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
               "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen([dvc, "repro", "ppo"], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        output = []
        for line in proc.stdout:
            output.append(line)
            # after step 5's update (the step log: "ppo step 5: held-out samples" is the window after step 4, and a
            # stop there saves next_step 5): stop the stage's Python process
            if "ppo step 5: reward" in line:
                # Python itself only: dvc runs the command through $SHELL -c, and where that is dash (SHELL
                # unset, as in CI) the shell stays as a parent, dies of a SIGTERM and dvc reports -15.
                for child in psutil.Process(proc.pid).children(recursive=True):
                    cmd = child.cmdline()
                    if cmd[1:3] == ["-m", "flows.stage"] and "python" in Path(cmd[0]).name:
                        child.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        text = "".join(output)
        assert proc.returncode != 0, text[-4000:]
        assert "exited with 75" in text, text[-4000:]  # flows.stage: EXIT_STOPPED, not a crash
        lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
        assert "ppo" not in lock and {"prepare", "sft", "reward_model"} <= set(lock)
        (state,) = _checkpoints(root, "ppo")
        next_step = json.loads((state / "trainer_state.json").read_text())["extra"]["next_step"]
        assert 6 <= next_step < 30
        again = subprocess.run([dvc, "repro", "ppo"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"ppo: resuming at step {next_step}" in again.stdout + again.stderr
    assert "ppo" in yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert not _checkpoints(root, "ppo")
