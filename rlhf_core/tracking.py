"""Trackers: the small object through which trainers report metrics and tables.

Trainers only call ``log``/``log_table``/``log_params`` (and a DDPO image hook ``log_images``, as on accelerate's
trackers, which TRL 0.11's ``image_samples_hook`` receives); which backend receives them is chosen by
``log_with`` (``"mlflow"``, ``"tensorboard"`` or ``None``). Backends are imported lazily so
``rlhf_core`` imports on a machine without MLflow or TensorBoard.

Tracking outages never stop training: ``make_tracker("mlflow")`` returns a ``SpoolingTracker`` that, when the
tracking server is unreachable (at start or mid-run), warns once and appends everything still to be logged
(params, metrics with their steps, tables) to a local JSONL spool. Only a connection failure counts as an outage
(:func:`is_connection_failure`); any other backend error is raised at start and reported (warning + log, naming the
call) during the run. Tensor and numpy values in metrics and table cells are converted, never an error. Replay a
spool afterwards with :func:`upload_spool` (the pipeline's command line: ``make tracking-upload``).
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path
from urllib.parse import urlparse
from collections.abc import Mapping, Sequence
from typing import Any

# Parameter names that look like credentials are never sent to a tracker. Whole words of the name, not substrings:
# ``hub_token`` and ``db_password`` are secrets, ``max_new_tokens`` and ``pad_token_id`` are not (issue 12.6).
SECRET_WORDS = frozenset({"password", "passwd", "passphrase", "secret", "credential", "credentials", "apikey"})
SECRET_WORD_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("auth", "key")})


def is_secret_name(name: Any) -> bool:
    """True for a parameter name that names a credential: a secret word anywhere (``SECRET_thing``), ``token`` as
    the last word (``hf_token``, ``accessToken``) or an ``api key``-like pair; words split at ``_ . - /`` and case."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name))
    words = [w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w]
    return (any(w in SECRET_WORDS for w in words) or (bool(words) and words[-1] == "token")
            or any(pair in SECRET_WORD_PAIRS for pair in zip(words, words[1:])))


def scalar_metrics(stats: Mapping[str, Any]) -> dict[str, float]:
    """Keep the finite scalar entries of ``stats`` (tensors/arrays of one element and numeric strings included)."""
    scalars = {}
    for key, value in stats.items():
        value = plain_value(value)
        if isinstance(value, str):  # "0.5" is a number; "abc" is not a metric
            try:
                value = float(value)
            except ValueError:
                continue
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
            scalars[key] = float(value)
    return scalars


def plain_value(value: Any) -> Any:
    """A tensor or numpy value as plain Python: one element -> its number, more -> nested lists; the rest as is."""
    if not (hasattr(value, "tolist") and hasattr(value, "dtype")):  # torch tensors, numpy arrays and scalars
        return value
    if hasattr(value, "detach"):
        value = value.detach().cpu()
    return value.reshape(-1).tolist()[0] if _numel(value) == 1 else value.tolist()


def _numel(value: Any) -> int:
    return value.numel() if callable(getattr(value, "numel", None)) else int(getattr(value, "size", 1))


def public_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Drop parameters whose name looks like a secret (token, password, secret, api key), at any depth
    (``tracker_kwargs={"api_key": ...}`` inside a config loses its ``api_key``)."""
    return {key: public_params(value) if isinstance(value, Mapping) else value
            for key, value in params.items() if not is_secret_name(key)}


class Tracker:
    """Base tracker: receives everything and keeps nothing (the ``log_with=None`` case)."""

    name = "null"

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log the scalar entries of ``metrics`` at ``step``."""

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int | None = None) -> None:
        """Log a table (e.g. query / response / reward samples)."""

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log run parameters (secret-looking keys are dropped)."""

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log named images (CHW or HWC tensors / arrays, floats in [0, 1] or uint8, or PIL images), as
        accelerate's trackers do: the call TRL 0.11's DDPO example makes from its ``image_samples_hook``."""

    def finish(self) -> None:
        """Flush and close the backend."""


