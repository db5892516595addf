"""MLflow for the pipeline: where the store is, the parent run of a pipeline run, the stages' tracker.

MLflow default: a SQLite file ``mlflow.db`` in the project root with artifacts in ``mlartifacts/`` beside
it (both git-ignored). ``MLFLOW_TRACKING_URI`` overrides the store; ``RLHF_MLFLOW_EXPERIMENT`` the
experiment name; ``RLHF_MLFLOW_UI_URL`` the UI address used in Prefect artifact links.

Tracking outages never stop a stage: when the tracking server refuses connections, or the SQLite store is locked by
another process past ``$RLHF_TRACKING_LOCK_WAIT_S`` (30 s) or was deleted while open (at start, or later), the
stage warns once, naming the store, and keeps its params, metrics and tables in
``tracking-spool/<stage>-<time>-<pid>.jsonl`` in the project (``StageSpoolingTracker``). When the store answers again
by the stage's end, the spool is replayed into the stage's run at once (``replay_spool``); otherwise ``make
tracking-upload`` (``python -m flows.tracking upload tracking-spool``) replays it later.

A SQLite store that vanished is never silently replaced by a new, empty one (which would also be a new, empty model
registry): ``mlflow_setup`` records the store in ``mlartifacts/.rlhf-store.json``, and while that record names a
database file that is gone, the store counts as unavailable and the warning says how to restore it or, on purpose,
start anew (issue 24).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from urllib.parse import quote
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlhf_core.tracking import (MLflowTracker, SpoolingTracker, is_connection_failure, outage_reason, redact,
                                server_reachable, sqlite_path, upload_spool)
from tasks.process.logs import get_logger
from tasks.process.prefect_context import prefect_flow_run_id
from tasks.spec.params import Params, as_dict
from tasks.spec.paths import project_root, task_folder
from tasks.store.outputs import write_atomic
from tasks.store.provenance import git_commit, owner_tags

DEFAULT_EXPERIMENT = "rlhf-pipeline"
"""The MLflow experiment of pipeline runs unless ``$RLHF_MLFLOW_EXPERIMENT`` names another."""

PARENT_ENV = "RLHF_PARENT_RUN_ID"
"""Environment variable carrying the parent (pipeline) run id to stages run by ``dvc repro``."""

EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development",
                   "mlflow.note.content": "RLHF pipeline runs: one parent run per `python -m flows.pipeline` (named for "
                                          "what it did), one child run per stage. Open a parent's children with the "
                                          "+ in the run list; charts in each run's Model metrics tab."}
"""Experiment tags: the UI opens the experiment on its "Model training" runs view (not the GenAI overview)."""

SPOOL_DIR = "tracking-spool"
"""Where stages keep tracking data while the server is unreachable (in the project; git- and DVC-ignored)."""


TASK_TAG = "rlhf.task_folder"
"""Tag of every pipeline and stage run: the task folder it ran in (``.``: the repository root's sentiment pipeline,
``pipelines/arithmetic``, ...). One experiment holds every task's runs; filter on this tag to see one task."""


def experiment_name() -> str:
    """``$RLHF_MLFLOW_EXPERIMENT``, else ``DEFAULT_EXPERIMENT``."""
    return os.environ.get("RLHF_MLFLOW_EXPERIMENT", DEFAULT_EXPERIMENT)


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI``, else the project's SQLite store: one for every task (a task folder's runs go to the
    repository root's ``mlflow.db``, so one ``make mlflow-ui`` shows them all)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{project_root(root) / 'mlflow.db'}"


STORE_RECORD = ".rlhf-store.json"
"""In the artifact folder (``mlartifacts/``): the SQLite stores whose runs keep artifacts there."""

_warned: set[str] = set()  # store problems already reported by this process


def artifact_folder(root: str | Path) -> Path:
    """Where the project's SQLite store keeps run artifacts (the experiment's artifact location), for every task."""
    return project_root(root) / "mlartifacts"


