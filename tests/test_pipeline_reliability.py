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
from tasks import locking
from tasks.tracking import StageRun

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
from tasks.locking import checkout_lock
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
    child = ("import sys; from tasks.locking import checkout_lock\n"
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
