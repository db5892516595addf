"""``make mlflow-ui``: the MLflow UI on 127.0.0.1, opened where a reviewer wants it.

MLflow 3's UI starts a fresh browser in its GenAI view (traces, "Evaluation runs"); this project's runs are
training runs. So the server is MLflow's with one change (``tasks/serving/training_view.py``, pyproject's
``mlflow.app`` entry point): its bare root opens the "Model training" view in a browser that has not chosen one.
Before it starts the server this prints the two addresses to open: the experiment's runs in that view, and the run
comparison of the latest evaluation's policies (one run per policy, same metric keys: ``tasks/store/stage_run.py``
``log_child_runs``). Then it becomes ``mlflow ui`` (same PID: stop it with Ctrl-C or by that PID)."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

from flows.process import configure_process
from tasks.serving.training_view import APP_NAME
from tasks.store.mlflow_runs import mlflow_compare_link, mlflow_setup, tracking_uri


def ui_links(root: Path) -> dict[str, str]:
    """``{"runs": ..., "compare": ...}``: the experiment's training view and, when an evaluation has run, the
    comparison of its per-policy runs."""
    from mlflow import MlflowClient  # mlflow: only once the UI is asked for (the CLI then becomes `mlflow ui`)

    experiment_id = mlflow_setup(root)
    base = os.environ.get("RLHF_MLFLOW_UI_URL", "http://127.0.0.1:5000").rstrip("/")
    links = {"runs": f"{base}/#/experiments/{experiment_id}/runs?workflowType=machine_learning"}
    latest = MlflowClient().search_runs([experiment_id], "tags.`rlhf.stage` = 'evaluate' and "
                                        "attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"],
                                        max_results=1)
    if latest:
        children = MlflowClient().search_runs([experiment_id], f"tags.`mlflow.parentRunId` = "
                                              f"'{latest[0].info.run_id}'", order_by=["attributes.start_time ASC"])
        if children:
            links["compare"] = mlflow_compare_link(experiment_id, [c.info.run_id for c in children])
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.ui", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    store = tracking_uri(root)
    served = store.startswith(("http://", "https://"))  # team mode: the tracking server is the UI
    os.environ.setdefault("RLHF_MLFLOW_UI_URL", store if served else f"http://127.0.0.1:{args.port}")
    links = ui_links(root)
    print(f"MLflow UI, the pipeline's training runs:  {links['runs']}")
    if "compare" in links:
        print(f"the policies of the latest evaluation, side by side:  {links['compare']}")
    if served:
        print(f"(MLFLOW_TRACKING_URI is the server {store}: its UI is already up)")
        return 0
    installed = bool(entry_points(group="mlflow.app", name=APP_NAME))
    if not installed:  # a venv from before the entry point: MLflow's plain app still serves every page
        print(f"warning: this venv predates the MLflow UI app {APP_NAME!r} (pyproject.toml's mlflow.app entry point), "
              f"so the bare address opens MLflow's default view; `make setup` installs it", file=sys.stderr)
    print("(starting the server; Ctrl-C stops it)", flush=True)
    command = ui_command(store, args.port, training_view=installed)
    os.execv(command[0], command)
    return 0  # not reached


def ui_command(store: str, port: int, training_view: bool = True) -> list[str]:
    """``mlflow ui`` on ``store``, loopback only, serving :mod:`tasks.serving.training_view`'s app (MLflow's own
    without ``training_view``). One worker: a reviewer's UI on a laptop (MLflow's default of 4 starts 4 uvicorn
    workers and their job runners)."""
    mlflow = str(Path(sys.prefix) / "bin" / "mlflow")
    return [mlflow, "ui", "--backend-store-uri", store, "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            *(["--app-name", APP_NAME] if training_view else [])]


if __name__ == "__main__":
    configure_process()
    sys.exit(main())
