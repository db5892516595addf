"""Issue 12 (pipeline side): outputs are a function of inputs, the checkout lock, the mid-run params edit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.tracking import NullTracker
from tasks.process import locking
from tasks.store.stage_run import StageRun

ROOT = Path(__file__).resolve().parents[1]


def test_model_card_in_the_dvc_tracked_output_holds_no_run_id(tmp_path, monkeypatch):
    """Issue 12.6: a retrained stage with the same weights must keep its hash; the card embedded the MLflow run id."""
    logged = []
    monkeypatch.setattr(StageRun, "_direct", lambda self, what, call: logged.append(what))
    texts = []
    for run_id in ("run0000aaaa", "run1111bbbb"):
        out = tmp_path / run_id
        run = StageRun("sft", tmp_path, run_id, "1", input_hashes={"data/sft_train.jsonl": "abc"},
                       tracker=NullTracker())
        run.write_model_card(out, "SFTTrainer", "tiny", {"lr": 0.1}, {"loss": 1.0})
        texts.append((out / "README.md").read_text())
        assert run_id not in texts[-1] and "git commit" not in texts[-1]
    assert texts[0] == texts[1] and "data/sft_train.jsonl" in texts[0]
    assert logged == ["model card", "model card"]  # the MLflow copy (with provenance) is still logged


# ---------------------------------------------------------------------------------------------- checkout lock (12.2)

HOLDER = """
import sys, time
from tasks.process.locking import checkout_lock
with checkout_lock(sys.argv[1], "python -m flows.pipeline (test holder)"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != locking.TOKEN_ENV}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture
def holder(tmp_path):
    """Another process holding the checkout lock of ``tmp_path`` (killed at the end)."""
    (tmp_path / ".dvc").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "120"], env=_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_run_refuses_naming_the_holder(tmp_path, holder):
    assert locking.lock_path(tmp_path) == tmp_path / ".dvc" / "tmp" / "rlhf-run.lock"
    with pytest.raises(locking.CheckoutLocked, match=rf"pid {holder.pid} on .*test holder.*since"):
        with locking.checkout_lock(tmp_path, wait_s=0):
            pass


def test_a_second_run_waits_a_bounded_time_then_refuses(tmp_path, holder, monkeypatch):
    monkeypatch.setenv(locking.WAIT_ENV, "1.0")
    started = time.monotonic()
    with pytest.raises(locking.CheckoutLocked), locking.checkout_lock(tmp_path):
        pass
    assert 1.0 <= time.monotonic() - started < 5.0


def test_a_waiting_run_proceeds_when_the_holder_finishes(tmp_path):
    (tmp_path / ".dvc").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path), "1.5"], env=_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    with locking.checkout_lock(tmp_path, "second", wait_s=60) as mine:
        assert mine["pid"] == os.getpid() and mine["command"] == "second"
    assert proc.wait(timeout=30) == 0


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, holder, caplog):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert json.loads(locking.lock_path(tmp_path).read_text())["pid"] == holder.pid  # stale contents remain
    with caplog.at_level("WARNING", logger="rlhf.lock"), locking.checkout_lock(tmp_path, wait_s=0) as mine:
        assert mine["pid"] == os.getpid()
    assert f"pid {holder.pid}" in caplog.text and "no longer running" in caplog.text


