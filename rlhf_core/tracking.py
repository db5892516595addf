"""Trackers: the small object through which trainers report metrics and tables.

Trainers only call ``log``/``log_table``/``log_params``; which backend receives them is chosen by
``log_with`` (``"mlflow"``, ``"tensorboard"`` or ``None``). Backends are imported lazily so
``rlhf_core`` imports on a machine without MLflow or TensorBoard.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

# Parameter names that look like credentials are never sent to a tracker.
SECRET_KEY_PATTERN = re.compile(r"(token|password|passwd|secret|api[_-]?key|credential)", re.IGNORECASE)


def scalar_metrics(stats: Mapping[str, Any]) -> dict[str, float]:
    """Keep the finite scalar entries of ``stats`` (tensors/arrays of one element included)."""
    scalars = {}
    for key, value in stats.items():
        if hasattr(value, "numel") and value.numel() == 1:
            value = value.item()
        elif hasattr(value, "size") and hasattr(value, "item") and getattr(value, "size") == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
            scalars[key] = float(value)
    return scalars


def public_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Drop parameters whose name looks like a secret (token, password, secret, api key)."""
    return {key: value for key, value in params.items() if not SECRET_KEY_PATTERN.search(str(key))}


class Tracker:
    """Base tracker: receives everything and keeps nothing (the ``log_with=None`` case)."""

    name = "null"

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log the scalar entries of ``metrics`` at ``step``."""

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int | None = None) -> None:
        """Log a table (e.g. query / response / reward samples)."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log run parameters (secret-looking keys are dropped)."""

    def finish(self) -> None:
        """Flush and close the backend."""


class NullTracker(Tracker):
    """Explicit no-op tracker."""


class MemoryTracker(Tracker):
    """Keeps everything in memory: useful in tests and notebooks."""

    name = "memory"

    def __init__(self) -> None:
        self.metrics: list[tuple[int | None, dict[str, float]]] = []
        self.tables: list[tuple[str, list[str], list[list[Any]], int | None]] = []
        self.params: dict[str, Any] = {}

    def log(self, metrics, step=None):
        self.metrics.append((step, scalar_metrics(metrics)))

    def log_table(self, name, columns, rows, step=None):
        self.tables.append((name, list(columns), [list(r) for r in rows], step))

    def log_params(self, params):
        self.params.update(public_params(params))


class MLflowTracker(Tracker):
    """Logs to the active MLflow run, or starts one in experiment ``project_name``."""

    name = "mlflow"

    def __init__(self, project_name: str = "trl", run_name: str | None = None, **kwargs: Any) -> None:
        import mlflow

        self._mlflow = mlflow
        self._owns_run = mlflow.active_run() is None
        if self._owns_run:
            mlflow.set_experiment(project_name)
            mlflow.start_run(run_name=run_name, **kwargs)

    def log(self, metrics, step=None):
        scalars = {_mlflow_key(k): v for k, v in scalar_metrics(metrics).items()}
        if scalars:
            self._mlflow.log_metrics(scalars, step=step)

    def log_table(self, name, columns, rows, step=None):
        data = {col: [row[i] for row in rows] for i, col in enumerate(columns)}
        suffix = f"_step{step}" if step is not None else ""
        self._mlflow.log_table(data=data, artifact_file=f"tables/{name}{suffix}.json")

    def log_params(self, params):
        clean = {_mlflow_key(k): str(v)[:6000] for k, v in public_params(params).items()}
        if clean:
            self._mlflow.log_params(clean)

    def finish(self):
        if self._owns_run and self._mlflow.active_run() is not None:
            self._mlflow.end_run()


class TensorBoardTracker(Tracker):
    """Writes scalars and text tables to a TensorBoard log directory."""

    name = "tensorboard"

    def __init__(self, project_name: str = "trl", logging_dir: str = "runs", **kwargs: Any) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=f"{logging_dir}/{project_name}", **kwargs)

    def log(self, metrics, step=None):
        for key, value in scalar_metrics(metrics).items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_table(self, name, columns, rows, step=None):
        header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
        body = "".join("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |\n" for row in rows)
        self._writer.add_text(name, header + body, global_step=step)

    def log_params(self, params):
        self._writer.add_text("params", "\n".join(f"{k}: {v}" for k, v in public_params(params).items()))

    def finish(self):
        self._writer.flush()
        self._writer.close()


TRACKERS = {"mlflow": MLflowTracker, "tensorboard": TensorBoardTracker, "memory": MemoryTracker}


def make_tracker(log_with: str | Tracker | None, project_name: str = "trl", **tracker_kwargs: Any) -> Tracker:
    """Build the tracker named by ``log_with`` (or pass a ready ``Tracker`` through)."""
    if isinstance(log_with, Tracker):
        return log_with
    if log_with is None:
        return NullTracker()
    if log_with not in TRACKERS:
        raise ValueError(f"log_with must be one of {sorted(TRACKERS)} or None, got {log_with!r}")
    if log_with == "memory":
        return MemoryTracker()
    return TRACKERS[log_with](project_name=project_name, **tracker_kwargs)


def _mlflow_key(key: str) -> str:
    """MLflow allows alphanumerics, ``_ - . / space`` and ``:`` in names; replace anything else."""
    return re.sub(r"[^0-9A-Za-z_\-. /:]", "_", key)
