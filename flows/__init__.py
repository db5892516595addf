"""Prefect flows: the whole pipeline, one stage (what dvc.yaml calls), and scheduled retraining."""

import os

# Telemetry off; our own loggers stream into the Prefect run alongside the flow/task loggers.
for _key, _value in {
    "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1", "PREFECT_LOGGING_EXTRA_LOGGERS": "rlhf_core,rlhf_pipeline",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    # a loaded 2-core machine can take longer than the default 20 s to start the temporary server
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}.items():
    os.environ.setdefault(_key, _value)
