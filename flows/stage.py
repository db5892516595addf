"""One stage on its own: what ``dvc.yaml`` runs (``python -m flows.stage <name>``).

Runs the same stage as the pipeline flow (``tasks/run/stage_task.py``), supervised the same way (``tasks/run/supervisor.py``);
DVC itself records the stage in dvc.lock afterwards when DVC ran it; typed by hand, the command ends naming the one
that records it (``python -m tasks.store.dvc_lockfile commit --force <name>``). After ``evaluate`` (typed or under
DVC) README.md's results table is rewritten from the new metrics/evaluate.json, saying so. SIGTERM/SIGINT make a training stage save
its state at the next step boundary and exit with status 75; running the stage again (``dvc repro`` or this command)
resumes from that state. The MLflow child run hangs under ``$RLHF_PARENT_RUN_ID`` when set (a parent run you created),
else it is a top-level run.

Under a launcher (``accelerate launch ... -m flows.stage sft``, or ``torchrun``), one copy runs per process.
Only the main process (global rank 0) runs the stage as a Prefect flow run; every other rank runs the stage
directly, without Prefect. Two flow runs would record the same stage twice, and with no ``PREFECT_API_URL`` each
process would start its own temporary Prefect server on the same database. The ranks still train together (the
trainers' DDP collectives), and only rank 0 writes (``tasks/process/distributed.py``). Stages that are not launchable in the
stage table (prepare, evaluate, ...) exit with status 2 and a message under a launcher with several processes.
"""

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from flows.report import note_readme  # noqa: E402
from tasks.process.distributed import destroy_process_group, is_main_process, require_single_process  # noqa: E402
from tasks.process.locking import add_wait_argument  # noqa: E402
from tasks.process.outcome import classify  # noqa: E402
from tasks.run.parallel_stages import RECORDED_ENV  # noqa: E402
from tasks.run.supervisor import PipelineRun, pipeline_run  # noqa: E402
from tasks.spec.params import PARAMS_FILE, as_dict  # noqa: E402
from tasks.stages import LAUNCHABLE, NAMES, load_params  # noqa: E402
from tasks.stages.common.scoring import EVALUATE  # noqa: E402
from tasks.store.mlflow_runs import PARENT_ENV  # noqa: E402

NAME_KEYS = (("learning_rate", "lr"), ("beta", "beta"), ("total_steps", "steps"), ("num_train_epochs", "epochs"),
             ("source", "source"))
"""(params key, short label) shown in a stage's Prefect flow run name when its section has it."""


def command(name: str) -> str:
    return f"python -m flows.stage {name}"


def stage_run_name(stage: str, section: dict) -> str:
    """``stage ppo lr=0.0001 steps=64``: the stage and the headline params of its section."""
    shown = [f"{label}={section[key]}" for key, label in NAME_KEYS if key in section]
    return " ".join([f"stage {stage}", *shown])


def flow_run_name() -> str:
    """The Prefect flow run's name (``stage_run_name`` from params.yaml; ``stage <name>`` if it cannot be read)."""
    args = flow_run.parameters or {}
    name = str(args.get("name", "?"))
    try:
        params = load_params(Path(args.get("root", ".")) / PARAMS_FILE)
        return stage_run_name(name, as_dict(params.section(name)))
    except Exception:  # noqa: BLE001 - the stage itself reports a params error
        return f"stage {name}"


@flow(name="rlhf-stage", flow_run_name=flow_run_name, log_prints=False)  # log_prints: see flows/process.py
def stage(name: str, root: str = ".") -> dict:
    """Run stage ``name`` in ``root``; fail with ``StageInputsChanged`` if its params or deps changed while it ran
    (DVC records the stage only when this command exits 0: it would record the edited values)."""
    with pipeline_run(root, command(name), records=False) as run:
        return run.stage(name)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 failed, 2 a non-launchable stage under a multi-process launcher, 75 stopped by
    SIGTERM/SIGINT with its state saved, or its params/deps changed while it ran: run it again (or ``dvc repro``)
    to resume; 73 (``EXIT_LOCKED``) another run holds the checkout. DVC records the stage only on 0."""
    parser = argparse.ArgumentParser(prog="python -m flows.stage", description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("--root", default=".", help="project directory, or a task folder of it such as "
                        "pipelines/arithmetic (default: current)")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    try:
        if args.name not in LAUNCHABLE:
            require_single_process(args.name, LAUNCHABLE)  # before any Prefect or MLflow work
        with PipelineRun(args.root, command(args.name), records=False, parent_run_id=os.environ.get(PARENT_ENV)) as run:
            if is_main_process():
                stage(args.name, args.root)
            else:  # a non-main rank of a launch: the same stage, no Prefect flow run (see the module docstring)
                run.stage(args.name)
    except Exception as error:  # noqa: BLE001 - mapped to an exit status, or re-raised
        if (status := classify(error).exit_status) is None:
            raise  # (a failed rank skips the teardown: the launcher stops the others)
        print(f"stage {args.name}: {error}", file=sys.stderr)
        destroy_process_group()  # after a stop every rank stopped at the same step and met at a barrier
        return status
    destroy_process_group()
    if is_main_process():
        if args.name == EVALUATE:  # the one stage that writes metrics/evaluate.json, the README table's source
            note_readme(args.root)
        if note := unrecorded_note(args.name):
            print(note)
    return 0


def unrecorded_note(name: str) -> str | None:
    """What to run to record a stage run by hand in dvc.lock (DVC records it only when DVC ran it: ``$DVC_STAGE`` is
    set then); None under DVC, and in a stage the pipeline launched side by side (it records the stage itself:
    ``RECORDED_ENV``). Without it, the next pipeline or ``dvc repro`` trains the stage again."""
    if os.environ.get("DVC_STAGE") or os.environ.get(RECORDED_ENV):
        return None
    return (f"stage {name} ran, but is not recorded in dvc.lock (DVC records the stages it runs itself): record it "
            f"with `.venv/bin/python -m tasks.store.dvc_lockfile commit --force {name}`, or run it as `make repro` "
            f"(`dvc repro {name}`) does, else the next pipeline trains it again")


if __name__ == "__main__":
    sys.exit(main())
