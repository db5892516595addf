"""Issue 36.4: the policy stages side by side. The setting (opt-in, checked), the grouping of the stage table, the
GPUs dealt to each stage, stage processes that really overlap under the Prefect task runner, and dvc.lock updated
safely when stages finish at the same moment (threads of the pipeline, or separate processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _dvc_project import init_dvc_project, run_dvc
import yaml

from tasks.run import parallel_stages
from tasks.run.parallel_stages import device_slices, parallel_groups, policy_workers, raise_for_status, task_runner
from tasks.stages import NAMES, POLICY_STAGES
from tasks.store.dvc_lockfile import JOURNAL, TMP_MARK, lock_problem
from tasks.store.dvc_ops import record_stage

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("a", "b", "c", "d")


def test_the_setting_is_opt_in_and_a_bad_value_names_its_source(monkeypatch):
    monkeypatch.delenv(parallel_stages.WORKERS_ENV, raising=False)
    assert policy_workers() == 1  # the CPU default: one after another
    monkeypatch.setenv(parallel_stages.WORKERS_ENV, "3")
    assert policy_workers() == 3 and policy_workers(2) == 2  # the flag/parameter wins over the environment
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(parallel_stages.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match=parallel_stages.WORKERS_ENV):
            policy_workers()
    with pytest.raises(ValueError, match="policy_workers"):
        policy_workers(0)


def test_auto_is_one_stage_per_gpu_else_two_per_omp_threads_worth_of_cores(monkeypatch):
    monkeypatch.setattr(parallel_stages, "visible_gpus", lambda: [])
    monkeypatch.setattr(parallel_stages.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setenv(parallel_stages.WORKERS_ENV, "auto")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert policy_workers() == 8 and policy_workers("AUTO") == 8
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert policy_workers("auto") == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert policy_workers("auto") == 2  # a stage wider than the machine: still two, sharing
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert policy_workers("auto") == 1  # each stage would take every core: one after another
    monkeypatch.setattr(parallel_stages, "visible_gpus", lambda: ["0", "1"])
    assert policy_workers("auto") == 2


def test_a_launched_stage_knows_the_pipeline_records_it():
    env = parallel_stages.stage_env("parent-run", None, None)
    assert env[parallel_stages.RECORDED_ENV] == "1" and env["RLHF_PARENT_RUN_ID"] == "parent-run"


def test_make_run_asks_for_auto_unless_told_otherwise():
    makefile = (ROOT / "Makefile").read_text()
    assert "POLICY_WORKERS ?= $(or $(RLHF_POLICY_WORKERS),auto)" in makefile
    assert "OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m flows.pipeline" in makefile


def test_the_pipeline_cli_refuses_a_bad_setting_before_anything_starts(tmp_path, monkeypatch):
    from flows.pipeline import main

    monkeypatch.setenv(parallel_stages.WORKERS_ENV, "many")
    assert main(["--root", str(tmp_path)]) == 2
    assert list(tmp_path.iterdir()) == []  # no lock, no store, nothing


def test_only_the_policy_stages_are_grouped_and_the_order_is_kept():
    groups = parallel_groups(NAMES, POLICY_STAGES)
    assert [name for group in groups for name in group] == list(NAMES)
    assert POLICY_STAGES in groups  # ppo, dpo, grpo, rloo, kto: one group (they depend on sft/reward_model only)
    assert all(len(g) == 1 for g in groups if g != POLICY_STAGES)  # prepare, sft, reward_model, evaluate, ddpo
    assert parallel_groups(("x", "p", "q", "y", "r"), ("p", "q", "r")) == [("x",), ("p", "q"), ("y",), ("r",)]


def test_gpus_are_dealt_in_disjoint_slices():
    assert device_slices(3, []) == [None, None, None]  # the CPU: nothing pinned
    assert device_slices(3, [str(i) for i in range(8)]) == ["0,1,2", "3,4,5", "6,7"]
    assert device_slices(2, ["4", "6"]) == ["4", "6"]  # CUDA_VISIBLE_DEVICES' own names are kept
    assert device_slices(5, ["0", "1"]) == ["0", "1", "0", "1", "0"]  # fewer cards than stages: they share


def test_an_unknown_or_missing_task_runner_is_named(monkeypatch):
    monkeypatch.setenv(parallel_stages.RUNNER_ENV, "slurm")
    with pytest.raises(ValueError, match="RLHF_TASK_RUNNER='slurm'"):
        task_runner(2)
    monkeypatch.setitem(sys.modules, "prefect_ray", None)  # not installed (an import of it fails)
    with pytest.raises(ValueError, match="pip install prefect-ray"):
        task_runner(2, "ray")
    assert task_runner(2, "threads")._max_workers == 2


def test_a_failed_stage_is_named_before_a_stopped_one():
    from rlhf_core.checkpointing import Preempted

    raise_for_status({"ppo": 0, "dpo": 0})
    with pytest.raises(RuntimeError, match=r"grpo \(exit 1\)"):
        raise_for_status({"ppo": 75, "grpo": 1})
    with pytest.raises(Preempted, match="ppo"):
        raise_for_status({"ppo": 75, "dpo": 0})


# A stand-in for `python -m flows.stage <name>`: writes when it started and ended and what it was given, then
# exits with the status named for it (the supervision of a real stage is tested in the slow test below).
FAKE_STAGE = r"""
import json, os, sys, time
name, out, codes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
start = time.time()
time.sleep(1.5)
with open(os.path.join(out, name + ".json"), "w") as fh:
    json.dump({"start": start, "end": time.time(), "parent": os.environ.get("RLHF_PARENT_RUN_ID"),
               "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, fh)
sys.exit(codes.get(name, 0))
"""


def test_stage_processes_overlap_under_the_prefect_task_runner(tmp_path, monkeypatch):
    from prefect.testing.utilities import prefect_test_harness

    codes = {"rloo": 1}
    monkeypatch.setattr(parallel_stages, "stage_command",
                        lambda name, root: [sys.executable, "-c", FAKE_STAGE, name, str(tmp_path), json.dumps(codes)])
    monkeypatch.setattr(parallel_stages, "visible_gpus", lambda: ["0", "1", "2"])
    with prefect_test_harness(server_startup_timeout=120):
        got = parallel_stages.run_side_by_side(("ppo", "dpo", "rloo"), tmp_path, "parent-123", workers=3)
    assert got == {"ppo": 0, "dpo": 0, "rloo": 1}  # a failed stage does not stop the others
    seen = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in got}
    assert max(s["start"] for s in seen.values()) < min(s["end"] for s in seen.values())  # all three at once
    assert [seen[n]["cuda"] for n in got] == ["0", "1", "2"] and {s["parent"] for s in seen.values()} == {"parent-123"}


DVC_YAML = "stages:\n" + "".join(f"  {s}:\n    cmd: echo {s} > {s}.txt\n    outs: [{s}.txt]\n" for s in STAGES)


_dvc = run_dvc


@pytest.fixture
def project(tmp_path) -> Path:
    """A git + DVC project with four stages, none recorded, each output written as its command would."""
    root = init_dvc_project(tmp_path / "proj", DVC_YAML)
    for stage in STAGES:
        (root / f"{stage}.txt").write_text(f"{stage}\n")
    return root


def _assert_all_recorded(root: Path) -> None:
    lock = root / "dvc.lock"
    assert lock_problem(lock) is None
    assert sorted(yaml.safe_load(lock.read_text())["stages"]) == list(STAGES)  # no entry lost
    assert (root / ".dvc" / "tmp" / JOURNAL).read_bytes() == lock.read_bytes()  # the kept copy is the last lock
    assert [p.name for p in root.rglob(f"*{TMP_MARK}*")] == []  # no temporary left behind
    status = _dvc(root, "status")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout


def test_stages_recorded_by_threads_at_the_same_moment_all_land_in_dvc_lock(project, monkeypatch):
    monkeypatch.chdir(project.parent)  # the recorder enters the repo itself (and restores the directory)
    barrier, errors = threading.Barrier(len(STAGES)), []

    def record(stage: str) -> None:
        try:
            barrier.wait()
            record_stage.fn(str(project), stage)
        except BaseException as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=record, args=(s,)) for s in STAGES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == []
    assert Path.cwd() == project.parent
    _assert_all_recorded(project)


# Each process imports DVC, says it is ready, waits until every one is, then records its stage as the pipeline does.
RECORD_TOGETHER = r"""
import pathlib, sys, time
sys.path.insert(0, sys.argv[1])
from tasks.store.dvc_ops import record_stage
import dvc.repo
ready = pathlib.Path(sys.argv[4])
(ready / sys.argv[3]).touch()
while len(list(ready.iterdir())) < int(sys.argv[5]):
    time.sleep(0.01)
record_stage.fn(sys.argv[2], sys.argv[3])
"""


def test_stages_recorded_by_processes_at_the_same_moment_all_land_in_dvc_lock(project, tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", RECORD_TOGETHER, str(ROOT), str(project), s, str(ready), "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in STAGES[:2]]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    for stage in STAGES[2:]:
        record_stage.fn(str(project), stage)
    _assert_all_recorded(project)


def _digest(path: Path) -> str:
    import hashlib

    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.relative_to(path if path.is_dir() else path.parent).as_posix().encode() + file.read_bytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_policies_side_by_side_give_what_one_after_another_gives(tmp_path):
    """A tiny project runs the pipeline one stage after another; then its five policy models are deleted and the
    pipeline runs again with three workers: DVC re-runs exactly those stages (and evaluate), side by side, and
    every policy's model and metrics come back byte for byte; dvc.lock is whole and ``dvc status`` clean."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    sys.path.insert(0, str(ROOT / "tests"))
    from _pipeline_project import make_project, mlflow_client, run

    root = make_project(tmp_path / "proj").resolve()
    with prefect_test_harness(server_startup_timeout=120):
        env = {"PREFECT_API_URL": PREFECT_API_URL.value(), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        run([sys.executable, "-m", "flows.pipeline", "--no-register"], root, env)
        outputs = [f"models/{s}" for s in POLICY_STAGES] + [f"metrics/{s}.json" for s in POLICY_STAGES]
        before = {out: _digest(root / out) for out in outputs}
        for stage in POLICY_STAGES:
            subprocess.run(["rm", "-rf", str(root / "models" / stage)], check=True)
        started_ms = time.time() * 1000
        run([sys.executable, "-m", "flows.pipeline", "--no-register", "--policy-workers", "3"], root, env)
    assert {out: _digest(root / out) for out in outputs} == before
    assert lock_problem(root / "dvc.lock") is None
    runs = [r for r in mlflow_client(root).search_runs(
        [mlflow_client(root).get_experiment_by_name("rlhf-pipeline").experiment_id], max_results=200)
        if r.data.tags.get("rlhf.stage") in POLICY_STAGES and r.info.start_time > started_ms]
    assert sorted(r.data.tags["rlhf.stage"] for r in runs) == sorted(POLICY_STAGES)  # each once, in the 2nd run
    spans = sorted((r.info.start_time, r.info.end_time) for r in runs)
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:]))  # some really ran side by side
    status = _dvc(root, "status")
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout


