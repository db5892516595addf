"""Shared plumbing for the stage tasks: MLflow parent/child runs, Prefect artifacts and logs, atomic writes.

MLflow default: a SQLite file ``mlflow.db`` in the project root with artifacts in ``mlartifacts/`` beside
it (both git-ignored). ``MLFLOW_TRACKING_URI`` overrides the store; ``RLHF_MLFLOW_EXPERIMENT`` the
experiment name; ``RLHF_MLFLOW_UI_URL`` the UI address used in Prefect artifact links.

One parent run per pipeline run (``pipeline_run``) and one child run per stage (``stage_run``). Each child
is tagged with the git commit, the DVC hashes of the stage's inputs and the Prefect flow-run id.
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
    logger.setLevel(logging.INFO)
    return logger


def on_terminal() -> bool:
    """Progress bars only when a person is watching."""
    return sys.stderr.isatty()


def progress(iterable: Iterable, **kwargs) -> Iterable:
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not on_terminal(), **kwargs)


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
    """Yield a temp dir beside ``target``; on success replace ``target`` with it, on error delete it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: str | Path, text: str) -> None:
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


def mlflow_setup(root: str | Path) -> str:
    """Point MLflow at the project store and return the experiment id (creating it if needed)."""
    import mlflow

    root = Path(root).resolve()
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}"
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
    """Create the parent MLflow run of one pipeline run; returns its id (the run is not made active)."""
    import mlflow

    exp_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    tags = {"rlhf.kind": "pipeline", "rlhf.entry": entry, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id(), "mlflow.runName": run_name or f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}"}
    run = client.create_run(exp_id, tags=tags)
    return run.info.run_id


def end_pipeline_run(root: str | Path, run_id: str, status: str = "FINISHED", summary: Mapping[str, Any] | None = None) -> None:
    import mlflow

    mlflow_setup(root)
    client = mlflow.MlflowClient()
    for key, value in (summary or {}).items():
        client.set_tag(run_id, f"rlhf.{key}", str(value)[:5000])
    client.set_terminated(run_id, status=status)


@dataclass
class StageRun:
    """Handle given to a stage body: the MLflow run plus a summary collected for the Prefect artifact."""

    stage: str
    root: Path
    run_id: str
    experiment_id: str
    summary: dict[str, Any] = field(default_factory=dict)
    input_hashes: dict[str, str] = field(default_factory=dict)

    @property
    def link(self) -> str:
        return mlflow_ui_link(self.experiment_id, self.run_id)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        import mlflow

        from rlhf_core.tracking import _mlflow_key, scalar_metrics

        clean = {_mlflow_key(k): v for k, v in scalar_metrics(metrics).items()}
        if clean:
            mlflow.log_metrics(clean, step=step)

    def log_table(self, name: str, rows: list[Mapping[str, Any]]) -> None:
        import mlflow

        if rows:
            columns = list(rows[0].keys())
            mlflow.log_table({c: [r[c] for r in rows] for c in columns}, artifact_file=f"tables/{name}.json")

    def log_dataset(self, path: str | Path, name: str, context: str = "training") -> None:
        """Log a JSONL dataset as an MLflow run input (source = its path, digest = its content)."""
        import mlflow
        import pandas as pd

        path = Path(path)
        import warnings

        df = pd.read_json(path, lines=True) if path.stat().st_size else pd.DataFrame()
        with warnings.catch_warnings():  # "source can be interpreted in multiple ways": both are local files
            warnings.simplefilter("ignore", UserWarning)
            ds = mlflow.data.from_pandas(df, source=str(path.resolve()), name=name)
        mlflow.log_input(ds, context=context)

    def write_model_card(self, model_dir: str | Path, trainer_name: str, base_model: str | None,
                         hyperparameters: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """Write README.md (rlhf_core's model card, with pipeline provenance as notes) and log it to MLflow."""
        import mlflow

        from rlhf_core.model_card import write_model_card

        notes = "\n".join(
            [f"Stage `{self.stage}` of the rlhf pipeline; git commit `{git_commit(self.root)}`; MLflow run `{self.run_id}`.",
             "", "Inputs (DVC hashes):", ""] + [f"- `{k}`: `{v}`" for k, v in self.input_hashes.items()]
            + ["", "The offline default trains on a synthetic corpus of generated reviews, not real data."])
        path = write_model_card(model_dir, model_name=f"rlhf-{self.stage}", trainer_name=trainer_name,
                                base_model=base_model, hyperparameters=dict(hyperparameters), metrics=dict(metrics),
                                notes=notes)
        mlflow.log_text(Path(path).read_text(), "model_card.md")


@contextlib.contextmanager
def stage_run(stage: str, root: str | Path, params_section: Any, deps: Iterable[str],
              parent_run_id: str | None = None) -> Iterator[StageRun]:
    """A child MLflow run for one stage, tagged with provenance; leaves a Prefect artifact when done."""
    import mlflow

    root = Path(root).resolve()
    exp_id = mlflow_setup(root)
    parent_run_id = parent_run_id or os.environ.get(PARENT_ENV) or None
    tags = {"rlhf.kind": "stage", "rlhf.stage": stage, "git.commit": git_commit(root),
            "prefect.flow_run_id": prefect_flow_run_id()}
    hashes = input_hashes(root, deps)
    tags.update({f"dvc.input.{k}": v for k, v in hashes.items()})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    # A stale active run (e.g. from an earlier failure in this process) must not capture our logs.
    while mlflow.active_run() is not None:
        mlflow.end_run("KILLED")
    run = mlflow.start_run(experiment_id=exp_id, run_name=stage, tags=tags)
    handle = StageRun(stage, root, run.info.run_id, exp_id, input_hashes=hashes)
    started = time.time()
    try:
        mlflow.log_params({f"{stage}.{k}": str(v)[:6000] for k, v in as_dict(params_section).items()})
        yield handle
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    handle.summary.setdefault("seconds", round(time.time() - started, 1))
    mlflow.log_metric("stage_seconds", time.time() - started)
    mlflow.end_run("FINISHED")
    create_stage_artifact(handle)


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


def training_arguments(output_dir: str | Path, section: Any, logging_steps: int = 10, **extra):
    """``TrainingArguments`` for a stage: its section's Trainer fields, no checkpoints, no reporters
    (metrics reach MLflow through rlhf_core's tracker, ``log_with="mlflow"``). Hardware comes from the
    environment / accelerate config, never from params.yaml."""
    from transformers import TrainingArguments

    names = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "warmup_steps", "weight_decay", "seed")
    kwargs = {n: getattr(section, n) for n in names if hasattr(section, n)}
    return TrainingArguments(
        output_dir=str(output_dir), save_strategy="no", report_to=[], logging_steps=logging_steps,
        disable_tqdm=not on_terminal(), dataloader_num_workers=0, dataloader_pin_memory=False, **kwargs, **extra)


def loss_curve(log_history: list[dict], keys: Iterable[str] = ("loss",)) -> list[dict]:
    """Rows ``{step, <key>...}`` from a Trainer's ``state.log_history`` (for plots/<stage>.csv)."""
    keys = tuple(keys)
    return [{"step": e["step"], **{k: e[k] for k in keys if k in e}} for e in log_history if "step" in e and keys[0] in e]
