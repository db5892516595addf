"""Prefect flows: the whole pipeline, one stage (what dvc.yaml calls), and scheduled retraining.

The flows keep ``log_prints=False``: with it on, Prefect turns every ``print`` into a log record, including
the ones libraries capture for themselves (``datasets`` fingerprints a map function with dill, which reads
the function's globals from a captured ``dis.dis`` printout: pages of bytecode landed in the run log).
Stages report through loggers (``rlhf_core``, ``rlhf_pipeline``), which do reach the Prefect run.

``exit_promptly`` is how a CLI leaves after a stop (exit 75): in seconds, with no server left behind.
"""

import os

# Telemetry off; our own loggers stream into the Prefect run alongside the flow/task loggers.
for _key, _value in {
    "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1", "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core,rlhf_pipeline",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # one CPU thread, as the Makefile sets it, unless the environment says otherwise: torch's result bits depend on
    # the thread count, so a plain `dvc repro` on a 2-core machine wrote other weights (other hashes) than `make run`
    "OMP_NUM_THREADS": "1",
    # no "Loading weights"/"Map" bars: one progress bar per training stage (tasks/logs.py), none off a terminal
    "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    # a loaded 2-core machine can take longer than the default 20 s to start the temporary server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    # a tracking server that dies mid-stage: fail over to the spool in seconds, not 4 minutes of client retries
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}.items():
    os.environ.setdefault(_key, _value)

from rlhf_core.tracking import install_log_redaction  # noqa: E402

install_log_redaction()  # credentials in MLFLOW_TRACKING_URI never reach the Prefect log or stderr


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
    import signal
    import sys

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):  # while the server still runs
            worker.drain_all(timeout=drain_s)
    except Exception as error:  # noqa: BLE001 - lost log lines must not keep the process alive
        print(f"warning: Prefect logs not flushed at exit: {error}", file=sys.stderr)
    from tasks.orphans import stop_temporary_server

    stop_temporary_server(grace_s=server_grace_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)
