"""The pipeline's training stages under a two-process launch: ``python -m flows.stage <name>`` per rank.

What docs/scale.md "The pipeline's training stages on a multi-GPU node" promises, on this CPU machine: torchrun with two
gloo processes and ``ACCELERATE_USE_CPU=1`` (what ``accelerate launch`` runs; its CPU config would start ONE
process without MPI). A tiny project runs ``prepare`` single-process, then ``sft``, ``reward_model``, ``ppo`` and
``dpo`` each under the launcher, with MLflow in the project's SQLite store and a Prefect test server.

Checked: exit 0 and loadable outputs; one MLflow run and one Prefect flow run per stage (rank 0's); the ranks end
with identical weights (each stage checks and logs it); PPO's metrics show 2 processes and 2 x batch_size
rollouts per step; nothing but the stage's own outputs appears in the project. An audit hook
(``sitecustomize`` on ``PYTHONPATH``) records every write-open, mkdir, rename, delete and SQLite connection
under the project by each rank: rank 1 must have none, rank 0 must have written the outputs (the control
that the hook works). Also: ``prepare`` under the launcher fails fast and writes nothing.

The fast tests at the end check the same rules in-process with a faked launcher environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import torchrun
from _pipeline_project import make_project, mlflow_client

TRAINING = ("sft", "reward_model", "ppo", "dpo")

AUDIT_HOOK = r'''
"""Test-only: record what a launched rank writes under $RLHF_AUDIT_ROOT (one line per event) in $RLHF_AUDIT_LOG."""
import os
import sys

_root = os.environ.get("RLHF_AUDIT_ROOT")
_log = os.environ.get("RLHF_AUDIT_LOG")
_rank = os.environ.get("RANK")
if _root and _log and _rank is not None:
    _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    _PATH_EVENTS = {"os.mkdir": (0,), "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.replace": (0, 1),
                    "os.symlink": (1,), "os.link": (1,), "os.truncate": (0,), "os.chmod": (0,), "os.utime": (0,),
                    "shutil.rmtree": (0,), "shutil.copyfile": (1,), "sqlite3.connect": (0,)}
    _busy = []

    def _inside(path):
        if isinstance(path, int) or path is None:
            return None
        try:
            full = os.path.abspath(os.fsdecode(path))
        except TypeError:
            return None
        if (full == _root or full.startswith(_root + os.sep)) and "__pycache__" not in full:
            return full
        return None

    def _hook(event, args):
        if _busy:
            return
        if event == "open":
            hits = [args[0]] if isinstance(args[2], int) and args[2] & _WRITE else []
        elif event in _PATH_EVENTS:
            if event in ("os.mkdir", "os.remove", "os.rmdir") and args[-1] not in (None, -1):
                return  # relative to a dir fd (shutil.rmtree's walk): its top-level event is recorded
            hits = [args[i] for i in _PATH_EVENTS[event]]
        else:
            return
        for path in hits:
            full = _inside(path)
            if full:
                _busy.append(1)
                try:
                    with open(_log, "a") as fh:
                        fh.write(f"rank{_rank} {event} {os.path.relpath(full, _root)}\n")
                finally:
                    _busy.pop()

    with open(_log, "a") as _fh:
        _fh.write(f"rank{_rank} armed {os.getpid()}\n")
    sys.addaudithook(_hook)
'''


def _tree(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every file (size, mtime) and directory (None) under ``root``, relative, without bytecode caches."""
    entries: dict[str, tuple[int, int] | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(root)
        for d in dirnames:
            entries[(rel / d).as_posix() + "/"] = None
        for f in filenames:
            st = (Path(dirpath) / f).stat()
            entries[(rel / f).as_posix()] = (st.st_size, st.st_mtime_ns)
    return entries


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k, v in after.items() if k not in before or before[k] != v)


