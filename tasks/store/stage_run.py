"""The MLflow child run of one stage (``stage_run``) and the handle its body logs through (``StageRun``).

One child run per stage, tagged with the git commit, the DVC hashes of the stage's inputs and the Prefect
flow-run id, under the pipeline's parent run when there is one. When the stage is done, a Prefect artifact
(the stage summary and a link to the run) when it ran inside Prefect.

Under a launcher (``accelerate launch`` / ``torchrun``, see ``tasks/process/distributed.py``) only the main process
(global rank 0) records: ``stage_run`` gives the other ranks a handle with no MLflow run, no spool and no
Prefect artifacts, and every rank meets at a barrier when the stage ends (or stops), so none exits before
rank 0 has written.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_core.checkpointing import Preempted
from rlhf_core.model_card import write_model_card
from rlhf_core.tracking import NullTracker, public_params
from tasks.process.distributed import barrier, is_main_process
from tasks.process.logs import get_logger
from tasks.process.outcome import classify
from tasks.store.mlflow_runs import (TASK_TAG,
    mlflow_setup,
    mlflow_ui_link,
    replay_spool,
    stage_tracker,
    tracking_reachable,
    vanished_store,
)
from tasks.process.prefect_context import in_prefect_run, prefect_flow_run_id
from tasks.spec.params import as_dict
from tasks.spec.paths import task_folder
from tasks.store.placeholders import PLACEHOLDER
from tasks.store.provenance import git_commit, owner_tags, input_hashes, md5_file


@dataclass
class StageRun:
    """Handle given to a stage body: the MLflow run plus a summary collected for the Prefect artifact.

    ``tracker`` is the rlhf_core tracker the stage's trainers log to (``PPOTrainer(tracker=...)``; the
    Trainer-based trainers still take it as ``log_with=``): the active MLflow run while the server answers,
    the spool file afterwards.

    ``main`` is False on the non-main ranks of a launch: no run, a no-op tracker, nothing written.
    """

    stage: str
    root: Path
    run_id: str
    experiment_id: str
    summary: dict[str, Any] = field(default_factory=dict)
    input_hashes: dict[str, str] = field(default_factory=dict)
    reads: dict[str, Any] = field(default_factory=dict)
    """The params the stage reads outside its own section (its row's ``Stage.reads``), dotted."""
    tracker: Any = None
    main: bool = True

    @property
    def offline(self) -> bool:
        return bool(getattr(self.tracker, "offline", False))

    @property
    def spool_path(self) -> Path | None:
        return getattr(self.tracker, "spool_path", None)

    @property
    def link(self) -> str:
        return mlflow_ui_link(self.experiment_id, self.run_id) if self.run_id else f"(offline: {self.spool_path})"

    def _direct(self, what: str, call) -> None:
        """An MLflow call with no spool equivalent (datasets, artifacts): skipped while offline (and off rank 0)."""
        if self.offline or not self.main:
            return
        try:
            call()
        except Exception as error:  # noqa: BLE001 - an outage must not stop the stage
            failed = getattr(self.tracker, "backend_failed", None)
            if failed is not None:  # an outage goes to the spool; any other error is reported, the run stays online
                failed(error, f"stage {self.stage}: {what}")
            else:
                get_logger().warning("stage %s: %s not logged (%s)", self.stage, what, error)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (names that look like secrets are dropped by the tracker)."""
        self.tracker.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self.tracker.log(metrics, step=step)

    def log_table(self, name: str, rows: list[Mapping[str, Any]]) -> None:
        if rows:
            columns = list(rows[0].keys())
            self.tracker.log_table(name, columns, [[r[c] for c in columns] for r in rows])

    def _artifact(self, what: str, call, spool) -> None:
        """An artifact: logged while online; kept in the spool (and replayed with it) while offline, or when this
        very call finds the store gone (a model card was once silently missing from a run replayed after a lock)."""
        if not self.main:
            return
        if not self.offline:
            self._direct(what, call)
        if self.offline and hasattr(self.tracker, "spool_text"):
            spool()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow  # mlflow: only when a stage runs (tasks/run/stage_task.py imports this module)

        self._artifact(f"artifact {Path(path).name}",
                       lambda: mlflow.log_artifact(str(path), artifact_path=artifact_path, run_id=self.run_id),
                       lambda: self.tracker.spool_file(path, artifact_path))

    def log_child_runs(self, children: Mapping[str, tuple[Mapping[str, Any], Mapping[str, float]]]) -> dict[str, str]:
        """One finished run per ``name -> (params, metrics)``, nested under this stage's run and named
        ``<stage>: <name>``, each with the same metric keys: what MLflow's run comparison puts side by side (a
        stage's own run holds them only as ``<name>/<key>``). Returns name -> run id; nothing offline (the
        stage's own metrics carry the numbers to the spool)."""
        created: dict[str, str] = {}

        def log() -> None:
            from mlflow import MlflowClient  # mlflow: only when a stage runs
            from mlflow.entities import Metric, Param
            from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

            client, now = MlflowClient(), int(time.time() * 1000)
            for name, (params, metrics) in children.items():
                tags = {MLFLOW_PARENT_RUN_ID: self.run_id, MLFLOW_RUN_NAME: f"{self.stage}: {name}",
                        "rlhf.stage": f"{self.stage}.{name}", **owner_tags()}
                child = client.create_run(self.experiment_id, tags=tags, run_name=f"{self.stage}: {name}")
                client.log_batch(child.info.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
                                 params=[Param(k, str(v)) for k, v in params.items()])
                client.set_terminated(child.info.run_id, "FINISHED")
                created[name] = child.info.run_id

        self._direct(f"{len(children)} comparison runs", log)
        return created

    def log_dataset(self, path: str | Path, name: str, context: str = "training") -> None:
        """Log a JSONL dataset as an MLflow run input (source = its path, digest = its content)."""
        path = Path(path)
        if not self.main:
            return
        if self.offline:  # keep at least which file (and which content) was read
            self.tracker.log_params({f"input.{name}": f"{path} md5={md5_file(path)}"})
            return

        def log() -> None:
            import mlflow  # mlflow, pandas: only when a run logs a dataset
            import pandas as pd

            df = pd.read_json(path, lines=True) if path.stat().st_size else pd.DataFrame()
            with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local files
                warnings.simplefilter("ignore", UserWarning)
                ds = mlflow.data.from_pandas(df, source=str(path.resolve()), name=name)
            from mlflow.entities import DatasetInput, InputTag  # (mlflow)
            from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

            # the client call names the run (mlflow.log_input would use, or start, this thread's active run)
            mlflow.MlflowClient().log_inputs(self.run_id, [DatasetInput(
                ds._to_mlflow_entity(), tags=[InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)])])

        self._direct(f"dataset {name}", log)

    def write_model_card(self, model_dir: str | Path, trainer_name: str, base_model: str | None,
                         hyperparameters: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """Write README.md (rlhf_core's model card, with the stage's input hashes as notes) and log it to MLflow.

        The file in ``model_dir`` is DVC-tracked, so it holds only what follows from the inputs: the git commit and
        MLflow run id (different on every run) go into the MLflow copy only (a retrained stage with unchanged
        weights must keep its hash, or every later stage retrains).
        """
        import mlflow  # mlflow: only when a stage runs

        if not self.main:
            return
        # a placeholder input (a stage that did no work: disabled, or serving another task, as label under
        # sentiment) is not an input of the model: listed, it would change the card, hence the model's DVC hash,
        # whenever a stage for another task is added (the MLflow run's tags still name every input)
        inputs = {k: v for k, v in self.input_hashes.items() if not (Path(self.root) / k / PLACEHOLDER).exists()}
        notes = "\n".join(
            [f"Stage `{self.stage}` of the rlhf pipeline.", "", "Inputs (DVC hashes):", ""]
            + [f"- `{k}`: `{v}`" for k, v in inputs.items()]
            + ["", "The offline default trains on a synthetic corpus of generated reviews, not real data."])
        path = write_model_card(model_dir, model_name=f"rlhf-{self.stage}", trainer_name=trainer_name,
                                base_model=base_model, hyperparameters=dict(hyperparameters), metrics=dict(metrics),
                                notes=notes)
        provenance = (f"\n\nProvenance of this run: git commit `{git_commit(self.root)}`; MLflow run "
                      f"`{self.run_id or 'none (tracking offline: see ' + str(self.spool_path) + ')'}`.\n")
        text = Path(path).read_text() + provenance
        self._artifact("model card", lambda: mlflow.log_text(text, "model_card.md", run_id=self.run_id),
                       lambda: self.tracker.spool_text(text, "model_card.md"))


@contextlib.contextmanager
def stage_run(stage: str, root: str | Path, params_section: Any, deps: Iterable[str],
              parent_run_id: str | None = None, reads: Mapping[str, Any] | None = None) -> Iterator[StageRun]:
    """A child MLflow run for one stage, tagged with provenance; leaves a Prefect artifact when done.

    ``parent_run_id``: the pipeline's MLflow run the stage's run hangs under (``tasks/run/supervisor.py`` gives it);
    None: a top-level run. ``reads``: the params the stage reads outside its own section
    (``tasks.spec.params.cross_section_values``), logged with its section's and kept on the handle for the resume key
    (``tasks/stages/common/resume.py:resume_key``).

    If the tracking store is out (a server that refuses connections, a SQLite store locked or deleted) the stage still
    runs: one warning, and everything the run would have logged goes to a spool file under ``<root>/tracking-spool/``,
    replayed into the run when the stage ends if the store answers again by then (else ``make tracking-upload``).
    A stage that raised ends its run with the status ``tasks.process.outcome.classify`` gives (``KILLED`` for a
    stop by SIGTERM, ``Preempted``; ``FAILED`` for any other error).

    Under a launcher, only the main process opens the run; the other ranks get a handle that records nothing
    (``main=False``). All ranks meet at a barrier when the stage finishes or is stopped, after rank 0 has ended
    its run, so no rank exits (and no launcher tears the group down) while rank 0 still writes. A rank that
    fails with any other error does not wait: the launcher stops the others.
    """
    import mlflow  # mlflow: only when a stage runs

    root = Path(root).resolve()
    if not is_main_process():
        try:
            yield StageRun(stage, root, "", "", input_hashes=input_hashes(root, deps), reads=dict(reads or {}),
                           tracker=NullTracker(), main=False)
        except Preempted:
            barrier()
            raise
        barrier()
        return
    tags = {"rlhf.kind": "stage", "rlhf.stage": stage, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id(), TASK_TAG: task_folder(root)}
    tags.update(owner_tags())  # a run left RUNNING by a killed process is ended on the next start
    hashes = input_hashes(root, deps)
    tags.update({f"dvc.input.{k}": v for k, v in hashes.items()})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    online = tracking_reachable(root)
    exp_id, run_id = "", ""
    if online:
        exp_id = mlflow_setup(root)
        # A stale active run (e.g. from an earlier failure in this process) must not capture our logs. end_run
        # drops it first, then ends it in its store, which may be gone (a stage that lost its store mid-run).
        while mlflow.active_run() is not None:
            with contextlib.suppress(Exception):
                mlflow.end_run("KILLED")
        run_id = mlflow.start_run(experiment_id=exp_id, run_name=stage, tags=tags).info.run_id
    tracker = stage_tracker(root, stage)
    handle = StageRun(stage, root, run_id, exp_id, input_hashes=hashes, reads=dict(reads or {}), tracker=tracker)
    if handle.offline:  # provenance tags would be lost with the run: keep them as params
        tracker.log_params({f"tag.{k}": v for k, v in tags.items() if k != "mlflow.parentRunId"})
    started = time.time()

    def end(status: str) -> str | None:
        """End the run; returns the id of the run holding everything the stage logged (None: it is in the spool)."""
        tracker.finish()
        if run_id and not handle.offline:
            with contextlib.suppress(Exception):
                mlflow.end_run(status)
            return run_id
        recorded = replay_spool(root, tracker, status) if handle.offline else None  # the store may answer again
        if run_id and not recorded and vanished_store(root):
            with contextlib.suppress(Exception):  # drop our run, whose store is gone (it fails at once), not at exit
                mlflow.end_run(status)
        return recorded

    try:
        handle.log_params(public_params({**{f"{stage}.{k}": v for k, v in as_dict(params_section).items()},
                                         **handle.reads}))
        yield handle
    except BaseException as error:
        end(classify(error).mlflow_status)
        if isinstance(error, Preempted):
            barrier()  # every rank stopped at the same step (the stop flag is all-reduced); the state is on disk
        raise
    handle.summary.setdefault("seconds", round(time.time() - started, 1))
    tracker.log({"stage_seconds": time.time() - started})
    if run_id and not handle.offline:  # the run page's Description: what the stage did
        with contextlib.suppress(Exception):
            mlflow.MlflowClient().set_tag(run_id, "mlflow.note.content", stage_note(stage, handle.summary))
    recorded = end("FINISHED")
    if handle.offline and recorded:
        get_logger().info("stage %s: the tracking store answered again; what it spooled was replayed into run %s",
                          stage, recorded)
    elif handle.offline:
        handle.summary["tracking_spool"] = str(handle.spool_path)
        get_logger().warning("stage %s finished with tracking offline: upload %s with `make tracking-upload`",
                             stage, handle.spool_path)
    create_stage_artifact(handle)
    barrier()  # the other ranks leave only once the outputs and the run are complete


def stage_note(stage: str, summary: Mapping[str, Any]) -> str:
    """Markdown description of a finished stage run: its summary as a two-column table."""
    rows = [f"| {k} | {round(v, 4) if isinstance(v, float) else v} |" for k, v in summary.items()]
    return "\n".join([f"**Stage `{stage}`** of the RLHF pipeline (the parent run describes the whole run).", "",
                      "| key | value |", "|---|---|", *rows])


def create_stage_artifact(handle: StageRun) -> None:
    """A Prefect table artifact (the stage summary) and a markdown link to the MLflow run."""
    if not in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact  # prefect: only inside a flow run

    key = handle.stage.replace("_", "-")
    rows = [{"key": k, "value": (round(v, 4) if isinstance(v, float) else v)} for k, v in handle.summary.items()]
    create_table_artifact(rows, key=f"{key}-summary", description=f"{handle.stage}: summary")
    create_markdown_artifact(
        f"### {handle.stage}\n\nMLflow run: [{handle.run_id}]({handle.link})\n", key=f"{key}-mlflow",
        description=f"{handle.stage}: MLflow run link")


__all__ = ["StageRun", "create_stage_artifact", "stage_note", "stage_run"]
