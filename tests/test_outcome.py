"""Issue 31: one taxonomy of the pipeline's exceptions (tasks/process/outcome.py), read by every entry point."""

from __future__ import annotations

import pytest

from rlhf_core.checkpointing import Preempted
from rlhf_core.data import DataFormatError
from tasks.process.distributed import LauncherError
from tasks.process.locking import CheckoutLocked
from tasks.process.outcome import EXIT_STOPPED, EXIT_USAGE, ConfigError, StageInputsChanged, classify
from tasks.spec.param_rules import ParamsError


@pytest.mark.parametrize(("error", "kind", "exit_status", "mlflow_status", "retry"), [
    (ConfigError("params.yaml: x"), "config", EXIT_USAGE, "FAILED", False),
    (LauncherError("one process"), "launcher", EXIT_USAGE, "FAILED", False),
    (CheckoutLocked.__new__(CheckoutLocked), "locked", 73, "FAILED", True),
    (Preempted("stop"), "stopped", EXIT_STOPPED, "KILLED", False),
    (StageInputsChanged("ppo", ["params.yaml:ppo.seed (0 -> 1)"]), "inputs_changed", EXIT_STOPPED, "KILLED", False),
    (DataFormatError("data/x.jsonl", 3, "bad"), "bad_input", None, "FAILED", False),
    (ParamsError("params.yaml: ppo.seed"), "bad_input", None, "FAILED", False),
    (FileNotFoundError("data/x.jsonl"), "bad_input", None, "FAILED", False),
    (ValueError("bad"), "bad_input", None, "FAILED", False),
    (OSError("disk"), "failed", None, "FAILED", True),
    (KeyboardInterrupt(), "failed", None, "FAILED", True),
])
def test_each_exception_has_one_outcome(error, kind, exit_status, mlflow_status, retry):
    outcome = classify(error)
    assert (outcome.kind, outcome.exit_status, outcome.mlflow_status, outcome.retry) == (
        kind, exit_status, mlflow_status, retry)


def test_a_stop_and_changed_inputs_name_the_stage_in_the_parent_run():
    assert classify(Preempted("x")).tag == "preempted" and classify(Preempted("x")).flow_run_name is None
    changed = classify(StageInputsChanged("ppo", ["a"]))
    assert changed.tag == "inputs_changed" and changed.flow_run_name.format(stage="ppo") == (
        "pipeline: inputs changed during ppo")
    assert classify(OSError()).flow_run_name.format(stage="sft") == "pipeline: FAILED at sft"


def test_a_stop_between_stages_says_so_without_a_step_or_a_checkpoint(tmp_path, monkeypatch):
    """A stop request seen before a stage starts: the message said "at step None; state saved in stop requested
    before stage prepare" (the stage name passed as a checkpoint path)."""
    from tasks.run import supervisor

    run = supervisor.PipelineRun.__new__(supervisor.PipelineRun)
    monkeypatch.setattr(supervisor, "stop_requested", lambda: True)
    with pytest.raises(Preempted) as stopped:
        run._due("prepare", force=False)
    assert str(stopped.value) == ("stopped by a stop request before stage prepare (nothing of it ran); run the "
                                  "pipeline again to go on")
    assert "step" not in str(stopped.value) and classify(stopped.value).exit_status == EXIT_STOPPED