def test_side_by_side_records_what_succeeded_with_unchanged_inputs_then_fails(tmp_path, monkeypatch):
    from tasks.run import supervisor

    run = supervisor.PipelineRun(tmp_path, "test")
    snapshots = {"ppo": iter([{"lr": 1}, {"lr": 1}]), "dpo": iter([{"beta": 1}, {"beta": 2}]),
                 "kto": iter([{}, {}])}  # dpo's params.yaml edited while it ran
    monkeypatch.setattr(supervisor, "stage_snapshot", lambda root, name: next(snapshots[name]))
    monkeypatch.setattr(run, "_due", lambda name, force: True)
    monkeypatch.setattr(supervisor, "run_side_by_side", lambda names, root, parent, workers: {
        "ppo": 0, "dpo": 0, "kto": 1})
    recorded = []
    monkeypatch.setattr(run, "_finish", recorded.append)
    with pytest.raises(RuntimeError, match=r"kto \(exit 1\)"):
        run.stages(("ppo", "dpo", "kto"), workers=2)
    assert recorded == ["ppo"]  # dpo ran on inputs that changed since: not recorded, like a sequential stage


def test_one_worker_runs_the_group_one_after_another(tmp_path, monkeypatch):
    from tasks.run import supervisor

    run = supervisor.PipelineRun(tmp_path, "test")
    monkeypatch.setattr(supervisor, "run_side_by_side", lambda *a: pytest.fail("no process may be launched"))
    ran = []
    monkeypatch.setattr(run, "stage", lambda name, force=False: ran.append(name))
    run.stages(("ppo", "dpo"), workers=1)
    assert ran == ["ppo", "dpo"]