def test_the_lock_is_reentrant_in_process_and_for_the_holders_children(tmp_path):
    child = ("import sys; from tasks.process.locking import checkout_lock\n"
             "with checkout_lock(sys.argv[1], 'child', wait_s=0) as h: print(h['command'])")
    with locking.checkout_lock(tmp_path, "parent", wait_s=0):
        with locking.checkout_lock(tmp_path, "nested", wait_s=0) as nested:  # the pipeline flow under retrain
            assert nested["command"] == "parent"
        # a process started by the holder (dvc repro -> python -m flows.stage) inherits the token
        out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], env={**_env(), locking.TOKEN_ENV:
                             os.environ[locking.TOKEN_ENV]}, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "parent", out.stderr
        # an unrelated process (no token) is refused
        out = subprocess.run([sys.executable, "-c", child, str(tmp_path)], env=_env(), capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and "CheckoutLocked" in out.stderr
    assert locking.TOKEN_ENV not in os.environ and locking.read_holder(locking.lock_path(tmp_path)) == {}


@pytest.mark.parametrize("cli", [["flows.pipeline"], ["flows.stage", "prepare"], ["flows.retrain", "--no-push"]])
def test_the_clis_refuse_a_second_run_with_exit_73(tmp_path, holder, cli):
    """Two pipelines in one checkout: the second exits 73 naming the first, before Prefect or any stage starts."""
    out = subprocess.run([sys.executable, "-m", *cli, "--root", str(tmp_path)], env=_env(), capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == locking.EXIT_LOCKED, out.stderr[-2000:]
    assert f"pid {holder.pid}" in out.stderr and "test holder" in out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------- mid-run edits (12.1)

# A stage that reads params.yaml:train.seed when it starts, "trains", and meanwhile someone edits params.yaml.
EDITING_STAGE = """
import sys, yaml
from pathlib import Path
def body():
    seed = yaml.safe_load(Path("params.yaml").read_text())["train"]["seed"]
    Path("params.yaml").write_text("train:\\n  seed: 4\\n")  # the edit, mid-run
    Path("model.txt").write_text(f"trained with seed {seed}\\n")
if sys.argv[1] == "guarded":
    from tasks.store.dvc_ops import inputs_unchanged
    with inputs_unchanged(".", "train"):
        body()
else:
    body()
"""


def _dvc_project(root: Path, mode: str) -> Path:
    root.mkdir()
    (root / "stage.py").write_text(EDITING_STAGE)
    (root / "params.yaml").write_text("train:\n  seed: 3\n")
    (root / "dvc.yaml").write_text(f"stages:\n  train:\n    cmd: {sys.executable} stage.py {mode}\n"
                                   "    deps: [stage.py]\n    params: [train.seed]\n    outs: [model.txt]\n")
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=root, check=True, env=_env(), capture_output=True)
    return root


def _repro(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=_env(), capture_output=True,
                          text=True, timeout=300)


def test_dvc_alone_records_params_edited_while_the_stage_ran(tmp_path):
    """What DVC does by itself (DVC 3.67): it hashes params after the command, so dvc.lock claims seed 4 for a model
    trained with seed 3 and ``dvc status`` is clean. This is why flows.stage guards its own inputs."""
    root = _dvc_project(tmp_path / "plain", "plain")
    assert _repro(root).returncode == 0
    assert (root / "model.txt").read_text() == "trained with seed 3\n"
    import yaml

    recorded = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["train"]["params"]["params.yaml"]
    assert recorded == {"train.seed": 4}
    assert subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=_env(), capture_output=True,
                          text=True).stdout.strip().endswith("up to date.")


def test_a_guarded_stage_edited_mid_run_is_not_recorded_and_stays_stale(tmp_path):
    root = _dvc_project(tmp_path / "guarded", "guarded")
    out = _repro(root)
    assert out.returncode != 0
    assert "params.yaml:train.seed (3 -> 4) changed while it ran" in out.stdout + out.stderr
    lock = root / "dvc.lock"
    assert not lock.exists() or "train" not in lock.read_text()
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=_env(), capture_output=True,
                            text=True, timeout=300).stdout
    assert "train" in status and "changed" in status  # stale: the next repro trains on seed 4


