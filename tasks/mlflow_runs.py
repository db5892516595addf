"""MLflow for the pipeline: where the store is, the parent run of a pipeline run, the stages' tracker.

MLflow default: a SQLite file ``mlflow.db`` in the project root with artifacts in ``mlartifacts/`` beside
it (both git-ignored). ``MLFLOW_TRACKING_URI`` overrides the store; ``RLHF_MLFLOW_EXPERIMENT`` the
experiment name; ``RLHF_MLFLOW_UI_URL`` the UI address used in Prefect artifact links.

Tracking outages never stop a stage: when the tracking server refuses connections (at start, or later), the
stage warns once and keeps its params, metrics and tables in ``tracking-spool/<stage>-<time>-<pid>.jsonl`` in
the project (``StageSpoolingTracker``); ``make tracking-upload`` (``python -m rlhf_core.tracking upload
tracking-spool``) replays them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhf_core.tracking import SpoolingTracker, redact, server_reachable
from tasks.distributed import require_single_process
from tasks.logs import get_logger
from tasks.prefect_context import prefect_flow_run_id
from tasks.provenance import git_commit, owner_tags

DEFAULT_EXPERIMENT = "rlhf-pipeline"
"""The MLflow experiment of pipeline runs unless ``$RLHF_MLFLOW_EXPERIMENT`` names another."""

PARENT_ENV = "RLHF_PARENT_RUN_ID"
"""Environment variable carrying the parent (pipeline) run id to stages run by ``dvc repro``."""

SPOOL_DIR = "tracking-spool"
"""Where stages keep tracking data while the server is unreachable (in the project; git- and DVC-ignored)."""


def experiment_name() -> str:
    """``$RLHF_MLFLOW_EXPERIMENT``, else ``DEFAULT_EXPERIMENT``."""
    return os.environ.get("RLHF_MLFLOW_EXPERIMENT", DEFAULT_EXPERIMENT)


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI``, else the project's SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def tracking_reachable(root: str | Path) -> bool:
    """False when the tracking URI is a server that refuses connections (local stores are always reachable)."""
    return server_reachable(tracking_uri(root))


def mlflow_setup(root: str | Path) -> str:
    """Point MLflow at the project store and return the experiment id (creating it if needed)."""
    import mlflow

    root = Path(root).resolve()
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment_name())
    if exp is None:
        artifacts = (root / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        return client.create_experiment(experiment_name(), artifact_location=artifacts)
    return exp.experiment_id


def mlflow_ui_link(experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run (``$RLHF_MLFLOW_UI_URL``, default ``http://127.0.0.1:5000``)."""
    base = os.environ.get("RLHF_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def start_pipeline_run(root: str | Path, entry: str, run_name: str | None = None) -> str:
    """Create the parent MLflow run of one pipeline run; returns its id (the run is not made active).

    The pipeline flow is single-process: under a launcher it fails here, before any stage runs."""
    import mlflow

    require_single_process("the pipeline flow", "`python -m flows.pipeline`; launch only the training stages, "
                           "one at a time (`accelerate launch ... -m flows.stage sft`)")

    if not tracking_reachable(root):
        get_logger().warning("tracking server %s unreachable: no MLflow parent run; stages spool to %s/",
                             redact(tracking_uri(root)), SPOOL_DIR)
        return ""
    exp_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    tags = {"rlhf.kind": "pipeline", "rlhf.entry": entry, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id(),
            "mlflow.runName": run_name or f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}"}
    tags.update(owner_tags())  # a run left RUNNING by a killed process is ended on the next start
    run = client.create_run(exp_id, tags=tags)
    return run.info.run_id


def end_pipeline_run(root: str | Path, run_id: str, status: str = "FINISHED",
                     summary: Mapping[str, Any] | None = None) -> None:
    """End the parent run with ``status``, each ``summary`` entry as an ``rlhf.<key>`` tag (no-op offline)."""
    import mlflow

    if not run_id or not tracking_reachable(root):
        return
    mlflow_setup(root)
    client = mlflow.MlflowClient()
    for key, value in (summary or {}).items():
        client.set_tag(run_id, f"rlhf.{key}", str(value)[:5000])
    client.set_terminated(run_id, status=status)


class StageSpoolingTracker(SpoolingTracker):
    """The tracker of one stage: the active MLflow stage run while the server answers, then a spool file named
    after the stage (several stages share one process). Its one outage warning also goes to the Prefect run's
    log, and the end-of-stage reminder is the stage's own (``stage_run``), not a second one from ``finish``."""

    remind_on_finish = False

    def spool_file_name(self) -> str:
        return f"{self.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"

    def offline_message(self, error: BaseException) -> str:
        return (f"stage {self.run_name}: tracking server {self.tracking_uri} unreachable "
                f"({type(error).__name__}); the stage continues and its params, metrics and tables are kept in "
                f"{self.spool_path}. Upload them later with: make tracking-upload "
                f"(python -m rlhf_core.tracking upload {self.spool_dir})")

    def on_offline(self, error: BaseException) -> None:
        get_logger().warning(redact(self.offline_message(error)))  # credentials in the URI redacted

    def __repr__(self) -> str:  # what a config that holds it logs as ``log_with``
        return self.name


def stage_tracker(root: Path, stage: str) -> StageSpoolingTracker:
    """The stage's tracker, attached to the active MLflow run (started by ``stage_run``; not owned by it)."""
    from rlhf_core.tracking import MLflowTracker

    def attach(project_name: str, run_name: str | None) -> MLflowTracker:
        return MLflowTracker(project_name, run_name)

    return StageSpoolingTracker(attach, spool_dir=root / SPOOL_DIR, project_name=experiment_name(), run_name=stage,
                                tracking_uri=tracking_uri(root))


__all__ = [
    "DEFAULT_EXPERIMENT", "PARENT_ENV", "SPOOL_DIR", "StageSpoolingTracker", "end_pipeline_run", "experiment_name",
    "mlflow_setup", "mlflow_ui_link", "stage_tracker", "start_pipeline_run", "tracking_reachable", "tracking_uri",
]
