"""Shared plumbing for the stage tasks: MLflow parent/child runs, Prefect artifacts and logs, atomic writes.

MLflow default: a SQLite file ``mlflow.db`` in the project root with artifacts in ``mlartifacts/`` beside
it (both git-ignored). ``MLFLOW_TRACKING_URI`` overrides the store; ``RLHF_MLFLOW_EXPERIMENT`` the
experiment name; ``RLHF_MLFLOW_UI_URL`` the UI address used in Prefect artifact links.

One parent run per pipeline run (``pipeline_run``) and one child run per stage (``stage_run``). Each child
is tagged with the git commit, the DVC hashes of the stage's inputs and the Prefect flow-run id.

Tracking outages never stop a stage: when the tracking server refuses connections (at start, or later), the
stage warns once and keeps its params, metrics and tables in ``tracking-spool/<stage>-<time>-<pid>.jsonl`` in
the project; ``make tracking-upload`` (``python -m rlhf_core.tracking upload tracking-spool``) replays them.

Under a launcher (``accelerate launch`` / ``torchrun``, see ``tasks/distributed.py``) only the main process
(global rank 0) writes: ``stage_run`` gives the other ranks a handle with no MLflow run, no spool and no
Prefect artifacts, ``write_atomic``/``write_json``/``write_csv`` do nothing there, ``atomic_dir`` hands them a
private scratch directory outside the project, and every rank meets at a barrier when the stage ends (or stops),
so none exits before rank 0 has written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.distributed import barrier, is_main_process
from tasks.orphans import owner_tags
from tasks.params import as_dict

DEFAULT_EXPERIMENT = "rlhf-pipeline"
PARENT_ENV = "RLHF_PARENT_RUN_ID"


# --------------------------------------------------------------------------------------------
# logs and progress
# --------------------------------------------------------------------------------------------


def get_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow/task run (logs stream into the Prefect UI), else a plain one."""
    try:
        from prefect import get_run_logger
        from prefect.exceptions import MissingContextError

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    except ImportError:  # pragma: no cover
        pass
    logger = logging.getLogger("rlhf_pipeline")
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)  # launched: rank 0 tells the story
    return logger


def on_terminal() -> bool:
    """Progress bars only when a person is watching."""
    return sys.stderr.isatty()


def progress(iterable: Iterable, **kwargs) -> Iterable:
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not on_terminal() or not is_main_process(), **kwargs)


def in_prefect_run() -> bool:
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None
    except ImportError:  # pragma: no cover
        return False


def prefect_flow_run_id() -> str:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - no Prefect context
        return ""


# --------------------------------------------------------------------------------------------
# atomic file outputs
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temp dir beside ``target``; on success replace ``target`` with it, on error delete it.

    On a non-main rank of a launch: a private scratch directory outside the project, deleted afterwards (every
    rank still calls the trainers' save, which sharded setups need as a collective; DDP saves on rank 0 only).
    """
    if not is_main_process():
        with tempfile.TemporaryDirectory(prefix=f"rlhf-{Path(target).name}-rank-") as scratch:
            yield Path(scratch)
        return
    from rlhf_core.checkpointing import atomic_directory  # one implementation: concurrent writers, mode 0755

    with atomic_directory(target) as tmp:
        yield tmp


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename. Nothing on a non-main rank of a launch."""
    if not is_main_process():
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_csv(path: str | Path, rows: list[Mapping[str, Any]], columns: list[str] | None = None) -> None:
    import csv
    import io

    columns = columns or (list(rows[0].keys()) if rows else [])
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in columns})
    write_atomic(path, buf.getvalue())


# --------------------------------------------------------------------------------------------
# provenance: git commit, DVC hashes of inputs
# --------------------------------------------------------------------------------------------


