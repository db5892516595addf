"""The policy stages side by side: each a ``python -m flows.stage <name>`` process, launched through a Prefect
task runner, pinned to its own GPU(s) when several are visible.

Outside ``params.yaml`` (hardware never enters DVC's cache keys): ``RLHF_POLICY_WORKERS=N`` (``make run
POLICY_WORKERS=N``, ``python -m flows.pipeline --policy-workers N``, or the deployed flow's ``policy_workers``
parameter), or ``auto`` (:func:`auto_workers`: one per GPU, or two per ``$OMP_NUM_THREADS`` cores), which
``make run`` uses unless told otherwise. Unset or 1: the stages run one after another in the pipeline's own process.
``RLHF_TASK_RUNNER`` picks the runner: ``threads`` (default: each thread waits on its stage's process), ``dask`` or
``ray`` (``prefect-dask`` / ``prefect-ray`` installed, workers sharing this checkout's file system).

Why a process per stage, not a thread running the trainer: every trainer seeds torch's one global RNG, so two in one
process would draw each other's numbers and give results that depend on timing. A stage process is the same command
``dvc repro`` runs (same seeds, same outputs as a sequential run); it joins the pipeline's checkout lock (the lock
token is inherited), its MLflow run hangs under the pipeline's parent run (``RLHF_PARENT_RUN_ID``) and it reports
to the pipeline's Prefect server (``PREFECT_API_URL``). The pipeline records the stages in ``dvc.lock`` after they
end, in the stage table's order, one at a time (``tasks/store/dvc_ops.py`` also serialises concurrent recorders).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from prefect import get_client, task
from prefect.cache_policies import NO_CACHE
from prefect.task_runners import ThreadPoolTaskRunner

from rlhf_core.checkpointing import Preempted, stop_requested
from tasks.process.logs import get_logger
from tasks.process.outcome import EXIT_STOPPED  # a stage process stopped with its state saved
from tasks.store.mlflow_runs import PARENT_ENV
from tasks.spec.paths import project_root

WORKERS_ENV = "RLHF_POLICY_WORKERS"
RECORDED_ENV = "RLHF_RECORDED_BY_PIPELINE"
"""Set in a stage process the pipeline launched: the pipeline records the stage in dvc.lock when it ends, so the
stage's own "record it by hand" hint (``flows.stage.unrecorded_note``) would mislead."""
RUNNER_ENV = "RLHF_TASK_RUNNER"
RUNNERS = ("threads", "dask", "ray")
POLL_S = 0.5


def policy_workers(value: int | str | None = None) -> int:
    """How many policy stages may run at once: ``value``, else ``$RLHF_POLICY_WORKERS``, else 1 (sequential).
    ``auto``: :func:`auto_workers`."""
    raw = os.environ.get(WORKERS_ENV, "") if value is None else value
    if raw in ("", None):
        return 1
    if str(raw).strip().lower() == "auto":
        return auto_workers()
    try:
        workers = int(raw)
    except (TypeError, ValueError):
        workers = 0
    if workers < 1:
        source = WORKERS_ENV if value is None else "policy_workers"
        raise ValueError(f"{source}={raw!r}: expected a whole number of stages to run at once (1 or more), "
                         "or auto")
    return workers