def _expected_change(stage: str, path: str) -> bool:
    """What a stage may add or modify: its outputs (the held-out sample windows of ppo/dpo included), the MLflow
    store, the (empty) checkpoint root, and the
    checkout lock rank 0's CLI holds (``tasks/process/locking.py``; at the root in this project, which has no ``.dvc/``)."""
    return (path.startswith((f"models/{stage}/", "mlartifacts/"))
            or path in ("models/", "metrics/", "plots/", f"metrics/{stage}.json", f"plots/{stage}.csv",
                        f"plots/{stage}_windows.csv", "mlflow.db", ".checkpoints/", ".rlhf-run.lock"))


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Run prepare (refused under the launcher, then single-process) and the four training stages launched."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    base = tmp_path_factory.mktemp("launch")
    root = make_project(base / "proj", git_dvc=False).resolve()
    hook = base / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(AUDIT_HOOK)
    audit = base / "audit.log"
    python = sys.executable
    result: dict = {"root": root, "audit": audit, "launches": {}, "trees": {}}
    saved = {k: os.environ.pop(k, None) for k in ("MLFLOW_TRACKING_URI", "RLHF_PARENT_RUN_ID")}
    try:
        with prefect_test_harness(server_startup_timeout=120):
            env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1",
                   "ACCELERATE_USE_CPU": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                   "PYTHONDONTWRITEBYTECODE": "1", "RLHF_AUDIT_ROOT": str(root), "RLHF_AUDIT_LOG": str(audit),
                   "PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}

            def launch(stage: str) -> subprocess.CompletedProcess:
                cmd = torchrun("-m", "flows.stage", stage, python=python)
                return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=400)

            before = _tree(root)
            result["refused"] = launch("prepare")
            result["trees"]["refused"] = _changed(before, _tree(root))
            single = subprocess.run([python, "-m", "flows.stage", "prepare"], cwd=root, env=env, capture_output=True,
                                    text=True, timeout=300)
            assert single.returncode == 0, single.stdout[-2000:] + single.stderr[-4000:]
            for stage in TRAINING:
                before = _tree(root)
                proc = launch(stage)
                result["launches"][stage] = proc
                result["trees"][stage] = _changed(before, _tree(root))
                assert proc.returncode == 0, f"{stage} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            with get_client(sync_client=True) as client:
                flows = {f.id: f.name for f in client.read_flows()}
                result["flow_runs"] = [(flows.get(r.flow_id), r.parameters.get("name"), r.state_type.value)
                                       for r in client.read_flow_runs()]
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return result


def _audit(launched) -> list[tuple[str, str, str]]:
    lines = launched["audit"].read_text().splitlines() if launched["audit"].exists() else []
    return [tuple(line.split(" ", 2)) for line in lines]


@pytest.mark.slow
def test_launched_stages_exit_0_and_write_loadable_outputs(launched):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = launched["root"]
    assert set(launched["launches"]) == set(TRAINING)
    for stage in TRAINING:
        metrics = json.loads((root / "metrics" / f"{stage}.json").read_text())
        assert metrics["num_processes"] == 2, (stage, metrics)
        assert (root / "plots" / f"{stage}.csv").read_text().startswith("step,")
        assert (root / "models" / stage / "README.md").is_file()  # the model card, written once by rank 0
        out = launched["launches"][stage].stdout + launched["launches"][stage].stderr
        assert f"{stage}: weights identical on all 2 processes" in out  # DDP kept the replicas equal
    for stage in ("sft", "ppo", "dpo"):
        assert AutoModelForCausalLM.from_pretrained(root / "models" / stage).num_parameters() > 0
    assert AutoModelForSequenceClassification.from_pretrained(root / "models" / "reward_model").config.num_labels == 1


@pytest.mark.slow
def test_ppo_generates_on_both_ranks(launched):
    root = launched["root"]
    metrics = json.loads((root / "metrics" / "ppo.json").read_text())
    assert metrics["num_processes"] == 2 and metrics["rollouts_per_step"] == 2 * 8  # TINY ppo.batch_size = 8
    assert metrics["steps"] == 2 and len((root / "plots" / "ppo.csv").read_text().splitlines()) == 1 + 2
    out = launched["launches"]["ppo"].stdout + launched["launches"]["ppo"].stderr
    assert "16 rollouts (8 per process x 2)" in out


@pytest.mark.slow
def test_one_mlflow_run_and_one_prefect_flow_run_per_stage(launched):
    client = mlflow_client(launched["root"])
    runs = client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])
    stages = sorted(str(r.data.tags.get("rlhf.stage")) for r in runs)
    # no second run from rank 1, none from the refused launch, no untagged run from a stray fluent MLflow call
    assert stages == sorted(["prepare", *TRAINING]), [(r.info.run_name, r.info.start_time, r.data.tags) for r in runs]
    for run in runs:
        assert run.info.status == "FINISHED", run.info.run_name
        if run.data.tags["rlhf.stage"] in TRAINING:
            assert run.data.metrics["final/num_processes"] == 2
            assert any(k.startswith(run.data.tags["rlhf.stage"] + ".") for k in run.data.params)
    ppo = next(r for r in runs if r.data.tags["rlhf.stage"] == "ppo")
    assert "env/reward_mean" in ppo.data.metrics and "objective/kl" in ppo.data.metrics
    assert sorted(launched["flow_runs"]) == sorted(("rlhf-stage", s, "COMPLETED") for s in ("prepare", *TRAINING))