def _record(root: str | Path) -> dict:
    try:
        record = json.loads((artifact_folder(root) / STORE_RECORD).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _recorded_stores(root: str | Path) -> list[str]:
    return list(_record(root).get("stores", []))


def _record_store(root: str | Path, database: Path) -> None:
    """Note that ``database`` exists and keeps its artifacts here (once per store), and which store it is: the id
    and creation time of the project's experiment in it (once that experiment exists)."""
    record = _record(root)
    stores, identities = list(record.get("stores", [])), dict(record.get("identities", {}))
    identity = store_identity(database) if database.is_file() else None
    changed = str(database) not in stores and database.is_file()
    if changed:
        stores.append(str(database))
    if identity and str(database) not in identities:
        identities[str(database)], changed = identity, True
    if changed:
        write_atomic(artifact_folder(root) / STORE_RECORD, json.dumps({"stores": stores, "identities": identities}))


def store_identity(database: Path) -> str | None:
    """``<experiment id>:<creation time>`` of the project's experiment in a SQLite store; '' when the store has none
    (a new store); None when it cannot be read now (locked, being written)."""
    try:
        connection = sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True, timeout=1)
        try:
            row = connection.execute("SELECT experiment_id, creation_time FROM experiments WHERE name = ?",
                                     (experiment_name(),)).fetchone()
        finally:
            connection.close()
    except sqlite3.OperationalError as error:
        return "" if "no such table" in str(error) else None
    except sqlite3.DatabaseError:
        return None
    return f"{row[0]}:{row[1]}" if row else ""


def replaced_store(root: str | Path, database: Path) -> str | None:
    """What to do when the store at ``database`` is not the one recorded: a new store made in its place (a plain
    ``mlflow ui`` or ``mlflow server`` on a deleted ``mlflow.db`` creates a fresh one), which would start a new,
    empty registry silently while DVC's records name versions of the old one."""
    recorded = _record(root).get("identities", {}).get(str(database))
    current = store_identity(database) if recorded else None
    if not recorded or current is None or current == recorded:
        return None
    artifacts = artifact_folder(root)
    found = "has no experiment " + repr(experiment_name()) if not current else f"holds another one ({current})"
    return (f"the MLflow store {database} is not this project's store: it {found}, where the project's "
            f"(id:creation time {recorded}) held its runs and model registry. A new store was made in its place "
            f"(a plain `mlflow ui` on a deleted mlflow.db does). Nothing is logged into it: restore the project's "
            f"store (from a backup) and remove this one; or start a new, empty store and registry on purpose: "
            f"mv {artifacts} {artifacts}.old")


def vanished_store(root: str | Path) -> str | None:
    """What to do when the project's SQLite store, recorded as existing, is gone (deleted or moved; an empty file in
    its place counts as gone); None while it is there (or was never made, or is not SQLite)."""
    database = sqlite_path(tracking_uri(root))
    if database is None or str(database) not in _recorded_stores(root):
        return None
    if database.is_file() and database.stat().st_size > 0:
        return replaced_store(root, database)
    artifacts = artifact_folder(root)
    return (f"the MLflow store {database} (this project's runs and model registry) is gone: deleted or moved. "
            f"Nothing is logged into a new, empty store in its place. Restore the file (from a backup), then send "
            f"what runs kept meanwhile with `make tracking-upload`; or start a new, empty store on purpose: "
            f"mv {artifacts} {artifacts}.old")


def store_problem(root: str | Path) -> str | None:
    """Why the tracking store cannot take this project's runs now (None: it can): a server that refuses
    connections, a SQLite store locked by another process past the wait, or one that vanished."""
    uri = tracking_uri(root)
    gone = vanished_store(root)
    if gone:
        return gone
    return None if server_reachable(uri) else outage_reason(uri)


def tracking_reachable(root: str | Path) -> bool:
    """False when the tracking store is out (:func:`store_problem`), which is then reported once per outage."""
    problem = store_problem(root)
    if problem is None:
        _warned.clear()  # back: the next outage is reported again
    elif problem not in _warned:
        _warned.add(problem)
        get_logger().warning("%s; MLflow runs spool to %s/ meanwhile", redact(problem), SPOOL_DIR)
    return problem is None


