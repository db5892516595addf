"""One stage on its own: what ``dvc.yaml`` runs (``python -m flows.stage <name>``).

Runs the same Prefect task as the pipeline flow. DVC itself records the stage in dvc.lock afterwards.
SIGTERM/SIGINT make a training stage save its state at the next step boundary and exit with status 75;
running the stage again (``dvc repro`` or this command) resumes from that state.
The MLflow child run hangs under ``$RLHF_PARENT_RUN_ID`` when set (``make repro`` sets it), else it is
a top-level run tagged ``rlhf.entry=dvc``.

Under a launcher (``accelerate launch ... -m flows.stage sft``, or ``torchrun``), one copy runs per process.
Only the main process (global rank 0) runs the stage as a Prefect flow run; every other rank calls the task's
function directly (``task.fn``), without Prefect. Two flow runs would record the same stage twice, and with no
``PREFECT_API_URL`` each process would start its own temporary Prefect server on the same database. The ranks
still train together (the trainers' DDP collectives), and only rank 0 writes (``tasks/distributed.py``).
Non-training stages (prepare, evaluate) exit with status 2 and a message under a launcher with several processes.
"""

from __future__ import annotations

import argparse
import os
import sys

import flows  # noqa: F401  (environment defaults)
from tasks.distributed import LauncherError, destroy_process_group, is_main_process, require_single_process

from prefect import flow  # noqa: E402

from flows.stages import LAUNCHABLE_STAGES, STAGE_TASKS  # noqa: E402
from rlhf_core.checkpointing import Preempted, install_stop_handlers  # noqa: E402
from tasks.dvc_ops import StageInputsChanged, inputs_unchanged  # noqa: E402
from tasks.locking import CheckoutLocked, add_wait_argument, checkout_lock  # noqa: E402
from tasks.paths import remove_stage_checkpoints  # noqa: E402
from tasks.orphans import clean_after_dead_runs, detach_temporary_server  # noqa: E402
from tasks.params import ALL_STAGES  # noqa: E402

EXIT_USAGE = 2
"""A non-training stage started by a launcher with several processes."""


NAME_KEYS = (("learning_rate", "lr"), ("beta", "beta"), ("total_steps", "steps"), ("num_train_epochs", "epochs"),
             ("source", "source"))
"""(params key, short label) shown in a stage's Prefect flow run name when its section has it."""


def stage_run_name(stage: str, section: dict) -> str:
    """``stage ppo lr=0.0001 steps=64``: the stage and the headline params of its section."""
    shown = [f"{label}={section[key]}" for key, label in NAME_KEYS if key in section]
    return " ".join([f"stage {stage}", *shown])


def flow_run_name() -> str:
    """The Prefect flow run's name (``stage_run_name`` from params.yaml; ``stage <name>`` if it cannot be read)."""
    from pathlib import Path

    from prefect.runtime import flow_run

    from tasks.params import PARAMS_FILE, as_dict, load_params

    args = flow_run.parameters or {}
    name = str(args.get("name", "?"))
    try:
        params = load_params(Path(args.get("root", ".")) / PARAMS_FILE)
        return stage_run_name(name, as_dict(params.section(name)))
    except Exception:  # noqa: BLE001 - the stage itself reports a params error
        return f"stage {name}"


@flow(name="rlhf-stage", flow_run_name=flow_run_name, log_prints=False)  # see flows/__init__.py
def stage(name: str, root: str = ".") -> dict:
    """Run the task of stage ``name`` in ``root``, holding the checkout lock (re-entrant for the run that started
    this process), and fail with :class:`StageInputsChanged` if its params or deps changed while it ran (DVC
    records the stage only when this command exits 0; it would record the edited values)."""
    with checkout_lock(root, f"python -m flows.stage {name}"):
        clean_after_dead_runs(root)  # MLflow runs and Prefect servers a killed run left behind
        with inputs_unchanged(root, name):
            result = STAGE_TASKS[name](root, os.environ.get("RLHF_PARENT_RUN_ID") or None)
        remove_stage_checkpoints(root, name)  # its resume states of earlier (abandoned) params
        return result


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 failed, 2 a non-training stage under a multi-process launcher, 75
    (``EXIT_PREEMPTED``) stopped by SIGTERM/SIGINT with its state saved, or its params/deps changed while it ran:
    run it again (or ``dvc repro``) to resume; 73 (``EXIT_LOCKED``) another run holds the checkout.
    DVC records the stage only on 0."""
    install_stop_handlers()  # before anything else: a SIGTERM from now on is a stop request, not a kill
    detach_temporary_server()  # a signal to our process group must not kill Prefect's server first
    parser = argparse.ArgumentParser(prog="python -m flows.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=ALL_STAGES)
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    try:
        if args.name not in LAUNCHABLE_STAGES:
            require_single_process(args.name)  # before any Prefect or MLflow work
        if is_main_process():
            with checkout_lock(args.root, f"python -m flows.stage {args.name}"):  # refused before Prefect starts
                stage(args.name, args.root)
        else:  # a non-main rank of a launch: the same task body, no Prefect flow run (see the module docstring)
            STAGE_TASKS[args.name].fn(args.root, os.environ.get("RLHF_PARENT_RUN_ID") or None)
    except LauncherError as error:
        print(f"stage {args.name}: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckoutLocked, StageInputsChanged) as refused:
        print(f"stage {args.name}: {refused}", file=sys.stderr)
        destroy_process_group()
        return refused.exit_code
    except Preempted as stopped:
        print(f"stage {args.name}: {stopped}", file=sys.stderr)
        destroy_process_group()  # every rank stopped at the same step and met at a barrier
        return stopped.exit_code
    destroy_process_group()  # (a failed rank skips it: the launcher stops the others)
    return 0


if __name__ == "__main__":
    sys.exit(main())
