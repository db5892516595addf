"""One stage on its own: what ``dvc.yaml`` runs (``python -m flows.stage <name>``).

Runs the same Prefect task as the pipeline flow. DVC itself records the stage in dvc.lock afterwards.
SIGTERM/SIGINT make a training stage save its state at the next step boundary and exit with status 75;
running the stage again (``dvc repro`` or this command) resumes from that state.
The MLflow child run hangs under ``$RLHF_PARENT_RUN_ID`` when set (``make repro`` sets it), else it is
a top-level run tagged ``rlhf.entry=dvc``.
"""

from __future__ import annotations

import argparse
import os
import sys

import flows  # noqa: F401  (environment defaults)
from prefect import flow

from flows.stages import STAGE_TASKS
from rlhf_core.checkpointing import Preempted, install_stop_handlers
from tasks.params import STAGES


@flow(name="rlhf-stage", log_prints=True)
def stage(name: str, root: str = ".") -> dict:
    """Run the task of stage ``name`` in ``root``."""
    return STAGE_TASKS[name](root, os.environ.get("RLHF_PARENT_RUN_ID") or None)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 failed, 75 (``EXIT_PREEMPTED``) stopped by SIGTERM/SIGINT with its state saved:
    run it again (or ``dvc repro``) to resume. DVC records the stage only on 0."""
    install_stop_handlers()  # before anything else: a SIGTERM from now on is a stop request, not a kill
    parser = argparse.ArgumentParser(prog="python -m flows.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=STAGES)
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    args = parser.parse_args(argv)
    try:
        stage(args.name, args.root)
    except Preempted as stopped:
        print(f"stage {args.name}: {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