class StoreUnavailable(ConnectionError):
    """The project's tracking store cannot be used (the message says why and what to do); an outage for the trackers."""


def mlflow_setup(root: str | Path) -> str:
    """Point MLflow at the project store and return the experiment id (creating it if needed). A SQLite store that
    vanished, or stays locked past the wait, raises :class:`StoreUnavailable` (a vanished one is not replaced by a
    new, empty one; a locked one is not met with a raw ``database is locked`` after MLflow's 20 s busy wait)."""
    import mlflow  # mlflow: only when a store is used (flows.ui imports this module)

    problem = store_problem(root) if sqlite_path(tracking_uri(root)) is not None else None
    if problem:
        raise StoreUnavailable(problem)
    root = Path(root).resolve()
    uri = tracking_uri(root)
    exported = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    # set_tracking_uri also exports $MLFLOW_TRACKING_URI, which `tracking_uri` reads first: left in place, the
    # first project's store would become the store of every later project this process (or its children) runs
    # (a retrain worktree, a test's next project). Only a user's own setting belongs in the environment.
    if exported is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = exported
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(experiment_name())
    database = sqlite_path(uri)
    if database is not None:  # from now on, a vanished file is noticed, not silently replaced
        _record_store(root, database)
    if exp is None:
        artifacts = artifact_folder(root).as_uri() if uri.startswith("sqlite:") else None
        created = client.create_experiment(experiment_name(), artifact_location=artifacts, tags=EXPERIMENT_TAGS)
        if database is not None:
            _record_store(root, database)  # which store this is, now that the project's experiment is in it
        return created
    if any(exp.tags.get(k) != v for k, v in EXPERIMENT_TAGS.items()):  # an experiment made by an older version
        for key, value in EXPERIMENT_TAGS.items():
            client.set_experiment_tag(exp.experiment_id, key, value)
    return exp.experiment_id


