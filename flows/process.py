"""The configuration of a pipeline process, set by each entry point (``python -m flows.<cli>``) before it loads torch:
:func:`configure_process`. And :func:`exit_promptly`, how a CLI leaves after a stop.

Nothing here happens on import: an entry point calls :func:`configure_process` first (its module does so under
``if __name__ == "__main__":``, before its own imports load torch: torch sizes its thread pool from
``OMP_NUM_THREADS`` when it loads, and picks its CPU kernels on first use).

The flows keep ``log_prints=False``: with it on, Prefect turns every ``print`` into a log record, including
the ones libraries capture for themselves (``datasets`` fingerprints a map function with dill, which reads
the function's globals from a captured ``dis.dis`` printout: pages of bytecode landed in the run log).
Stages report through loggers (``rlhf_core``, ``rlhf_pipeline``), which do reach the Prefect run.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import MutableMapping
from pathlib import Path

from rlhf_core.tracking import install_log_redaction
from tasks.process.logs import quiet_known_messages

ENVIRONMENT_DEFAULTS = {
    # telemetry off; our own loggers stream into the Prefect run alongside the flow/task loggers
    "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1", "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core,rlhf_pipeline",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # one CPU thread, as the Makefile sets it, unless the environment says otherwise: torch's result bits depend on
    # the thread count, so a plain `dvc repro` on a 2-core machine wrote other weights (other hashes) than `make run`
    "OMP_NUM_THREADS": "1",
    # no "Loading weights"/"Map"/"Downloading artifacts" bars (the registry logs and re-reads models): one progress
    # bar per training stage (tasks/process/logs.py), none off a terminal
    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    # a loaded 2-core machine can take longer than the default 20 s to start the temporary server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # a tracking server that dies mid-stage: fail over to the spool in seconds, not 4 minutes of client retries
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    # a CLI's own log lines outside a flow run (intake, the end block) are not flow-run logs: no UserWarning that
    # they cannot be sent to the API (they still print); inside a flow run, logs stream as before
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}
"""Set in the environment unless it already holds the variable (a user's own choice wins)."""

CHECKOUT = Path(__file__).resolve().parents[1]
"""The checkout whose code runs (every entry point runs the code of the project it serves)."""


def prefect_settings(checkout: Path = CHECKOUT) -> dict[str, str]:
    """The per-project Prefect home: ``<checkout>/.prefect`` (its database, hence the runs the UI shows), so the runs
    of two checkouts never mix in one ``~/.prefect`` database (issue 33). The user's Prefect profiles still apply
    (``~/.prefect/profiles.toml``: a ``prefect config set`` made before keeps working). ``make prefect-ui`` serves
    the same home (the Makefile sets the same two variables)."""
    return {"PREFECT_HOME": str(checkout / ".prefect"),
            "PREFECT_PROFILES_PATH": str(Path.home() / ".prefect" / "profiles.toml")}

PORTABLE_CPU_KERNELS = {
    # ATen's vectorised kernels (elementwise ops, softmax, layer norm, torch.randn's normal fill): AVX2 on every
    # AVX2 machine, instead of AVX-512 code on machines that have it (other rounding, other initial weights)
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL's sgemm: the one code branch MKL documents as giving the same bits on Intel and AMD ("COMPATIBLE";
    # MKL_CBWR=AVX2 is honoured on Intel only and falls back to the native branch on AMD)
    "MKL_CBWR": "COMPATIBLE",
    # oneDNN (bf16 matmuls, some fused ops): no AVX-512/AMX kernels
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""The CPU kernel pins of the pipeline's entry points: with them (and one thread) a stage writes the same bytes on
every x86-64 CPU with AVX2, AMD or Intel, AVX-512/AMX or not (docs/pipeline.md, "Same bytes on every CPU").
Measured cost on the default pipeline: docs/pipeline.md. ``RLHF_CPU_KERNELS=native`` leaves the environment as
it is (fastest kernels of the machine; outputs then differ between CPU kinds in the last bits)."""


def pin_cpu_kernels(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :data:`PORTABLE_CPU_KERNELS` in ``environ`` (overriding: a machine's own choice is what they pin) unless
    ``RLHF_CPU_KERNELS=native``; returns what was set. Must run before torch first runs a kernel."""
    mode = environ.get("RLHF_CPU_KERNELS", "portable")
    if mode not in ("portable", "native"):
        raise ValueError(f"RLHF_CPU_KERNELS={mode!r}: use 'portable' (default, same bytes on every CPU) or 'native'")
    if mode == "native":
        return {}
    environ.update(PORTABLE_CPU_KERNELS)
    return dict(PORTABLE_CPU_KERNELS)


def configure_process(environ: MutableMapping[str, str] = os.environ) -> None:
    """Everything a pipeline process needs before it does anything: :data:`ENVIRONMENT_DEFAULTS`, the project's own
    Prefect home unless one is set (:func:`prefect_settings`), the CPU kernel pins
    (:func:`pin_cpu_kernels`), credentials in tracking URIs redacted from every log, and known harmless third-party
    messages dropped (``tasks/process/logs.py``: ``KNOWN_HARMLESS`` says why each). Idempotent."""
    for key, value in ENVIRONMENT_DEFAULTS.items():
        environ.setdefault(key, value)
    if "PREFECT_HOME" not in environ:  # a home the user chose keeps its own profiles too
        environ.update(prefect_settings())
    pin_cpu_kernels(environ)
    configure_logging()


def configure_logging() -> None:
    """The in-process part of :func:`configure_process`: credentials in tracking URIs redacted from every log, known
    harmless third-party messages dropped. Idempotent. A deployed flow (``prefect.yaml``'s entry points) calls it
    first: Prefect's worker imports its module in a new process, which inherits the environment from the worker
    (``flows/serve.py`` configures it) but not the worker's logging filters."""
    install_log_redaction()  # credentials in MLFLOW_TRACKING_URI never reach the Prefect log or stderr
    quiet_known_messages()


def exit_promptly(code: int, drain_s: float = 2.0, server_grace_s: float = 2.0) -> None:
    """End the process now with exit status ``code``, skipping the interpreter's teardown (issue 12.5).

    Only for a run whose work is done (a stop: state saved, MLflow runs ended KILLED). Prefect's queued logs and
    events are sent (at most ``drain_s`` seconds), its temporary server is stopped (SIGTERM, SIGKILL after
    ``server_grace_s``), the standard streams are flushed, then ``os._exit``. Measured after a SIGINT on a loaded
    2-core machine: the ordinary exit spent 10-20 s past this point, mostly in the interpreter's teardown
    after the ``atexit`` hooks (no Python frame running), the rest in Prefect's server wait.
    Further SIGINT/SIGTERM are ignored meanwhile: the exit is bounded and a second Ctrl-C must not leave the
    server behind.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from prefect.events.worker import EventsWorker  # prefect: only on the way out of a stopped run
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):  # while the server still runs
            worker.drain_all(timeout=drain_s)
    except Exception as error:  # noqa: BLE001 - lost log lines must not keep the process alive
        print(f"warning: Prefect logs not flushed at exit: {error}", file=sys.stderr)
    from tasks.run.orphans import stop_temporary_server  # loads torch: this module must load before torch does

    stop_temporary_server(grace_s=server_grace_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


__all__ = ["ENVIRONMENT_DEFAULTS", "PORTABLE_CPU_KERNELS", "configure_logging", "configure_process", "exit_promptly", "pin_cpu_kernels",
           "prefect_settings"]
