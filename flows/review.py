"""The review page: ``python -m flows.review`` (``make review``), on http://127.0.0.1:5002.

Reviewers rate served answers (good / bad) and choose the better of two answers to the same prompt (champion vs
challenger); every judgement is an MLflow assessment on the answer's trace, with the reviewer's name as its source
(``tasks/feedback/review_page.py``, ``tasks/feedback/assessments.py``). Needs the served policy (``make serve-model``) for the side-by-side
answers; ``make intake-feedback`` turns the judgements into versioned feedback batches.
"""

from __future__ import annotations

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import mlflow  # noqa: E402

from flows.serve import HOST  # noqa: E402
from flows.serve_model import DEFAULT_PORT as MODEL_PORT  # noqa: E402
from tasks.store.mlflow_runs import mlflow_setup  # noqa: E402
from tasks.feedback.review_page import ReviewSettings, make_server  # noqa: E402

DEFAULT_PORT = 5002


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.review", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("REVIEW_PORT", DEFAULT_PORT)))
    parser.add_argument("--model-url", default=f"http://{HOST}:{os.environ.get('MODEL_PORT', MODEL_PORT)}",
                        help="the served policy (make serve-model)")
    parser.add_argument("--mlflow-ui-url", default=os.environ.get("RLHF_MLFLOW_UI_URL", f"http://{HOST}:5000"),
                        help="MLflow's UI, for the links to each trace (make mlflow-ui)")
    args = parser.parse_args(argv)
    experiment_id = mlflow_setup(Path(args.root).resolve())  # the project's store; mlflow now points at it
    settings = ReviewSettings(mlflow.MlflowClient(), experiment_id, args.model_url, args.mlflow_ui_url)
    server = make_server(settings, HOST, args.port)
    print(f"Review page: http://{HOST}:{args.port}/  (answers from {args.model_url}; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