def test_inputs_unchanged_names_changed_params_and_deps(tmp_path):
    from tasks.store.dvc_ops import StageInputsChanged, changed_inputs, inputs_unchanged, stage_snapshot

    (tmp_path / "params.yaml").write_text("a:\n  lr: 0.1\n  seed: 1\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.txt").write_text("x")
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: true\n    deps: [data]\n    params: [a.lr]\n")
    with inputs_unchanged(tmp_path, "s"):  # an unrelated key may change
        (tmp_path / "params.yaml").write_text("a:\n  lr: 0.1\n  seed: 2\n")
    with pytest.raises(StageInputsChanged, match=r"stage s: data, params\.yaml:a\.lr \(0\.1 -> 0\.2\) changed"):
        with inputs_unchanged(tmp_path, "s"):
            (tmp_path / "params.yaml").write_text("a:\n  lr: 0.2\n  seed: 2\n")
            (tmp_path / "data" / "x.txt").write_text("y")
    before = stage_snapshot(tmp_path, "s")
    (tmp_path / "data" / "new.txt").write_text("z")  # a new file in a dependency directory
    assert changed_inputs(before, stage_snapshot(tmp_path, "s")) == ["data"]


@pytest.mark.parametrize("stage", ["ppo", "dpo", "kto"])
def test_evaluate_settings_a_window_stage_reads_are_guarded_and_key_its_resume_state(tmp_path, stage):
    """Issue 24: ppo, dpo and kto score their sample windows with evaluate.max_new_tokens and evaluate.seed. Changing
    one while the stage runs stops it being recorded; changed between runs, its resume state is not reused."""
    from _pipeline_project import make_project, write_params

    from tasks.store.dvc_ops import StageInputsChanged, inputs_unchanged
    from tasks.spec.params import cross_section_values
    from tasks.spec.paths import stage_checkpoint_dir
    from tasks.stages.common.resume import resume_key
    from tasks.stages import BY_NAME, load_params

    root = make_project(tmp_path / "proj", git_dvc=False)
    with pytest.raises(StageInputsChanged, match=rf"stage {stage}: params\.yaml:evaluate\.seed \(0 -> 1\) changed"):
        with inputs_unchanged(root, stage):
            write_params(root, {"evaluate.seed": 1})

    def state_dir() -> Path:
        params = load_params(root / "params.yaml")
        section = params.section(stage)
        run = StageRun(stage, root, "", "", input_hashes={"data": "abc"},
                       reads=cross_section_values(params, BY_NAME[stage].reads), tracker=NullTracker())
        assert run.reads == {"evaluate.max_new_tokens": params.evaluate.max_new_tokens, "evaluate.seed": 1,
                             "task.name": "sentiment"}  # the task picks the windows' gold judge
        return stage_checkpoint_dir(root, stage, resume_key(run, section))

    first = state_dir()
    write_params(root, {"evaluate.seed": 1, "evaluate.max_new_tokens": 6})
    assert state_dir() != first  # another window scorer: the old windows are not resumed
    write_params(root, {"evaluate.seed": 1, "evaluate.num_prompts": 4})  # a key the stage does not read
    assert state_dir() == first


def test_a_stage_without_cross_section_reads_keeps_its_resume_key(tmp_path):
    from tasks.spec.params import as_dict
    from tasks.stages.common.resume import resume_key
    from tasks.stages import load_params

    section = load_params(ROOT / "params.yaml").sft
    run = StageRun("sft", tmp_path, "", "", input_hashes={"data": "abc"}, tracker=NullTracker())
    assert resume_key(run, section) == {"params": as_dict(section), "inputs": {"data": "abc"}}  # as before issue 24


# ---------------------------------------------------------------------------------------------- credentials (12.6)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redact_removes_url_credentials_only():
    from rlhf_core.tracking import redact

    assert redact("http://alice:s3cret@mlflow.example:5000/x") == "http://***@mlflow.example:5000/x"
    assert redact("see https://tok@h/ and sqlite:///a/b.db") == "see https://***@h/ and sqlite:///a/b.db"
    assert redact("mail alice@example.com") == "mail alice@example.com"