def image_array(value: Any) -> Any:
    """An image as a HWC uint8 numpy array: from a PIL image, a (1,)C,H,W tensor or a H,W,C array (either layout
    when the shape is unambiguous) whose floats are in [0, 1] (clipped) or whose values are uint8 already."""
    import numpy as np

    if hasattr(value, "convert") and hasattr(value, "size"):  # a PIL image
        return np.asarray(value.convert("RGB"))
    is_tensor = hasattr(value, "detach")
    array = value.detach().float().cpu().numpy() if is_tensor else np.asarray(value)
    if array.ndim == 4 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 3:
        raise ValueError(f"log_images: an image must be C,H,W or H,W,C (or 1,C,H,W), got shape {array.shape}")
    # channels first for a tensor (torch's layout), last for an array (numpy's), unless the shape says otherwise
    channels_first = array.shape[0] in (1, 3, 4) and (is_tensor or array.shape[-1] not in (1, 3, 4))
    if channels_first:
        array = array.transpose(1, 2, 0)  # CHW -> HWC
    if array.dtype != np.uint8:
        array = (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)
    return array


class NullTracker(Tracker):
    """Explicit no-op tracker."""


class MemoryTracker(Tracker):
    """Keeps everything in memory: useful in tests and notebooks."""

    name = "memory"

    def __init__(self) -> None:
        self.metrics: list[tuple[int | None, dict[str, float]]] = []
        self.tables: list[tuple[str, list[str], list[list[Any]], int | None]] = []
        self.params: dict[str, Any] = {}
        self.images: list[tuple[int | None, dict[str, Any]]] = []

    def log(self, metrics, step=None):
        self.metrics.append((step, scalar_metrics(metrics)))

    def log_images(self, values, step=None, **kwargs):
        self.images.append((step, {name: image_array(v) for name, v in values.items()}))

    def log_table(self, name, columns, rows, step=None):
        self.tables.append((name, list(columns), [list(r) for r in rows], step))

    def log_params(self, params):
        self.params.update(public_params(params))


def _table_cell(value: Any) -> Any:
    """A table cell MLflow can store: numbers and strings as they are, tensors/arrays converted, the rest as text."""
    value = plain_value(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return json.dumps(value) if isinstance(value, list) else str(value)


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
        self.run_id = mlflow.active_run().info.run_id
        self._table_list_full = False  # see _table_list_has_room

    # Every call names its run: MLflow's active run is per thread, and a fluent call that finds none (another
    # thread, or after the run ended) silently starts a new, untagged run instead of logging to ours.
    def log(self, metrics, step=None):
        scalars = {_mlflow_key(k): v for k, v in scalar_metrics(metrics).items()}
        if scalars:
            self._mlflow.log_metrics(scalars, step=step, run_id=self.run_id)

    def log_table(self, name, columns, rows, step=None):
        data = {col: [_table_cell(row[i]) for row in rows] for i, col in enumerate(columns)}
        artifact = table_artifact_file(name, step)
        if self._table_list_has_room(artifact):
            self._mlflow.log_table(data=data, artifact_file=artifact, run_id=self.run_id)
            return
        # the same JSON file log_table writes (pandas "split" orient), not added to the run's list of tables
        import pandas as pd

        text = pd.DataFrame(data, columns=list(columns)).to_json(orient="split", index=False, date_format="iso")
        self._mlflow.log_text(text, artifact, run_id=self.run_id)

    def _table_list_has_room(self, artifact: str) -> bool:
        """Whether MLflow can still list ``artifact`` among the run's tables. ``mlflow.log_table`` appends every
        table to the run's ``mlflow.loggedArtifacts`` tag, a JSON list, and the store cuts a tag's value at 8,000
        characters: after ~130 tables (one per PPO step) the list no longer parses and every later ``log_table``
        raises. Past that point the tables are written as the same JSON artifacts, unlisted (once, a warning)."""
        from mlflow.utils.mlflow_tags import MLFLOW_LOGGED_ARTIFACTS
        from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

        if self._table_list_full:  # the list only grows: once full, full (no round trip to the store)
            return False
        listed = self._mlflow.get_run(self.run_id).data.tags.get(MLFLOW_LOGGED_ARTIFACTS, "[]")
        entry = json.dumps({"path": artifact, "type": "table"})
        if len(listed) + len(entry) + 2 <= MAX_TAG_VAL_LENGTH:
            return True
        self._table_list_full = True
        logging.getLogger(__name__).warning(
            "tracking: run %s lists as many tables as MLflow's %d-character tag holds; %s and later tables are "
            "artifacts under tables/ (Artifacts tab), not in the run's table list", self.run_id, MAX_TAG_VAL_LENGTH,
            artifact)
        return False

    def log_params(self, params):
        clean = {_mlflow_key(k): str(v)[:6000] for k, v in public_params(params).items()}
        if clean:
            self._mlflow.log_params(clean, run_id=self.run_id)

    def log_images(self, values, step=None, **kwargs):
        for name, value in values.items():
            suffix = f"_step{int(step):06d}" if step is not None else ""
            self._mlflow.log_image(image_array(value), artifact_file=f"images/{_safe_name(name)}{suffix}.png",
                                   run_id=self.run_id)

    def finish(self):
        active = self._mlflow.active_run()
        if self._owns_run and active is not None and active.info.run_id == self.run_id:
            self._mlflow.end_run()


def table_artifact_file(name: str, step: int | None) -> str:
    """MLflow artifact path of a table: ``tables/<name>_step000012.json`` (zero-padded, so the UI lists the
    steps in order), ``tables/<name>.json`` without a step."""
    return f"tables/{name}_step{int(step):06d}.json" if step is not None else f"tables/{name}.json"


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

    def log_images(self, values, step=None, **kwargs):
        for name, value in values.items():
            self._writer.add_image(name, image_array(value), global_step=step, dataformats="HWC")

    def log_params(self, params):
        self._writer.add_text("params", "\n".join(f"{k}: {v}" for k, v in public_params(params).items()))

    def finish(self):
        self._writer.flush()
        self._writer.close()


DEFAULT_SPOOL_DIR = "tracking-spool"
"""Where a ``SpoolingTracker`` keeps what it could not send, unless ``spool_dir``/``$RLHF_TRACKING_SPOOL_DIR`` says."""


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "dtype"):
        return _json_safe(plain_value(value))
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/\s@'\"]+)@")


