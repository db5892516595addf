"""One stage on its own: what ``dvc.yaml`` runs (``python -m flows.stage <name>``).

Runs the same Prefect task as the pipeline flow. DVC itself records the stage in dvc.lock afterwards.
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
from tasks.params import STAGES


@flow(name="rlhf-stage", log_prints=True)
def stage(name: str, root: str = ".") -> dict:
    """Run the task of stage ``name`` in ``root``."""
    return STAGE_TASKS[name](root, os.environ.get("RLHF_PARENT_RUN_ID") or None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=STAGES)
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    args = parser.parse_args(argv)
    stage(args.name, args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