def git_commit(root: str | Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _md5_file(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _md5_dir(path: Path) -> str:
    entries = [{"md5": _md5_file(p), "relpath": p.relative_to(path).as_posix()}
               for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.md5(json.dumps(entries, sort_keys=True).encode()).hexdigest() + ".dir"


def _locked_out_hashes(root: Path) -> dict[str, str]:
    lock = root / "dvc.lock"
    if not lock.exists():
        return {}
    data = yaml.safe_load(lock.read_text()) or {}
    hashes = {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs", []) or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def input_hashes(root: str | Path, deps: Iterable[str]) -> dict[str, str]:
    """DVC hash of each input: from ``dvc.lock`` when an upstream stage recorded it, else computed."""
    root = Path(root)
    locked = _locked_out_hashes(root)
    hashes = {}
    for dep in deps:
        if dep in locked:
            hashes[dep] = locked[dep]
        elif (root / dep).is_file():
            hashes[dep] = _md5_file(root / dep)
        elif (root / dep).is_dir():
            hashes[dep] = _md5_dir(root / dep)
        else:
            hashes[dep] = "missing"
    return hashes


# --------------------------------------------------------------------------------------------
# MLflow runs
# --------------------------------------------------------------------------------------------


SPOOL_DIR = "tracking-spool"
"""Where stages keep tracking data while the server is unreachable (in the project; git- and DVC-ignored)."""


def tracking_uri(root: str | Path) -> str:
    """``$MLFLOW_TRACKING_URI``, else the project's SQLite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(root).resolve() / 'mlflow.db'}"


def tracking_reachable(root: str | Path) -> bool:
    """False when the tracking URI is a server that refuses connections (local stores are always reachable)."""
    from rlhf_core.tracking import server_reachable

    return server_reachable(tracking_uri(root))


def mlflow_setup(root: str | Path) -> str:
    """Point MLflow at the project store and return the experiment id (creating it if needed)."""
    import mlflow

    root = Path(root).resolve()
    uri = tracking_uri(root)
    mlflow.set_tracking_uri(uri)
    name = os.environ.get("RLHF_MLFLOW_EXPERIMENT", DEFAULT_EXPERIMENT)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        artifacts = (root / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
        return client.create_experiment(name, artifact_location=artifacts)
    return exp.experiment_id


def mlflow_ui_link(experiment_id: str, run_id: str) -> str:
    base = os.environ.get("RLHF_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}"


def start_pipeline_run(root: str | Path, entry: str, run_name: str | None = None) -> str:
    """Create the parent MLflow run of one pipeline run; returns its id (the run is not made active).

    The pipeline flow is single-process: under a launcher it fails here, before any stage runs."""
    import mlflow

    from tasks.distributed import require_single_process

    require_single_process("the pipeline flow", "`python -m flows.pipeline`; launch only the training stages, "
                           "one at a time (`accelerate launch ... -m flows.stage sft`)")

    if not tracking_reachable(root):
        from rlhf_core.tracking import redact

        get_logger().warning("tracking server %s unreachable: no MLflow parent run; stages spool to %s/",
                             redact(tracking_uri(root)), SPOOL_DIR)
        return ""
    exp_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    tags = {"rlhf.kind": "pipeline", "rlhf.entry": entry, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id(), "mlflow.runName": run_name or f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}"}
    tags.update(owner_tags())  # a run left RUNNING by a killed process is ended on the next start
    run = client.create_run(exp_id, tags=tags)
    return run.info.run_id


def end_pipeline_run(root: str | Path, run_id: str, status: str = "FINISHED", summary: Mapping[str, Any] | None = None) -> None:
    import mlflow

    if not run_id or not tracking_reachable(root):
        return
    mlflow_setup(root)
    client = mlflow.MlflowClient()
    for key, value in (summary or {}).items():
        client.set_tag(run_id, f"rlhf.{key}", str(value)[:5000])
    client.set_terminated(run_id, status=status)


def _stage_tracker_class():
    from rlhf_core.tracking import SpoolingTracker

    class StageSpoolingTracker(SpoolingTracker):
        """``SpoolingTracker`` whose spool file is named after the stage (several stages share one process)."""

        def _spool_file_name(self) -> str:
            import uuid

            return f"{self.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}.jsonl"

        def _offline_message(self, error: BaseException) -> str:
            return (f"stage {self.run_name}: tracking server {self.tracking_uri} unreachable "
                    f"({type(error).__name__}); the stage continues and its params, metrics and tables are kept in "
                    f"{self.spool_path}. Upload them later with: make tracking-upload "
                    f"(python -m rlhf_core.tracking upload {self.spool_dir})")

        def _go_offline(self, error: BaseException) -> None:
            first_time = self.spool_path is None
            super()._go_offline(error)
            if first_time:  # the warning also goes to the Prefect run's log (credentials redacted)
                from rlhf_core.tracking import redact

                get_logger().warning(redact(self._offline_message(error)))

        def __repr__(self) -> str:  # what a config that holds it logs as ``log_with``
            return self.name

        def finish(self) -> None:  # the reminder is the stage's (one warning per stage, not two)
            if self.spool_path is not None:
                self._append({"kind": "finish"})

    return StageSpoolingTracker


@dataclass
class StageRun:
    """Handle given to a stage body: the MLflow run plus a summary collected for the Prefect artifact.

    ``tracker`` is the rlhf_core tracker the stage's trainers log to (pass it as ``log_with``): the active
    MLflow run while the server answers, the spool file afterwards.

    ``main`` is False on the non-main ranks of a launch: no run, a no-op tracker, nothing written.
    """

    stage: str
    root: Path
    run_id: str
    experiment_id: str
    summary: dict[str, Any] = field(default_factory=dict)
    input_hashes: dict[str, str] = field(default_factory=dict)
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
            self.tracker._go_offline(error)
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

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        import mlflow

        self._direct(f"artifact {Path(path).name}",
                     lambda: mlflow.log_artifact(str(path), artifact_path=artifact_path, run_id=self.run_id))

    def log_dataset(self, path: str | Path, name: str, context: str = "training") -> None:
        """Log a JSONL dataset as an MLflow run input (source = its path, digest = its content)."""
        path = Path(path)
        if not self.main:
            return
        if self.offline:  # keep at least which file (and which content) was read
            self.tracker.log_params({f"input.{name}": f"{path} md5={_md5_file(path)}"})
            return

        def log() -> None:
            import warnings

            import mlflow
            import pandas as pd

            df = pd.read_json(path, lines=True) if path.stat().st_size else pd.DataFrame()
            with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local files
                warnings.simplefilter("ignore", UserWarning)
                ds = mlflow.data.from_pandas(df, source=str(path.resolve()), name=name)
            from mlflow.entities import DatasetInput, InputTag
            from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

            # the client call names the run (mlflow.log_input would use, or start, this thread's active run)
            mlflow.MlflowClient().log_inputs(self.run_id, [DatasetInput(
                ds._to_mlflow_entity(), tags=[InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)])])

        self._direct(f"dataset {name}", log)

    def write_model_card(self, model_dir: str | Path, trainer_name: str, base_model: str | None,
                         hyperparameters: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """Write README.md (rlhf_core's model card, with the stage's input hashes as notes) and log it to MLflow.

        The file in ``model_dir`` is DVC-tracked, so it holds only what follows from the inputs: the git commit and
        MLflow run id (different on every run) go into the MLflow copy only (issue 12.6: a retrained stage with
        unchanged weights must keep its hash, or every later stage retrains).
        """
        import mlflow

        if not self.main:
            return

        from rlhf_core.model_card import write_model_card

        notes = "\n".join(
            [f"Stage `{self.stage}` of the rlhf pipeline.", "", "Inputs (DVC hashes):", ""]
            + [f"- `{k}`: `{v}`" for k, v in self.input_hashes.items()]
            + ["", "The offline default trains on a synthetic corpus of generated reviews, not real data."])
        path = write_model_card(model_dir, model_name=f"rlhf-{self.stage}", trainer_name=trainer_name,
                                base_model=base_model, hyperparameters=dict(hyperparameters), metrics=dict(metrics),
                                notes=notes)
        provenance = (f"\n\nProvenance of this run: git commit `{git_commit(self.root)}`; MLflow run "
                      f"`{self.run_id or 'none (tracking offline: see ' + str(self.spool_path) + ')'}`.\n")
        self._direct("model card", lambda: mlflow.log_text(Path(path).read_text() + provenance, "model_card.md",
                                                           run_id=self.run_id))


@contextlib.contextmanager
def stage_run(stage: str, root: str | Path, params_section: Any, deps: Iterable[str],
              parent_run_id: str | None = None) -> Iterator[StageRun]:
    """A child MLflow run for one stage, tagged with provenance; leaves a Prefect artifact when done.

    If the tracking server is unreachable the stage still runs: one warning, and everything the run would have
    logged goes to a spool file under ``<root>/tracking-spool/`` (``make tracking-upload`` sends it later).
    A stage stopped by SIGTERM (``Preempted``) ends its run ``KILLED``; any other error ``FAILED``.

    Under a launcher, only the main process opens the run; the other ranks get a handle that records nothing
    (``main=False``). All ranks meet at a barrier when the stage finishes or is stopped, after rank 0 has ended
    its run, so no rank exits (and no launcher tears the group down) while rank 0 still writes. A rank that
    fails with any other error does not wait: the launcher stops the others.
    """
    import mlflow

    from rlhf_core.checkpointing import Preempted
    from rlhf_core.tracking import MLflowTracker, NullTracker, public_params

    root = Path(root).resolve()
    if not is_main_process():
        try:
            yield StageRun(stage, root, "", "", input_hashes=input_hashes(root, deps), tracker=NullTracker(), main=False)
        except Preempted:
            barrier()
            raise
        barrier()
        return
    uri = tracking_uri(root)
    experiment = os.environ.get("RLHF_MLFLOW_EXPERIMENT", DEFAULT_EXPERIMENT)
    parent_run_id = parent_run_id or os.environ.get(PARENT_ENV) or None
    tags = {"rlhf.kind": "stage", "rlhf.stage": stage, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id()}
    tags.update(owner_tags())  # a run left RUNNING by a killed process is ended on the next start
    hashes = input_hashes(root, deps)
    tags.update({f"dvc.input.{k}": v for k, v in hashes.items()})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    online = tracking_reachable(root)
    exp_id, run_id = "", ""
    if online:
        exp_id = mlflow_setup(root)
        # A stale active run (e.g. from an earlier failure in this process) must not capture our logs.
        while mlflow.active_run() is not None:
            mlflow.end_run("KILLED")
        run_id = mlflow.start_run(experiment_id=exp_id, run_name=stage, tags=tags).info.run_id

    def attach(project_name: str, run_name: str | None) -> MLflowTracker:
        return MLflowTracker(project_name, run_name)  # the active stage run: attached, not owned

    tracker = _stage_tracker_class()(attach, spool_dir=root / SPOOL_DIR, project_name=experiment, run_name=stage,
                                     tracking_uri=uri)
    handle = StageRun(stage, root, run_id, exp_id, input_hashes=hashes, tracker=tracker)
    if handle.offline:  # provenance tags would be lost with the run: keep them as params
        tracker.log_params({f"tag.{k}": v for k, v in tags.items() if k != "mlflow.parentRunId"})
    started = time.time()

    def end(status: str) -> None:
        tracker.finish()
        if run_id and not handle.offline:  # (went offline mid-run: the next stage_run ends the stale run)
            with contextlib.suppress(Exception):
                mlflow.end_run(status)

    try:
        handle.log_params(public_params({f"{stage}.{k}": v for k, v in as_dict(params_section).items()}))
        yield handle
    except Preempted:
        end("KILLED")
        barrier()  # every rank stopped at the same step (the stop flag is all-reduced); the state is on disk
        raise
    except BaseException:
        end("FAILED")
        raise
    handle.summary.setdefault("seconds", round(time.time() - started, 1))
    tracker.log({"stage_seconds": time.time() - started})
    end("FINISHED")
    if handle.offline:
        handle.summary["tracking_spool"] = str(handle.spool_path)
        get_logger().warning("stage %s finished with tracking offline: upload %s with `make tracking-upload`",
                             stage, handle.spool_path)
    create_stage_artifact(handle)
    barrier()  # the other ranks leave only once the outputs and the run are complete


def create_stage_artifact(handle: StageRun) -> None:
    """A Prefect table artifact (the stage summary) and a markdown link to the MLflow run."""
    if not in_prefect_run():
        return
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = handle.stage.replace("_", "-")
    rows = [{"key": k, "value": (round(v, 4) if isinstance(v, float) else v)} for k, v in handle.summary.items()]
    create_table_artifact(rows, key=f"{key}-summary", description=f"{handle.stage}: summary")
    create_markdown_artifact(
        f"### {handle.stage}\n\nMLflow run: [{handle.run_id}]({handle.link})\n", key=f"{key}-mlflow",
        description=f"{handle.stage}: MLflow run link")


# --------------------------------------------------------------------------------------------
# training helpers shared by the stage tasks
# --------------------------------------------------------------------------------------------


SAVE_STEPS = 50
"""Trainer-based stages write a resumable checkpoint every this many optimizer steps (and on SIGTERM)."""


def training_arguments(output_dir: str | Path, section: Any, logging_steps: int = 10, **overrides):
    """``TrainingArguments`` for a stage: its section's Trainer fields, no reporters (metrics reach MLflow
    through rlhf_core's tracker, ``log_with=run.tracker``). Hardware comes from the environment / accelerate
    config, never from params.yaml. No checkpoints unless ``overrides`` ask (see ``checkpointing_arguments``);
    any keyword overrides the defaults here."""
    from transformers import TrainingArguments

    names = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "warmup_steps", "weight_decay", "seed")
    kwargs = {n: getattr(section, n) for n in names if hasattr(section, n)}
    kwargs.update(output_dir=str(output_dir), save_strategy="no", report_to=[], logging_steps=logging_steps,
                  disable_tqdm=not on_terminal(), dataloader_num_workers=0, dataloader_pin_memory=False)
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def checkpointing_arguments(save_steps: int = SAVE_STEPS) -> dict[str, Any]:
    """``training_arguments`` overrides for a resumable stage: periodic checkpoints, only the latest kept."""
    return {"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 1}


@contextlib.contextmanager
def resumable_training(stage: str, run: StageRun, params_section: Any) -> Iterator[Any]:
    """Resume and stop plumbing shared by the Trainer-based stages (sft, reward_model, dpo).

    Yields a ``Resumable``: ``.dir`` (the trainer's ``output_dir``: ``.checkpoints/<stage>-<hash of params and
    inputs>``), ``.callback`` (add to the trainer's callbacks) and ``.train(trainer)``, which resumes from the
    latest complete checkpoint, raises ``Preempted`` (exit status 75) when SIGTERM/SIGINT stopped it, and under
    data parallelism checks that every rank ended with the same weights. The
    caller deletes the directory (``.done()``, main process only) once its outputs are written.

    Under a launcher the stop request is agreed by all ranks (``AllRanksStopCallback``), every rank resumes from
    the checkpoint in ``.checkpoints/``, and only rank 0 writes there: the other ranks' ``output_dir`` is a private
    scratch directory outside the project (deleted at the end), so transformers' per-rank ``rng_state_<rank>.pth``
    of ranks > 0 is not kept and a resumed multi-process run is not bit-exact on those ranks (their RNG streams
    restart from the seed; rank 0's, the weights, the optimizer, the scheduler and the data position are exact).
    """
    from rlhf_core.checkpointing import GracefulStop, Preempted, latest_checkpoint, stage_checkpoint_dir
    from rlhf_core.trainers._hf_compat import GracefulStopCallback

    from tasks.distributed import any_process, check_replicas_identical

    class AllRanksStopCallback(GracefulStopCallback):
        """``GracefulStopCallback`` whose stop request is all-reduced at every step end: a signal that reached
        any rank stops every rank after the same step (a lone rank leaving would hang the others' DDP collectives).
        One small collective per optimizer step under a launcher; the plain callback in a single process."""

        def on_step_end(self, args, state, control, **kwargs):
            result = super().on_step_end(args, state, control, **kwargs)
            if any_process(self.stopped):
                control.should_save = True
                control.should_training_stop = True
                self.stopped = True
            return result

    directory = stage_checkpoint_dir(run.root, stage, {"params": as_dict(params_section), "inputs": run.input_hashes})
    log = get_logger()

    class Resumable:
        def __init__(self, stop: GracefulStop, output_dir: Path) -> None:
            self.dir = output_dir
            self.callback = AllRanksStopCallback(stop)

        def train(self, trainer: Any) -> Any:
            last = latest_checkpoint(directory)
            if last is not None:
                log.info("%s: resuming from %s", stage, last)
                run.summary["resumed_from"] = last.name
            result = trainer.train(resume_from_checkpoint=str(last) if last is not None else None)
            if self.callback.stopped and trainer.state.global_step < trainer.state.max_steps:
                step = trainer.state.global_step
                log.warning("%s: stopped at step %d; checkpoint in %s; run the stage again to resume",
                            stage, step, directory)
                raise Preempted(directory, step, self.callback.stop.signal_name if self.callback.stop else None)
            check_replicas_identical(trainer.accelerator, trainer.model, stage)  # launched (DDP): all ranks agree
            return result

        def done(self) -> None:
            if is_main_process():
                shutil.rmtree(directory, ignore_errors=True)

    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(GracefulStop())
        if is_main_process():
            output_dir = directory
        else:  # transformers would write this rank's RNG state into rank 0's checkpoint
            output_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-rank-")))
        yield Resumable(stop, output_dir)


def loss_curve(log_history: list[dict], keys: Iterable[str] = ("loss",)) -> list[dict]:
    """Rows ``{step, <key>...}`` from a Trainer's ``state.log_history`` (for plots/<stage>.csv)."""
    keys = tuple(keys)
    return [{"step": e["step"], **{k: e[k] for k in keys if k in e}} for e in log_history if "step" in e and keys[0] in e]