def auto_workers() -> int:
    """``auto``: one stage per visible GPU. On the CPU, two stages per ``$OMP_NUM_THREADS`` cores this process may use:
    the OS shares the cores among them, so stages of unequal length leave no core idle while one ends (measured on 2
    cores, three single-thread trainers of ~60 s each: all done in 97 s side by side, against ~120 s two at a time;
    docs/scale.md). Without ``$OMP_NUM_THREADS`` a stage takes every core: 1."""
    gpus = visible_gpus()
    if gpus:
        return len(gpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if not threads.isdigit() or int(threads) < 1:
        return 1
    return 2 * max(1, cores // int(threads))


def parallel_groups(names: Sequence[str], policies: Sequence[str]) -> list[tuple[str, ...]]:
    """``names`` in order, cut into groups: each run of consecutive policy stages is one group (they depend only on
    stages before them), every other stage a group of its own."""
    groups: list[tuple[str, ...]] = []
    for name in names:
        if name in policies and groups and groups[-1][0] in policies:
            groups[-1] = (*groups[-1], name)
        else:
            groups.append((name,))
    return groups


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (indices when it is unset)."""
    import torch  # torch: only when stages are launched side by side

    if not torch.cuda.is_available():
        return []
    listed = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return listed or [str(i) for i in range(torch.cuda.device_count())]


def device_slices(stages: int, gpus: Sequence[str]) -> list[str | None]:
    """``CUDA_VISIBLE_DEVICES`` for each of ``stages`` launched together: the GPUs dealt out in contiguous,
    disjoint slices (8 GPUs, 3 stages: 3 + 3 + 2); None for every stage without GPUs (the CPU) and, with fewer
    GPUs than stages, GPU i % n (stages then share cards)."""
    if not gpus:
        return [None] * stages
    if len(gpus) < stages:
        return [gpus[i % len(gpus)] for i in range(stages)]
    base, extra = divmod(len(gpus), stages)
    slices, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        slices.append(",".join(gpus[start:end]))
        start = end
    return slices


def task_runner(workers: int, kind: str | None = None):
    """The Prefect task runner for ``workers`` stages at once (``kind`` or ``$RLHF_TASK_RUNNER``)."""
    kind = (kind or os.environ.get(RUNNER_ENV) or "threads").strip().lower()
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if kind in ("dask", "ray"):
        module, name = {"dask": ("prefect_dask", "DaskTaskRunner"), "ray": ("prefect_ray", "RayTaskRunner")}[kind]
        try:
            runner = getattr(__import__(module), name)
        except ImportError as error:
            raise ValueError(f"{RUNNER_ENV}={kind}: {module} is not installed (pip install "
                             f"{module.replace('_', '-')})") from error
        return runner()
    raise ValueError(f"{RUNNER_ENV}={kind!r}: expected one of {', '.join(RUNNERS)}")


def stage_command(name: str, root: str | Path) -> list[str]:
    return [sys.executable, "-m", "flows.stage", name, "--root", str(root)]


def stage_env(parent_run_id: str | None, devices: str | None, api_url: str | None) -> dict[str, str]:
    """This process's environment for a stage process: the MLflow parent run, the GPUs it may use, the Prefect
    server to report to."""
    env = {**os.environ, RECORDED_ENV: "1"}
    if parent_run_id:
        env[PARENT_ENV] = parent_run_id
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


@task(name="policy-stage", cache_policy=NO_CACHE)  # a training stage: never a cached result
def launch_stage(name: str, root: str, env: dict[str, str]) -> int:
    """Run ``python -m flows.stage name`` in ``root`` and wait; a stop request (SIGTERM/SIGINT to the pipeline)
    is passed on as SIGTERM, so the stage saves its state. Returns the exit status."""
    # from the project (the repository root, where ``flows`` imports), also for a task folder's stage (``--root``)
    proc = subprocess.Popen(stage_command(name, Path(root).resolve()), cwd=project_root(root), env=env)
    forwarded = False
    while proc.poll() is None:
        if stop_requested() and not forwarded:
            proc.send_signal(signal.SIGTERM)
            forwarded = True
        time.sleep(POLL_S)
    return proc.returncode


def prefect_api_url() -> str | None:
    """The Prefect server this flow run reports to (its temporary server too), for the stage processes."""
    try:
        with get_client(sync_client=True) as client:
            return str(client.api_url)
    except Exception:  # noqa: BLE001 - no server: each stage then starts its own, as under dvc repro
        return None


def run_side_by_side(names: Sequence[str], root: str | Path, parent_run_id: str | None,
                     workers: int) -> dict[str, int]:
    """Run the stages ``names`` at most ``workers`` at a time, each in its own process, and wait for all (a failed
    stage does not stop the others); returns each stage's exit status, in ``names``' order."""
    slices = device_slices(len(names), visible_gpus())
    api_url = prefect_api_url()
    runner = task_runner(min(workers, len(names)))
    log = get_logger()
    with runner:
        futures = {}
        for name, devices in zip(names, slices):
            log.info("stage %s: launched beside %s%s", name, ", ".join(n for n in names if n != name) or "nothing",
                     f" (CUDA_VISIBLE_DEVICES={devices})" if devices is not None else "")
            futures[name] = runner.submit(launch_stage, {"name": name, "root": str(root),
                                                         "env": stage_env(parent_run_id, devices, api_url)})
        return {name: futures[name].result() for name in names}


def raise_for_status(codes: dict[str, int]) -> None:
    """RuntimeError naming the stages that failed; else :class:`Preempted` naming those stopped (exit 75: a stop
    request, or inputs that changed while they ran); else nothing."""
    failed = [f"{n} (exit {c})" for n, c in codes.items() if c not in (0, EXIT_STOPPED)]
    if failed:
        raise RuntimeError(f"policy stages failed: {', '.join(failed)} (their output is above)")
    stopped = [n for n, c in codes.items() if c == EXIT_STOPPED]
    if stopped:
        raise Preempted("", message=f"stopped (state saved) or inputs changed, not recorded: {', '.join(stopped)}; "
                                    "run again")


__all__ = ["RECORDED_ENV", "RUNNER_ENV", "WORKERS_ENV", "auto_workers", "device_slices", "launch_stage",
           "parallel_groups", "policy_workers", "raise_for_status", "run_side_by_side", "stage_command", "stage_env",
           "task_runner", "visible_gpus"]