def redact(text: Any) -> str:
    """``text`` with the credentials of any URL in it (``https://user:pass@host``) replaced by ``***``: tracking
    URIs reach spool files, warnings and logs (issue 12.6)."""
    return _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}***@", str(text))


class RedactingFilter(logging.Filter):
    """A logging filter that removes URL credentials from every record of the logger it is attached to."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return True


REDACTED_LOGGERS = ("rlhf_core", "rlhf_pipeline", "prefect.flow_runs", "prefect.task_runs", "mlflow")
"""The loggers whose records can carry a tracking URI (our stages' and the Prefect run loggers)."""


def install_log_redaction(names: Sequence[str] = REDACTED_LOGGERS) -> None:
    """Attach one :class:`RedactingFilter` to each logger in ``names`` (idempotent)."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())


def server_reachable(uri: str | None, timeout: float = 2.0) -> bool:
    """False when ``uri`` is an http(s) tracking server that refuses or times out a TCP connection, or a SQLite
    store that another process keeps locked for longer than :func:`sqlite_lock_wait` seconds."""
    if not uri:
        return True
    database = sqlite_path(uri)
    if database is not None:
        return sqlite_lock_free(database)
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return True  # other local stores (file) have no server to lose
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


SQLITE_LOCK_WAIT_ENV = "RLHF_TRACKING_LOCK_WAIT_S"
"""Seconds to wait for a SQLite tracking store that another process holds locked (default 30) before spooling."""
_locked: dict[Path, float] = {}  # database -> when a full wait for it last ended locked


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` tracking URI (None for other stores and in-memory databases)."""
    if not uri.startswith("sqlite:///") or uri.rstrip("/") == "sqlite:":
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def env_seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (``default`` when unset; negative values count as 0); a bad
    value is an error naming the variable."""
    text = os.environ.get(name, "").strip()
    try:
        return max(0.0, float(text)) if text else default
    except ValueError:
        raise ValueError(f"${name}: expected seconds, got {text!r}") from None


def sqlite_lock_wait() -> float:
    """``$RLHF_TRACKING_LOCK_WAIT_S`` seconds (default 30)."""
    return env_seconds(SQLITE_LOCK_WAIT_ENV, 30.0)


def sqlite_lock_free(database: Path) -> bool:
    """Whether a write transaction on ``database`` can start within :func:`sqlite_lock_wait` seconds (SQLite's own
    busy wait; True for a file that does not exist yet). After a wait that ended locked, the next checks for
    the same file wait at most half a second until that many seconds have passed: one outage, one long wait."""
    import sqlite3

    if not database.is_file():
        return True
    wait = sqlite_lock_wait()
    if time.monotonic() - _locked.get(database, -math.inf) < wait:
        wait = min(wait, 0.5)
    try:
        connection = sqlite3.connect(database, timeout=wait)
        try:
            connection.execute("BEGIN IMMEDIATE")  # the lock a write needs; nothing is written
            connection.rollback()
        finally:
            connection.close()
    except sqlite3.OperationalError:  # locked past the wait, or the file cannot be opened
        _locked[database] = time.monotonic()
        return False
    _locked.pop(database, None)
    return True


def outage_reason(uri: str | None, error: BaseException | None = None) -> str:
    """One line saying which tracking store is out and why (``error``: what the failing call raised)."""
    database = sqlite_path(uri or "")
    if database is None:
        return f"tracking server {redact(uri)} unreachable" + (f" ({type(error).__name__})" if error else "")
    words = next((w for w in STORE_UNAVAILABLE_WORDS if error is not None and w in str(error)), "database is locked")
    return f"tracking store {database} unavailable ({words})"


STORE_UNAVAILABLE_WORDS = ("database is locked", "attempt to write a readonly database",
                           "unable to open database file", "disk I/O error")
"""What SQLite says (through SQLAlchemy and MLflow) when a local store is locked by another process past the busy
wait, was deleted or moved while open (SQLite then refuses writes as read-only), or its disk failed: an outage of
the store, spooled like an unreachable server."""

CONNECTION_ERRORS = frozenset({"ConnectionError", "ConnectTimeout", "ReadTimeout", "Timeout", "RetryError",
                               "MaxRetryError", "NewConnectionError", "ProtocolError", "RemoteDisconnected"})
"""Exception class names (builtins, requests, urllib3, http.client) that mean the server cannot be reached."""
UNREACHABLE_WORDS = ("Max retries exceeded", "Connection refused", "Failed to establish a new connection",
                     "Connection aborted", "Connection reset", "failed with timeout exception")
"""What MLflow's REST client says when it wraps a connection failure in an ``MlflowException``."""


def is_connection_failure(error: BaseException) -> bool:
    """True when ``error``, or an error it was raised from, means the tracking server cannot be reached
    (refused, reset, timed out, retries exhausted), or a local SQLite store cannot be written (locked by another
    process, deleted while open: ``STORE_UNAVAILABLE_WORDS``). A server that answers with an error is not an outage."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {cls.__name__ for cls in type(current).__mro__}
        if isinstance(current, (ConnectionError, TimeoutError)) or names & CONNECTION_ERRORS:
            return True
        if "MlflowException" in names and any(words in str(current) for words in UNREACHABLE_WORDS):
            return True
        if names & {"MlflowException", "OperationalError"} and any(w in str(current) for w in STORE_UNAVAILABLE_WORDS):
            return True
        current = current.__cause__ or current.__context__
    return False


class SpoolingTracker(Tracker):
    """A tracker that survives outages: calls go to ``backend`` until the server cannot be reached, then to a
    JSONL spool.

    ``backend_factory`` builds the real tracker (it may fail itself: the server may be down at start). After
    the first connection failure (:func:`is_connection_failure`) the run stays on the spool (no retry storms
    slowing training), a single warning names the spool file and the upload command, and ``finish`` repeats the
    reminder. Any other backend error is not an outage: at start it is raised; during the run the call's data is
    not logged, a warning names the call and the error, and the run stays online.

    Public hooks for subclasses: ``spool_file_name()`` (the spool's file name), ``offline_message(error)`` (the
    warning), ``on_offline(error)`` (called once, when the run first goes offline), ``remind_on_finish`` (False:
    ``finish`` gives no second warning). ``go_offline(error)`` is how a caller that hit an outage on a side
    channel (an artifact upload, say) moves the run onto the spool; ``backend_failed(error, what)`` classifies
    a side channel's error first (True: an outage, now spooled).
    """

    remind_on_finish: bool = True
    """Whether ``finish`` repeats the "upload the spool" warning."""

    def __init__(self, backend_factory: Any, spool_dir: str | Path | None = None, project_name: str = "trl",
                 run_name: str | None = None, tracking_uri: str | None = None) -> None:
        self.name = getattr(backend_factory, "name", "mlflow")
        self.project_name, self.run_name, self.tracking_uri = project_name, run_name, tracking_uri
        self.spool_dir = Path(spool_dir or os.environ.get("RLHF_TRACKING_SPOOL_DIR") or DEFAULT_SPOOL_DIR)
        self.spool_path: Path | None = None
        self.backend: Tracker | None = None
        self.run_id: str | None = None
        if not server_reachable(tracking_uri):
            self.go_offline(ConnectionError(f"tracking server {redact(tracking_uri)} refuses connections"))
            return
        try:
            self.backend = backend_factory(project_name=project_name, run_name=run_name)
            self.run_id = getattr(self.backend, "run_id", None)
        except Exception as error:  # noqa: BLE001 - only an outage is spooled; anything else is a real error
            if not is_connection_failure(error):
                raise
            self.go_offline(error)

    @property
    def offline(self) -> bool:
        return self.backend is None

    def go_offline(self, error: BaseException) -> None:
        """Drop the backend and keep everything from now on in the spool (opened, with one warning, the first time)."""
        self.backend = None
        if self.spool_path is not None:
            return
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.spool_path = self.spool_dir / self.spool_file_name()
        self._append({"kind": "run", "project_name": self.project_name, "run_name": self.run_name,
                      "run_id": self.run_id, "tracking_uri": redact(self.tracking_uri), "error": repr(error)[:500]})
        warnings.warn(redact(self.offline_message(error)), RuntimeWarning, stacklevel=3)
        self.on_offline(error)

    def on_offline(self, error: BaseException) -> None:
        """Hook: called once, right after the run went offline and its spool was opened (default: nothing)."""

    def spool_file_name(self) -> str:
        """Name of this run's spool file (subclasses may name it after a stage)."""
        return f"{_safe_name(self.project_name)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.jsonl"

    def offline_message(self, error: BaseException) -> str:
        """The one warning given when the backend is unreachable."""
        return (f"tracking backend unreachable ({type(error).__name__}: {str(error)[:200]}); training continues and "
                f"everything is kept in {self.spool_path}. Upload it later with: "
                f"rlhf_core.tracking.upload_spool({str(self.spool_path)!r})")

    def _append(self, record: dict[str, Any]) -> None:
        record = {"time": time.time(), **record}
        with open(self.spool_path, "a", encoding="utf-8") as fh:
            fh.write(redact(json.dumps(_json_safe(record))) + "\n")  # no credentials on disk
            fh.flush()
            os.fsync(fh.fileno())

    def spool_text(self, text: str, artifact_file: str) -> None:
        """Keep an artifact's text (a model card) in the spool; replayed with ``log_text`` (the run is offline)."""
        self._append({"kind": "text", "artifact_file": artifact_file, "text": text})

    def spool_file(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Keep a copy of an artifact file (or folder) beside the spool (``<spool>.files/<n>/<its name>``); replayed
        with ``log_artifact``."""
        path = Path(path)
        files = self.spool_path.with_name(self.spool_path.name + ".files")
        files.mkdir(exist_ok=True)
        copy = files / f"{len(list(files.iterdir())):04d}" / path.name
        copy.parent.mkdir()
        shutil.copy2(path, copy) if path.is_file() else shutil.copytree(path, copy)
        self._append({"kind": "artifact", "file": str(copy.relative_to(files)), "artifact_path": artifact_path})

    def backend_failed(self, error: BaseException, what: str) -> bool:
        """Handle a failed backend call: an outage switches the run to the spool (True: keep the data there);
        any other error is reported as what it is, with the call it lost (False: the run stays online)."""
        if is_connection_failure(error):
            self.go_offline(error)
            return True
        message = (f"tracking: {what} was not logged to {self.name}: {type(error).__name__}: {str(error)[:300]} "
                   "(the tracking server answered: this is not an outage; the run stays online)")
        logging.getLogger(__name__).error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return False

    def _call(self, method: str, record: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if self.backend is not None:
            try:
                getattr(self.backend, method)(*args, **kwargs)
                return
            except Exception as error:  # noqa: BLE001 - classified: outage -> spool, other -> reported
                if not self.backend_failed(error, f"{method} {record.get('name') or ''}".strip()):
                    return
        self._append(record)

    def log(self, metrics, step=None):
        scalars = scalar_metrics(metrics)
        if scalars or self.backend is not None:
            self._call("log", {"kind": "metrics", "step": step, "data": scalars}, metrics, step=step)

    def log_table(self, name, columns, rows, step=None):
        record = {"kind": "table", "name": name, "columns": list(columns), "rows": [list(r) for r in rows],
                  "step": step}
        self._call("log_table", record, name, columns, rows, step=step)

    def log_params(self, params):
        clean = public_params(params)
        self._call("log_params", {"kind": "params", "data": clean}, clean)

    def log_images(self, values, step=None, **kwargs):
        # offline, the spool keeps only the names (pixels are no JSON); upload_spool skips the record
        self._call("log_images", {"kind": "images", "names": list(values), "step": step}, values, step=step)

    def finish(self):
        if self.backend is not None:
            try:
                self.backend.finish()
            except Exception as error:  # noqa: BLE001 - classified as in _call
                self.backend_failed(error, "finish")
        if self.spool_path is not None:
            self._append({"kind": "finish"})
            if not self.remind_on_finish:
                return
            warnings.warn(f"tracking data for this run is in {self.spool_path}: upload it with "
                          f"rlhf_core.tracking.upload_spool({str(self.spool_path)!r})", RuntimeWarning, stacklevel=2)


def _safe_name(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z_.-]", "_", name)[:80] or "run"


def _mlflow_spooling(project_name: str = "trl", run_name: str | None = None, spool_dir: str | Path | None = None,
                     **kwargs: Any) -> SpoolingTracker:
    import mlflow

    factory = lambda project_name, run_name: MLflowTracker(project_name, run_name, **kwargs)  # noqa: E731
    factory.name = "mlflow"
    return SpoolingTracker(factory, spool_dir, project_name, run_name, mlflow.get_tracking_uri())


def upload_spool(spool: str | Path, tracking_uri: str | None = None, run_id: str | None = None) -> str:
    """Replay a spool file into MLflow (``run_id``, else the run it was logging to, else a new run in its experiment:
    also when that run is not in this store, e.g. a store started anew after the old one was lost); returns the
    run id.

    The spool is renamed ``*.uploaded`` afterwards so it is never replayed twice.
    """
    import mlflow

    spool = Path(spool)
    records = [json.loads(line) for line in spool.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not records or records[0].get("kind") != "run":
        raise ValueError(f"{spool}: not a tracking spool (first line must be a 'run' record)")
    header = records[0]
    if tracking_uri:
        mlflow.set_tracking_uri(tracking_uri)
    client = mlflow.MlflowClient()
    run_id = run_id or (header.get("run_id") if _run_exists(client, header.get("run_id")) else None)
    if run_id is None:
        experiment = client.get_experiment_by_name(header["project_name"])
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(header["project_name"])
        run_id = client.create_run(experiment_id, run_name=header.get("run_name"),
                                   tags={"rlhf.uploaded_from": str(spool)}).info.run_id
    from mlflow.entities import Metric, Param

    for record in records[1:]:
        kind, ms = record["kind"], int(record["time"] * 1000)
        if kind == "metrics":
            metrics = [Metric(_mlflow_key(k), v, ms, record["step"] or 0) for k, v in record["data"].items()]
            if metrics:
                client.log_batch(run_id, metrics=metrics)
        elif kind == "params":
            params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in record["data"].items()]
            if params:
                client.log_batch(run_id, params=params)
        elif kind == "table":
            data = {c: [row[i] for row in record["rows"]] for i, c in enumerate(record["columns"])}
            client.log_table(run_id, data=data, artifact_file=table_artifact_file(record["name"], record["step"]))
        elif kind == "text":
            client.log_text(run_id, record["text"], record["artifact_file"])
        elif kind == "artifact":
            copy = spool.with_name(spool.name + ".files") / record["file"]
            if copy.is_dir():  # a folder lands under its own name, as log_artifact puts it
                folder = "/".join(filter(None, [record.get("artifact_path"), copy.name]))
                client.log_artifacts(run_id, str(copy), folder)
            else:
                client.log_artifact(run_id, str(copy), record.get("artifact_path"))
    if any(r["kind"] == "finish" for r in records) and client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id)
    spool.rename(spool.with_name(spool.name + ".uploaded"))
    files = spool.with_name(spool.name + ".files")
    if files.is_dir():
        files.rename(files.with_name(spool.name + ".uploaded.files"))
    return run_id


def _run_exists(client: Any, run_id: str | None) -> bool:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return False
    try:
        client.get_run(run_id)
    except MlflowException as error:
        if getattr(error, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise
    return True


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
    if log_with == "mlflow":
        return _mlflow_spooling(project_name=project_name, **tracker_kwargs)
    return TRACKERS[log_with](project_name=project_name, **tracker_kwargs)


def _mlflow_key(key: str) -> str:
    """MLflow allows alphanumerics, ``_ - . / space`` and ``:`` in names; replace anything else."""
    return re.sub(r"[^0-9A-Za-z_\-. /:]", "_", key)