def test_tracking_credentials_never_reach_spool_warnings_or_logs(tmp_path):
    import logging
    import warnings

    from flows.process import configure_process

    configure_process()  # what every entry point does first: installs the log redaction
    from rlhf_core.tracking import MLflowTracker, SpoolingTracker
    from tasks.process.logs import get_logger

    uri = f"http://alice:s3cret@127.0.0.1:{_closed_port()}"
    factory = lambda project_name, run_name: MLflowTracker(project_name, run_name)  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = SpoolingTracker(factory, tmp_path, "proj", "run", tracking_uri=uri)
        tracker.log_params({"lr": 0.1})
        tracker.finish()
    assert tracker.offline and tracker.spool_path.exists()
    spooled = tracker.spool_path.read_text()
    assert "s3cret" not in spooled and "alice" not in spooled and "http://***@127.0.0.1" in spooled
    assert caught and not any("s3cret" in str(w.message) for w in caught)
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("rlhf_pipeline")
    logger.addHandler(handler)
    try:
        get_logger().warning("tracking server %s unreachable", uri)
    finally:
        logger.removeHandler(handler)
    assert seen == ["tracking server http://***@127.0.0.1:%s unreachable" % uri.rsplit(":", 1)[1]]
    for name in ("prefect.flow_runs", "prefect.task_runs", "rlhf_core"):  # the Prefect run log and stderr
        record = logging.LogRecord(name, logging.WARNING, __file__, 1, "at %s", (uri,), None)
        assert all(f.filter(record) for f in logging.getLogger(name).filters) and "s3cret" not in record.getMessage()


DEPLOYED_FLOW = """
import json, logging, sys
from rlhf_core.tracking import RedactingFilter
module = __import__("flows." + sys.argv[1], fromlist=["x"])
try:
    getattr(module, sys.argv[1]).fn(root=sys.argv[2])  # as Prefect's worker does: import, call (no ``main``)
except Exception:
    pass  # an empty folder is no project: the flow fails after its first line
print(json.dumps({name: any(isinstance(f, RedactingFilter) for f in logging.getLogger(name).filters)
                  for name in ("rlhf_core", "rlhf_pipeline", "prefect.flow_runs")}))
"""


@pytest.mark.parametrize("flow", ["pipeline", "retrain"])
def test_a_deployed_flow_redacts_its_logs_though_main_never_ran(tmp_path, flow):
    """prefect.yaml's entry points (``flows/pipeline.py:pipeline``, ``flows/retrain.py:retrain``) run in a process
    that imports the module: the flow itself installs the log redaction (``flows.process.configure_logging``)."""
    out = subprocess.run([sys.executable, "-c", DEPLOYED_FLOW, flow, str(tmp_path)], env=_env(), capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"rlhf_core": True, "rlhf_pipeline": True,
                                                                "prefect.flow_runs": True}


def test_mlflow_client_retries_are_bounded_for_pipeline_processes(monkeypatch):
    """A tracking server killed mid-PPO stalled training 4 min in client retries (7 retries, factor 2)."""
    from mlflow.environment_variables import (
        MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR,
        MLFLOW_HTTP_REQUEST_MAX_RETRIES,
        MLFLOW_HTTP_REQUEST_TIMEOUT,
    )

    from flows.process import configure_process

    variables = (MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR, MLFLOW_HTTP_REQUEST_MAX_RETRIES, MLFLOW_HTTP_REQUEST_TIMEOUT)
    environ: dict[str, str] = {}
    configure_process(environ)  # what every entry point does first, here into a copy
    for variable in variables:
        monkeypatch.setenv(variable.name, environ[variable.name])

    retries, factor, timeout = (MLFLOW_HTTP_REQUEST_MAX_RETRIES.get(), MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR.get(),
                                MLFLOW_HTTP_REQUEST_TIMEOUT.get())
    worst = (retries + 1) * timeout + sum(factor * 2 ** i for i in range(retries))  # urllib3 backoff
    assert worst <= 60
