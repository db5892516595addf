"""Serve the champion: ``python -m flows.serve_model`` (``make serve-model``), on http://127.0.0.1:5001.

Writes the served model (``tasks/serving/alias_server.py``: code and settings, no weights) to ``.serve/policy-server`` and
then becomes MLflow's scoring server on it, wrapped in the project's request limits (``uvicorn --factory
tasks.serving.http_app:create_app``, same PID: Ctrl-C or a SIGTERM to it stops the server). It answers with the version
holding ``registry.model_name@champion`` (``--alias``), looks the alias up again at most every ``--reload-s`` seconds
at a request (a promotion is served within that time, no restart), and records every generation as a trace in the
project's MLflow experiment, tagged with the version.

    curl -s http://127.0.0.1:5001/invocations -H 'Content-Type: application/json' \\
         -d '{"inputs": ["This movie was"], "params": {"max_new_tokens": 20}}'
"""

from __future__ import annotations

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from mlflow import MlflowClient  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402

from flows.serve import HOST, STATE_DIR  # noqa: E402
from rlhf_core.tracking import redact  # noqa: E402
from tasks.registry.gate import CHAMPION, pinned_requirements  # noqa: E402
from tasks.serving.alias_server import ServerConfig, save_server  # noqa: E402
from tasks.serving.http_app import MODEL_ENV, scoring_timeout  # noqa: E402
from tasks.spec.params import PARAMS_FILE  # noqa: E402
from tasks.stages import load_params  # noqa: E402
from tasks.store.mlflow_runs import mlflow_setup, tracking_uri  # noqa: E402

DEFAULT_PORT = 5001
CODE_ROOT = Path(__file__).resolve().parents[1]
"""The checkout holding ``tasks/`` (the server imports the served model's code from it)."""
SERVER_DIR = "policy-server"


def prepare(root: Path, alias: str, reload_s: float) -> tuple[Path, dict[str, str]]:
    """Check that ``alias`` names a version, write the served model; returns its folder and the server's environment."""
    model_name = load_params(root / PARAMS_FILE).registry.model_name
    experiment_id = mlflow_setup(root)  # the project's store (a vanished or locked one is named here)
    try:
        version = MlflowClient().get_model_version_by_alias(model_name, alias)
    except MlflowException:
        raise SystemExit(f"serve-model: no version of {model_name} holds the alias {alias!r} yet in {tracking_uri(root)}"
                         " (run `make run` first: the registry step sets `champion`)") from None
    uri = tracking_uri(root)
    config = ServerConfig(model_name, alias, experiment_id, uri if uri.startswith("sqlite:") else "", reload_s)
    path = root / STATE_DIR / SERVER_DIR
    path.parent.mkdir(exist_ok=True)
    save_server(path, config, pinned_requirements())
    print(f"Serving {model_name}@{alias} (now v{version.version}, followed every {reload_s:g} s); traces go to "
          f"experiment {experiment_id} of {redact(uri)}")
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false",
           MODEL_ENV: str(path),
           "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": str(scoring_timeout(config.request_timeout_s))}
    return path, env


def command(port: int) -> list[str]:
    """MLflow's scoring server app, wrapped in the request limits, on the served model named by ``$RLHF_SERVED_MODEL``
    (what this module runs)."""
    return [sys.executable, "-m", "uvicorn", "--factory", "tasks.serving.http_app:create_app", "--app-dir",
            str(CODE_ROOT), "--host", HOST, "--port", str(port)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve_model", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("MODEL_PORT", DEFAULT_PORT)))
    parser.add_argument("--alias", default=CHAMPION, help="registry alias served by default (default: champion)")
    parser.add_argument("--reload-s", type=float, default=10.0, help="look the alias up again at most this often")
    args = parser.parse_args(argv)
    if args.reload_s < 0:
        parser.error("--reload-s must be >= 0")
    _, env = prepare(Path(args.root).resolve(), args.alias, args.reload_s)
    cmd = command(args.port)
    print(f"  http://{HOST}:{args.port}/invocations   (POST {{\"inputs\": [...], \"params\": {{...}}}}; Ctrl-C stops)")
    print("  " + " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, env)  # the scoring server takes this PID: a signal to it stops the server


if __name__ == "__main__":
    sys.exit(main())