@pytest.mark.slow
def test_only_rank_0_writes_into_the_project(launched):
    events = _audit(launched)
    armed = [e for e in events if e[1] == "armed"]
    assert sorted({e[0] for e in armed}) == ["rank0", "rank1"]
    assert sum(e[0] == "rank1" for e in armed) == 1 + len(TRAINING)  # the hook ran in every launched rank 1
    rank1 = [e for e in events if e[0] == "rank1" and e[1] != "armed"]
    assert rank1 == [], rank1
    rank0_paths = {e[2] for e in events if e[0] == "rank0" and e[1] != "armed"}
    for stage in TRAINING:  # the control: the same hook does see rank 0's writes
        assert {f"metrics/{stage}.json", f"plots/{stage}.csv"} <= rank0_paths, stage
    assert "mlflow.db" in rank0_paths

    root = launched["root"]
    for stage in TRAINING:
        unexpected = [p for p in launched["trees"][stage] if not _expected_change(stage, p)]
        assert unexpected == [], (stage, unexpected)
    assert not (root / "tracking-spool").exists()
    leftovers = [p for p in _tree(root) if ".tmp-" in p or ".old-" in p or "tmp_" in p or p.startswith(".checkpoints/")
                 and p != ".checkpoints/"]
    assert leftovers == []


@pytest.mark.slow
def test_prepare_under_a_launcher_fails_fast_and_writes_nothing(launched):
    refused = launched["refused"]
    assert refused.returncode != 0
    assert "prepare: started by a launcher with 2 processes" in refused.stderr
    assert "Run it without a launcher: `python -m flows.stage prepare`" in refused.stderr
    assert launched["trees"]["refused"] == []  # not even the MLflow store


# ---------------------------------------------------------------------------------------------- fast, in-process


@pytest.fixture
def two_ranks(monkeypatch):
    """A faked launcher environment (no process group is created by the checks below)."""
    def as_rank(rank: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(rank))
    return as_rank


@pytest.mark.parametrize("stage", ["prepare", "evaluate"])
def test_non_training_stage_under_a_launcher_exits_2_with_a_message(stage, two_ranks, monkeypatch, tmp_path, capsys):
    import signal

    import flows.stage as cli
    from tasks.run.supervisor import EXIT_USAGE

    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(cli, "stage", lambda *a, **k: pytest.fail("no flow run may start"))
    two_ranks(0)
    assert cli.main([stage, "--root", str(tmp_path)]) == EXIT_USAGE == 2
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers  # refused before them
    err = capsys.readouterr().err
    assert f"{stage}: started by a launcher with 2 processes" in err and "without a launcher" in err
    assert list(tmp_path.iterdir()) == []


def test_registry_and_pipeline_flow_refuse_a_launcher(two_ranks, tmp_path):
    from tasks.process.distributed import LauncherError
    from tasks.registry.gate import registry_task
    from tasks.run.supervisor import PipelineRun

    two_ranks(0)
    with pytest.raises(LauncherError, match="registry: started by a launcher"):
        registry_task.fn(str(tmp_path))
    with pytest.raises(LauncherError, match="the pipeline flow: started by a launcher"):
        with PipelineRun(tmp_path, "python -m flows.pipeline"):
            pytest.fail("the pipeline must not start")
    assert list(tmp_path.iterdir()) == []


def test_non_main_rank_records_and_writes_nothing(two_ranks, tmp_path, monkeypatch):
    from dataclasses import dataclass

    import tasks.store.stage_run as stage_run_module
    from tasks.store.outputs import atomic_dir, write_csv, write_json
    from tasks.store.stage_run import stage_run

    @dataclass(frozen=True)
    class Section:
        learning_rate: float = 0.1

    project = tmp_path / "proj"
    project.mkdir()
    (project / "input.txt").write_text("x")
    two_ranks(1)
    calls = []
    monkeypatch.setattr(stage_run_module, "barrier", lambda: calls.append("barrier"))  # a real one needs the other rank
    with stage_run("sft", project, Section(), ["input.txt"]) as run:
        assert not run.main and run.run_id == "" and not run.offline
        run.log_params({"a": 1})
        run.log_metrics({"loss": 1.0}, step=1)
        run.log_dataset(project / "input.txt", "input")
        with atomic_dir(project / "models" / "sft") as out:
            assert project not in out.parents  # a private scratch directory
            (out / "weights").write_text("rank 1")
            run.write_model_card(out, "SFTTrainer", None, {}, {})
        write_json(project / "metrics" / "sft.json", {"a": 1})
        write_csv(project / "plots" / "sft.csv", [{"step": 1}])
    assert not out.exists()
    assert calls == ["barrier"]  # waits for rank 0 before leaving
    assert sorted(p.name for p in project.iterdir()) == ["input.txt"]  # no run, no spool, no outputs


def test_collectives_are_plain_values_in_one_process(monkeypatch):
    from tasks.process import distributed

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert distributed.world_size() == 1 and distributed.is_main_process()
    assert distributed.any_process(True) and not distributed.any_process(False)
    assert distributed.mean_over_processes([1.0, 2.0, 4.5]) == 2.5
    distributed.barrier()
    with distributed.main_process_first():
        pass
    distributed.require_single_process("prepare", ("sft",))
