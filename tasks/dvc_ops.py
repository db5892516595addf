"""DVC bookkeeping for the Prefect flows: is a stage stale, record a stage, push to the remote.

The flow asks DVC before running a stage's task and records the stage in ``dvc.lock`` (caching its
outputs) after, so ``python -m flows.pipeline`` and ``dvc repro`` share one record: after either,
``dvc status`` is clean and the other finds nothing to do. These touch disk, so they retry.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.logs import get_logger


@contextlib.contextmanager
def _repo(root: str | Path) -> Iterator:
    """Open the DVC repo at ``root`` with the working directory inside it (DVC resolves stage paths
    against the current directory; from outside the repo its outputs look foreign)."""
    from dvc.repo import Repo

    from tasks.logs import single_dvc_output

    single_dvc_output()  # each DVC message printed once

    previous = os.getcwd()
    os.chdir(root)
    try:
        with Repo(str(root)) as repo:
            yield repo
    finally:
        os.chdir(previous)


@task(name="dvc-status", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def stage_status(root: str, stage: str) -> dict:
    """What changed for ``stage`` (``{}`` when it is up to date: deps, params and outs match dvc.lock)."""
    with _repo(root) as repo:
        return repo.status(targets=[stage])


@task(name="dvc-commit", retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE)
def record_stage(root: str, stage: str) -> None:
    """Write ``stage``'s dvc.lock entry and cache its outputs (only after the stage succeeded)."""
    with _repo(root) as repo:
        repo.commit(stage, force=True)
    get_logger().info("dvc: recorded stage %s in dvc.lock", stage)


@task(name="dvc-push", retries=3, retry_delay_seconds=5, cache_policy=NO_CACHE)
def push_outputs(root: str, remote: str | None = None) -> int:
    """Push cached data and models to the DVC remote (``.dvc-remote/`` by default); returns files pushed."""
    with _repo(root) as repo:
        pushed = repo.push(remote=remote)
    get_logger().info("dvc: pushed %s file(s) to the %s remote", pushed, remote or "default")
    return int(pushed or 0)
