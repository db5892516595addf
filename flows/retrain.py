"""Scheduled retraining: ``python -m flows.retrain`` (one run) or ``--serve`` (on a cron schedule).

A retraining run picks up new data (files dropped in ``incoming/``, or a new ``prepare.source_revision``
for a hub dataset), re-runs what changed through the pipeline flow, evaluates, registers (the champion
moves only if the new policy wins), and pushes DVC data and models to the configured remote
(``.dvc-remote/`` by default). ``--serve`` needs a Prefect server (``prefect server start --host 127.0.0.1``
with ``PREFECT_API_URL=http://127.0.0.1:4200/api``); no Prefect Cloud.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from prefect import flow

from flows.pipeline import pipeline
from rlhf_core.checkpointing import Preempted, install_stop_handlers
from tasks.dvc_ops import StageInputsChanged, push_outputs
from tasks.locking import CheckoutLocked, add_wait_argument, checkout_lock
from tasks.orphans import detach_temporary_server

DEFAULT_CRON = "0 3 * * 1"  # Mondays 03:00; prefect.yaml holds the deployed schedule


@flow(name="rlhf-retrain", log_prints=False)  # see flows/__init__.py
def retrain(root: str = ".", push: bool = True, remote: str | None = None) -> dict:
    """Re-run what changed, evaluate, register, push to the DVC remote."""
    root = str(Path(root).resolve())
    with checkout_lock(root, "python -m flows.retrain"):  # held through the push; the pipeline flow re-enters it
        summary = pipeline(root)
        if push:
            summary["pushed"] = push_outputs(root, remote)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Exit status 75 (``EXIT_PREEMPTED``) when SIGTERM/SIGINT stopped a training stage after saving its state."""
    parser = argparse.ArgumentParser(prog="python -m flows.retrain", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--serve", action="store_true", help="serve the retraining deployment on a cron schedule")
    parser.add_argument("--cron", default=DEFAULT_CRON, help=f"schedule for --serve (default: {DEFAULT_CRON!r})")
    parser.add_argument("--no-push", action="store_true", help="do not push to the DVC remote")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    if args.serve:
        retrain.serve(name="rlhf-retrain-local", cron=args.cron,
                      parameters={"root": str(Path(args.root).resolve()), "push": not args.no_push})
        return 0
    install_stop_handlers()  # one run (not --serve: there SIGTERM must stop the server)
    detach_temporary_server()  # a signal to our process group must not kill Prefect's server first
    try:
        with checkout_lock(args.root, "python -m flows.retrain"):  # refused here, before Prefect starts
            retrain(args.root, push=not args.no_push)
    except (Preempted, StageInputsChanged, CheckoutLocked) as stopped:  # e.g. a stage saved its state on SIGTERM
        print(f"retrain stopped: {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