def mlflow_ui_link(experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run (``$RLHF_MLFLOW_UI_URL``, default ``http://127.0.0.1:5000``), opened in the
    UI's "Model training" view (``workflowType=machine_learning``; without it a fresh browser shows GenAI)."""
    base = os.environ.get("RLHF_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def mlflow_compare_link(experiment_id: str, run_ids: list[str]) -> str:
    """The MLflow UI's run comparison of ``run_ids`` (metrics side by side, parallel coordinates, charts)."""
    base = os.environ.get("RLHF_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    runs, experiments = json.dumps(list(run_ids)), json.dumps([experiment_id])
    return (f"{base}/#/compare-runs?runs={quote(runs)}&experiments={quote(experiments)}"
            "&workflowType=machine_learning")  # the "Model training" navigation, as mlflow_ui_link


RUNNING_NAME = "pipeline (running)"
"""The parent run's name until it ends and is named for what it did (``pipeline_run_name``)."""

NOOP_NAME = "no-op: up to date"
"""The name of a parent run that trained and registered nothing (it is then deleted: hidden in the UI)."""


def flat_params(params: Params) -> dict[str, str]:
    """Every resolved section of ``params`` but ``paths`` as ``<section>.<key>`` -> str."""
    flat: dict[str, str] = {}
    for name, section in params.sections().items():
        if name == "paths":
            continue
        for key, value in as_dict(section).items():
            flat[f"{name}.{key}"] = str(value)[:6000]
    return flat


def changed_params(current: Mapping[str, str], previous: Mapping[str, str] | None) -> dict[str, str]:
    """The params of ``current`` whose value differs from ``previous`` (new keys included); {} with no previous."""
    if not previous:
        return {}
    return {k: v for k, v in current.items() if previous.get(k) != v}


def pipeline_run_name(source: str, ran: list[str], changed: Mapping[str, str], dvc_exp: str | None = None,
                      failed_stage: str | None = None, default_stages: Sequence[str] = ()) -> str:
    """What a pipeline run did, in the run list's name column, e.g. ``ppo,evaluate | ppo.learning_rate=1e-4 |
    data=synthetic`` or ``[exp-1a2b3] ...`` under ``dvc exp run``; ``NOOP_NAME`` when nothing ran. ``all stages``
    when it ran every one of ``default_stages``."""
    if not ran and not failed_stage:
        return NOOP_NAME
    everything = bool(default_stages) and set(default_stages) <= set(ran)
    what = ("all stages" if everything else ",".join(ran)) if not failed_stage else f"FAILED at {failed_stage}"
    parts = [what]
    if changed:
        shown = [f"{k}={v}" for k, v in list(changed.items())[:3]]
        parts.append(" ".join(shown) + (f" (+{len(changed) - 3})" if len(changed) > 3 else ""))
    parts.append(f"data={Path(source).name if source not in ('synthetic', '') else source}")
    name = " | ".join(parts)
    return (f"[{dvc_exp}] " if dvc_exp else "") + name[:240]


def pipeline_note(ran: list[str], skipped: list[str], changed: Mapping[str, str], source: str,
                  results: Mapping[str, Mapping[str, float]], registry: Mapping[str, Any] | None,
                  error: str | None = None) -> str:
    """Markdown description of a pipeline run (the ``mlflow.note.content`` tag shown on the run page)."""
    lines = [f"**Pipeline run** on data `{source}`.", "",
             f"- stages run: {', '.join(ran) or 'none'}", f"- up to date (skipped): {', '.join(skipped) or 'none'}",
             "- params changed since the previous pipeline run: "
             + (", ".join(f"`{k}={v}`" for k, v in changed.items()) or "none (or first run)")]
    if registry is not None:
        lines.append(f"- registry: {registry.get('reason')}")
    if error:
        lines += ["", f"**Failed**: {error}"]
    if results:
        keys = list(next(iter(results.values())))
        lines += ["", "| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {p} | " + " | ".join(str(v.get(k, "")) for k in keys) + " |" for p, v in results.items()]
    lines += ["", "Stage runs are the children of this run (expand it in the run list); charts: the evaluate run."]
    return "\n".join(lines)


def mlflow_key(metric: str) -> str:
    """A metric's name as an MLflow metric or tag key: ``pass@1`` -> ``pass_at_1`` (MLflow refuses '@'); the sentiment
    task's names pass unchanged. :func:`metric_of_key` reverses it."""
    return metric.replace("@", "_at_")


def metric_of_key(key: str) -> str:
    """The metric an MLflow key written by :func:`mlflow_key` names (``pass_at_1`` -> ``pass@1``)."""
    return key.replace("_at_", "@")


def headline_metrics(results: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """``metrics/evaluate.json`` as flat MLflow metrics ``<policy>.<metric>`` (numbers only; ``pass@1`` as
    ``pass_at_1``)."""
    return {f"{policy}.{mlflow_key(key)}": float(value) for policy, row in results.items() for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def previous_pipeline_params(client: Any, exp_id: str, exclude_run: str, folder: str = ".") -> dict[str, str] | None:
    """The params of the latest finished pipeline run of the task folder ``folder`` other than ``exclude_run`` (None
    when there is none). Runs from before the tag was written are the root's (``.``)."""
    runs = client.search_runs([exp_id], filter_string="tags.`rlhf.kind` = 'pipeline' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=20)
    for run in runs:
        if run.data.tags.get(TASK_TAG, ".") != folder:
            continue
        if run.info.run_id != exclude_run and run.data.params:
            return dict(run.data.params)
    return None


def start_pipeline_run(root: str | Path, entry: str, run_name: str | None = None) -> str:
    """Create the parent MLflow run of one pipeline run; returns its id (the run is not made active; "" when the
    tracking store is out). It is named ``RUNNING_NAME`` until ``end_pipeline_run`` names it for what it did."""
    import mlflow  # mlflow: only when a run starts (flows.ui imports this module)

    if not tracking_reachable(root):  # (reported there, naming the store)
        get_logger().warning("no MLflow parent run for this pipeline run; stages spool to %s/", SPOOL_DIR)
        return ""
    exp_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    tags = {"rlhf.kind": "pipeline", "rlhf.entry": entry, "git.commit": git_commit(root), TASK_TAG: task_folder(root),
            "prefect.flow_run_id": prefect_flow_run_id(), "mlflow.runName": run_name or RUNNING_NAME}
    if os.environ.get("DVC_EXP_NAME"):
        tags["dvc.exp_name"] = os.environ["DVC_EXP_NAME"]
    tags.update(owner_tags())  # a run left RUNNING by a killed process is ended on the next start
    run = client.create_run(exp_id, tags=tags)
    return run.info.run_id


def end_pipeline_run(root: str | Path, run_id: str, status: str = "FINISHED",
                     summary: Mapping[str, Any] | None = None, *, params: Params | None = None,
                     ran: list[str] | None = None, skipped: list[str] | None = None,
                     registry: Mapping[str, Any] | None = None, failed_stage: str | None = None,
                     error: BaseException | None = None, results: Mapping[str, Mapping[str, Any]] | None = None,
                     default_stages: Sequence[str] = ()) -> bool:
    """End the parent run with ``status``: each ``summary`` entry as an ``rlhf.<key>`` tag; with ``params`` (the
    resolved ``Params``) also its name (``pipeline_run_name``), every stage's params, the headline metrics of
    ``results`` (the policies of ``metrics/evaluate.json``), a description, and on failure the failing stage and error
    as tags.

    A finished run that ran nothing and registered nothing is tagged ``rlhf.noop=true`` and deleted (the UI hides
    deleted runs). Returns False when the run was deleted (or there is none), else True."""
    import mlflow  # mlflow: only when a run ends (flows.ui imports this module)
    from mlflow.entities import Metric, Param

    if not run_id or not tracking_reachable(root):
        return False
    exp_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    for key, value in (summary or {}).items():
        client.set_tag(run_id, f"rlhf.{key}", str(value)[:5000])
    if failed_stage:
        client.set_tag(run_id, "rlhf.failed_stage", failed_stage)
    if error is not None:
        client.set_tag(run_id, "rlhf.error", f"{type(error).__name__}: {error}"[:5000])
    if params is not None:
        ran, skipped = list(ran or []), list(skipped or [])
        flat = flat_params(params)
        changed = changed_params(flat, previous_pipeline_params(client, exp_id, run_id, task_folder(root)))
        noop = status == "FINISHED" and not ran and not (registry or {}).get("registered")
        source = params.prepare.source
        name = pipeline_run_name(source, ran, changed, os.environ.get("DVC_EXP_NAME"), failed_stage, default_stages)
        if status == "KILLED":  # a stop request (SIGTERM/SIGINT), not a failure
            name = name.replace("FAILED at", "stopped at", 1)
        results = dict(results or {})
        error_text = f"stage {failed_stage}: {type(error).__name__}: {error}" if error is not None else None
        client.set_tag(run_id, "mlflow.runName", name)
        client.set_tag(run_id, "mlflow.note.content",
                       pipeline_note(ran, skipped, changed, source, results, registry, error_text))
        client.set_tag(run_id, "rlhf.changed_params", ",".join(changed)[:5000] or "none")
        if noop:
            client.set_tag(run_id, "rlhf.noop", "true")
        else:
            items = [Param(k, v) for k, v in flat.items()]
            for start in range(0, len(items), 100):  # MLflow's log_batch takes at most 100 params
                client.log_batch(run_id, params=items[start:start + 100])
            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, 0) for k, v in headline_metrics(results).items()] if ran else []
            if metrics:
                client.log_batch(run_id, metrics=metrics)
        client.set_terminated(run_id, status=status)
        if noop:
            client.delete_run(run_id)
            return False
        return True
    client.set_terminated(run_id, status=status)
    return True


class StageSpoolingTracker(SpoolingTracker):
    """The tracker of one stage: the active MLflow stage run while the server answers, then a spool file named
    after the stage (several stages share one process). Its one outage warning also goes to the Prefect run's
    log, and the end-of-stage reminder is the stage's own (``stage_run``), not a second one from ``finish``."""

    remind_on_finish = False

    def log_params(self, params):
        """Log ``params``, dropping an unprefixed key (a trainer's own config, e.g. ``learning_rate``) whose value
        the stage already logged as ``<stage>.<key>`` (``ppo.learning_rate``): each param appears once."""
        logged = self.__dict__.setdefault("_logged_params", {})
        fresh = {k: v for k, v in params.items()
                 if not ("." not in k and logged.get(f"{self.run_name}.{k}") == str(v))}
        logged.update({k: str(v) for k, v in fresh.items()})
        if fresh:
            super().log_params(fresh)

    def spool_file_name(self) -> str:
        return f"{self.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"

    def offline_message(self, error: BaseException) -> str:
        return (f"stage {self.run_name}: {outage_reason(self.tracking_uri, error)}; the stage continues and its params, "
                f"metrics and tables are kept in {self.spool_path} (replayed at the stage's end if the store answers "
                f"again by then). Upload them later with: make tracking-upload "
                f"(python -m flows.tracking upload {self.spool_dir})")

    def on_offline(self, error: BaseException) -> None:
        get_logger().warning(redact(self.offline_message(error)))  # credentials in the URI redacted

    def __repr__(self) -> str:  # what a config that holds it logs as ``log_with``
        return self.name


def stage_tracker(root: Path, stage: str) -> StageSpoolingTracker:
    """The stage's tracker, attached to the active MLflow run (started by ``stage_run``; not owned by it)."""
    def attach(project_name: str, run_name: str | None) -> MLflowTracker:
        gone = vanished_store(root)
        if gone:  # MLflow would create a new, empty store in its place
            raise StoreUnavailable(gone)
        return MLflowTracker(project_name, run_name)

    return StageSpoolingTracker(attach, spool_dir=root / SPOOL_DIR, project_name=experiment_name(), run_name=stage,
                                tracking_uri=tracking_uri(root))


def replay_spool(root: Path, tracker: StageSpoolingTracker, status: str) -> str | None:
    """A stage that went offline, at its end: if the store answers again, replay its spool into its run (a new run
    when it never had one) and end that run with ``status``; returns the run id (None: still out, or nothing
    spooled; the spool stays for ``make tracking-upload``)."""
    import mlflow  # mlflow: only when a stage ends offline (flows.ui imports this module)

    spool = tracker.spool_path
    if spool is None or not spool.is_file() or not tracking_reachable(root):
        return None
    try:
        mlflow_setup(root)
        run_id = upload_spool(spool, run_id=tracker.run_id)
        mlflow.MlflowClient().set_terminated(run_id, status=status)
    except Exception as error:  # noqa: BLE001 - a store that failed again keeps the spool
        if not is_connection_failure(error):
            raise
        get_logger().warning("stage %s: %s; its spool %s stays for `make tracking-upload`", tracker.run_name,
                             outage_reason(tracking_uri(root), error), spool)
        return None
    active = mlflow.active_run()
    if active is not None and active.info.run_id == run_id:  # the stage's own run, left active when it went offline
        mlflow.end_run(status)
    return run_id


__all__ = [
    "DEFAULT_EXPERIMENT", "NOOP_NAME", "PARENT_ENV", "RUNNING_NAME", "SPOOL_DIR", "StageSpoolingTracker",
    "StoreUnavailable",
    "changed_params", "end_pipeline_run", "experiment_name", "flat_params", "headline_metrics", "mlflow_compare_link",
    "TASK_TAG", "metric_of_key", "mlflow_key", "mlflow_setup", "mlflow_ui_link", "pipeline_note", "pipeline_run_name", "previous_pipeline_params", "replay_spool",
    "stage_tracker", "start_pipeline_run", "store_problem", "tracking_reachable", "tracking_uri", "vanished_store",
]
