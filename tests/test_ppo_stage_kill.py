"""Issue 12.5: the ppo stage killed with SIGKILL resumes from its last periodic checkpoint (``ppo.save_steps``)
and ends with the same model and curve as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _pipeline_project import write_params

from tests.test_stage_reliability import _assert_same_weights, _checkpoints, _weights, project, upstream  # noqa: F401

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _saved_step(root: Path) -> int | None:
    for state in _checkpoints(root, "ppo"):
        path = state / "trainer_state.json"
        if path.is_file():
            return json.loads(path.read_text())["extra"]["next_step"]
    return None


def test_ppo_killed_by_sigkill_resumes_from_its_periodic_checkpoint(project):
    from tasks.run.stage_task import run_stage

    write_params(project, {"ppo.total_steps": 8, "ppo.save_steps": 2})
    straight = run_stage("ppo", str(project))
    straight_weights = _weights(project / "models" / "ppo")
    straight_curve = (project / "plots" / "ppo.csv").read_text()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = f"from tasks.run.stage_task import run_stage; run_stage('ppo', {str(project)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=project, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while (_saved_step(project) or 0) < 4 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no handler runs: only the periodic checkpoint is left
    proc.wait(timeout=30)
    saved = _saved_step(project)
    assert proc.returncode == -signal.SIGKILL and saved is not None and 2 <= saved < 8

    resumed = run_stage("ppo", str(project))
    assert resumed == straight
    _assert_same_weights(project / "models" / "ppo", straight_weights)
    assert (project / "plots" / "ppo.csv").read_text() == straight_curve
    assert not _checkpoints(project, "ppo")
