"""The whole pipeline as one Prefect flow: ``python -m flows.pipeline``.

For each stage in order, ask DVC whether it is stale; if so run it and record it in dvc.lock (a stage whose section
says ``enabled: false`` writes placeholder outputs and is recorded too, so ``dvc status`` is clean). Then register
the evaluated policy. A second run with nothing changed trains nothing; changing a PPO parameter re-runs ppo and
evaluate only. ``dvc repro`` runs the same stages through ``flows.stage``. The supervision (lock, stops, the MLflow
parent run and how it ends) is ``tasks/run/supervisor.py``.
"""

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402
from prefect.runtime import flow_run  # noqa: E402

from flows.process import configure_logging, exit_promptly  # noqa: E402
from flows.report import note_readme  # noqa: E402
from flows.summary import end_block, report  # noqa: E402
from tasks.process.locking import add_wait_argument  # noqa: E402
from tasks.process.outcome import EXIT_STOPPED, ConfigError, classify  # noqa: E402
from tasks.run.parallel_stages import parallel_groups  # noqa: E402
from tasks.run.parallel_stages import policy_workers as policy_workers_setting  # noqa: E402
from tasks.run.supervisor import PipelineRun, pipeline_run  # noqa: E402
from tasks.stages import NAMES, POLICY_STAGES  # noqa: E402
from tasks.spec.paths import task_folder  # noqa: E402
from tasks.stages.common.scoring import read_results  # noqa: E402
from tasks.store.mlflow_runs import mlflow_setup, mlflow_ui_link  # noqa: E402

COMMAND = "python -m flows.pipeline"


def flow_run_name() -> str:
    """The Prefect flow run's name while it runs: ``pipeline: running`` (``pipeline: all (forced)`` with
    ``force``); the supervisor names it after the stages it ran when it ends (``pipeline: ppo,evaluate``)."""
    return "pipeline: all (forced)" if (flow_run.parameters or {}).get("force") else "pipeline: running"


@flow(name="rlhf-pipeline", flow_run_name=flow_run_name, log_prints=False)  # log_prints: see flows/process.py
def pipeline(root: str = ".", force: bool = False, run_registry: bool = True,
             policy_workers: int | str | None = None) -> dict:
    """Run every stale stage of the pipeline in ``root``, then the registry step (holding the checkout lock).
    ``policy_workers``: how many policy stages run side by side (a number, ``auto``: one per GPU or two per
    ``$OMP_NUM_THREADS`` cores; None: ``$RLHF_POLICY_WORKERS``, else 1)."""
    configure_logging()  # a deployed run's process was not started by ``main`` (prefect.yaml's entry point)
    workers = policy_workers_setting(policy_workers)
    with pipeline_run(root, COMMAND) as run:
        with run.parent_run():
            for group in parallel_groups(NAMES, POLICY_STAGES):  # a disabled stage runs too: placeholders, recorded
                run.stages(group, force=force, workers=workers)
            if run_registry:
                run.registry()
        results = read_results(run.root, run.params.paths)
    parent = run.parent_run_id or ""
    url = mlflow_ui_link(mlflow_setup(run.root), parent) if parent and run.kept else None
    summary = {"ran": run.ran, "skipped": run.skipped, "registry": run.decision, "mlflow_run": parent if run.kept else "",
               "end_block": end_block(results, run.ran, run.decision, url, noop=bool(parent) and not run.kept,
                                      folder=task_folder(run.root), model_name=run.params.registry.model_name)}
    create_markdown_artifact(report(summary, results, url), key="rlhf-pipeline-summary", description="pipeline summary")
    return summary  # ``main`` prints ``end_block`` last, after Prefect's own closing lines


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (the end block printed last), 1 failed, 2 a configuration error (params.yaml,
    ``prepare.source``: nothing started), 73 (``EXIT_LOCKED``) another run holds the checkout, 75 a stage was
    stopped by SIGTERM/SIGINT after saving its state, or its params/inputs changed while it ran (not recorded):
    earlier stages are recorded, the registry untouched; run the pipeline again to resume."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory, or a task folder of it such as "
                        "pipelines/arithmetic (default: current)")
    parser.add_argument("--force", action="store_true", help="run every stage even if DVC says it is up to date")
    parser.add_argument("--no-register", action="store_true", help="skip the MLflow registry step")
    parser.add_argument("--policy-workers", default=None, metavar="N",
                        help="run up to N policy stages side by side, each in its own process and on its own GPU(s) "
                             "when several are visible; auto: one per GPU, or two per $OMP_NUM_THREADS cores (default "
                             "$RLHF_POLICY_WORKERS, else 1: one after another; make run passes auto)")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    try:
        policy_workers_setting(args.policy_workers)  # a bad value: exit 2 before anything starts
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        with PipelineRun(args.root, COMMAND):  # the lock and the configuration, before Prefect starts
            summary = pipeline(args.root, force=args.force, run_registry=not args.no_register,
                               policy_workers=args.policy_workers)
    except Exception as error:  # noqa: BLE001 - mapped to an exit status, or re-raised
        if (status := classify(error).exit_status) is None:
            raise
        print(f"error: {error}" if isinstance(error, ConfigError) else f"pipeline stopped: {error}", file=sys.stderr)
        return status
    note_readme(Path(args.root))
    print(summary["end_block"], flush=True)  # (Prefect's "Stopping temporary server" line follows, at exit)
    return 0


if __name__ == "__main__":
    status = main()
    if status == EXIT_STOPPED:  # stopped, state saved, runs ended: leave in seconds (issue 12.5)
        exit_promptly(status)
    sys.exit(status)
