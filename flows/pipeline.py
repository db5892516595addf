"""The whole pipeline as one Prefect flow: ``python -m flows.pipeline``.

For each stage in order, ask DVC whether it is stale; if so run its task and record it in dvc.lock
(a stage whose section says ``enabled: false`` writes placeholder outputs and is recorded too, so ``dvc status``
is clean). Then register the evaluated policy. A second run with nothing changed trains nothing; changing a PPO
parameter re-runs ppo and evaluate only. ``dvc repro`` runs the same tasks through ``flows.stage``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flows  # environment defaults (at import); exit_promptly
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.stages import STAGE_TASKS
from flows.summary import end_block, load_results
from rlhf_core.checkpointing import EXIT_PREEMPTED, Preempted, install_stop_handlers, stop_requested
from tasks.dvc_ops import StageInputsChanged, inputs_unchanged, record_stage, stage_status
from tasks.evaluate import policy_results
from tasks.locking import CheckoutLocked, add_wait_argument, checkout_lock
from tasks.logs import get_logger
from tasks.mlflow_runs import end_pipeline_run, mlflow_setup, mlflow_ui_link, start_pipeline_run
from tasks.orphans import clean_after_dead_runs, detach_temporary_server
from tasks.params import ALL_STAGES, PARAMS_FILE, ParamsError, load_params
from tasks.paths import remove_stage_checkpoints
from tasks.prepare import check_source, source_changed
from tasks.registry import registry_task


def flow_run_name() -> str:
    """The Prefect flow run's name while it runs: ``pipeline: running`` (``pipeline: all (forced)`` with
    ``force``); ``rename_flow_run`` names it after the stages it ran when it ends (``pipeline: ppo,evaluate``)."""
    from prefect.runtime import flow_run

    return "pipeline: all (forced)" if (flow_run.parameters or {}).get("force") else "pipeline: running"


def rename_flow_run(name: str) -> None:
    """Rename the current Prefect flow run (nothing outside a run; a failure only logs)."""
    try:
        from prefect import get_client
        from prefect.context import FlowRunContext

        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            return
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(context.flow_run.id, name=name)
    except Exception as error:  # noqa: BLE001 - a name is not worth failing a finished pipeline
        get_logger().debug("flow run not renamed: %s", error)


@flow(name="rlhf-pipeline", flow_run_name=flow_run_name, log_prints=False)  # see flows/__init__.py
def pipeline(root: str = ".", force: bool = False, run_registry: bool = True) -> dict:
    """Run every stale stage of the pipeline in ``root``, then the registry step (holding the checkout lock)."""
    root = str(Path(root).resolve())
    params = load_params(Path(root) / PARAMS_FILE)  # bad params fail here, before any state changes
    check_source(params.prepare, Path(root))  # and a bad prepare.source, before any run or model starts
    with checkout_lock(root, "python -m flows.pipeline"):  # a second run waits or refuses, naming this one
        clean_after_dead_runs(root)  # MLflow runs and Prefect servers a killed run left behind
        return _run_pipeline(root, params, force, run_registry)


def _run_pipeline(root: str, params, force: bool, run_registry: bool) -> dict:
    log = get_logger()
    parent = start_pipeline_run(root, entry="prefect")
    ran, skipped = [], []
    name, decision = "", None
    try:
        for name in ALL_STAGES:  # a disabled stage (``enabled: false``) runs too: placeholder outputs, recorded
            if stop_requested():  # a signal during a stage without step checks (prepare, evaluate): stop here
                raise Preempted(f"stop requested before stage {name}")
            changes = stage_status(root, name)
            if name == "prepare" and not changes:  # DVC cannot see the file prepare.source names: compare it here
                why = source_changed(params.prepare, Path(root), Path(root) / params.paths.data)
                changes = {"prepare": [why]} if why else {}
            if changes or force:
                log.info("stage %s: running (%s)", name, "forced" if not changes else _describe(changes))
                with inputs_unchanged(root, name):  # params/deps edited mid-run: not recorded (issue 12.1)
                    STAGE_TASKS[name](root, parent)
                _forget_abandoned_states(root, name)
                record_stage(root, name)
                ran.append(name)
            else:
                log.info("stage %s: up to date, skipped", name)
                skipped.append(name)
        name = "registry"
        decision = registry_task(root, parent) if run_registry else {"registered": False, "reason": "registry disabled"}
    except Preempted as stopped:  # earlier stages stay recorded; this one is not; no registry step
        log.warning("stage %s stopped (%s); run the pipeline again to resume it", name, stopped)
        end_pipeline_run(root, parent, "KILLED", {"ran": ",".join(ran), "preempted": name}, params=params, ran=ran,
                         skipped=skipped, failed_stage=name, error=stopped)
        raise
    except StageInputsChanged as changed:  # earlier stages stay recorded; this one and later ones stay stale
        log.warning("%s; later stages and the registry step skipped", changed)
        rename_flow_run(f"pipeline: inputs changed during {name}")
        end_pipeline_run(root, parent, "KILLED", {"ran": ",".join(ran), "inputs_changed": name}, params=params,
                         ran=ran, skipped=skipped, failed_stage=name, error=changed)
        raise
    except BaseException as error:
        rename_flow_run(f"pipeline: FAILED at {name}")
        end_pipeline_run(root, parent, "FAILED", {"ran": ",".join(ran)}, params=params, ran=ran, skipped=skipped,
                         failed_stage=name, error=error)
        raise
    rename_flow_run(f"pipeline: {','.join(ran) or 'up to date'}")
    kept = end_pipeline_run(root, parent, "FINISHED", {"ran": ",".join(ran) or "nothing",
                                                       "registry": decision.get("reason")},
                            params=params, ran=ran, skipped=skipped, registry=decision)
    url = mlflow_ui_link(mlflow_setup(root), parent) if parent and kept else None
    summary = {"ran": ran, "skipped": skipped, "registry": decision, "mlflow_run": parent if kept else "",
               "end_block": end_block(load_results(Path(root) / params.paths.metrics / "evaluate.json"), ran,
                                      decision, url, noop=bool(parent) and not kept)}
    create_markdown_artifact(_report(root, summary), key="rlhf-pipeline-summary", description="pipeline summary")
    return summary  # ``main`` prints ``end_block`` last, after Prefect's own closing lines


def _forget_abandoned_states(root: str, name: str) -> None:
    """The stage completed: resume states in ``.checkpoints/`` of its earlier (abandoned) params go too."""
    removed = remove_stage_checkpoints(root, name)
    if removed:
        get_logger().info("stage %s: removed %d abandoned resume state(s): %s", name, len(removed),
                          ", ".join(p.name for p in removed))


def _describe(changes: dict) -> str:
    parts = []
    for entries in changes.values():
        for entry in entries:
            if isinstance(entry, dict):
                for kind, what in entry.items():
                    parts.append(f"{kind}: {', '.join(what) if isinstance(what, dict) else what}")
            else:
                parts.append(str(entry))
    return "; ".join(parts)[:300] or "changed"


def _report(root: str, summary: dict) -> str:
    parent = summary["mlflow_run"]
    link = (f"[{parent}]({mlflow_ui_link(mlflow_setup(root), parent)})" if parent
            else "none (nothing ran, or the tracking server was unreachable: then `make tracking-upload`)")
    lines = ["## RLHF pipeline", "", f"- stages run: {', '.join(summary['ran']) or 'none'}",
             f"- skipped (up to date): {', '.join(summary['skipped']) or 'none'}",
             f"- registry: {summary['registry'].get('reason')}",
             f"- MLflow parent run: {link}", ""]
    evaluation = Path(root) / "metrics" / "evaluate.json"
    if evaluation.exists():
        import json

        results = policy_results(json.loads(evaluation.read_text()))  # without the scored hashes
        keys = list(next(iter(results.values())))
        lines += ["| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {p} | " + " | ".join(str(v[k]) for k in keys) + " |" for p, v in results.items()]
    return "\n".join(lines)


EXIT_CONFIG = 2
"""Exit status of ``main`` when params.yaml or the data it names is wrong (nothing started)."""


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done (the end block printed last), 1 failed, 2 a configuration error (params.yaml,
    ``prepare.source``: nothing started), 73 (``EXIT_LOCKED``) another run holds the checkout, 75
    (``EXIT_PREEMPTED``) a stage was stopped by SIGTERM/SIGINT after saving its state, or its params/inputs
    changed while it ran (not recorded): earlier stages are recorded, the registry untouched; run the pipeline
    again to resume."""
    install_stop_handlers()
    detach_temporary_server()  # a signal to our process group must not kill Prefect's server first
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--force", action="store_true", help="run every stage even if DVC says it is up to date")
    parser.add_argument("--no-register", action="store_true", help="skip the MLflow registry step")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    try:
        with checkout_lock(args.root, "python -m flows.pipeline"):  # refused here, before Prefect starts
            try:  # configuration errors next: before Prefect starts its server or any model loads
                root = Path(args.root).resolve()
                check_source(load_params(root / PARAMS_FILE).prepare, root)
            except (ParamsError, ValueError, FileNotFoundError) as error:
                print(f"error: {error}", file=sys.stderr)
                return EXIT_CONFIG
            summary = pipeline(args.root, force=args.force, run_registry=not args.no_register)
    except (Preempted, StageInputsChanged, CheckoutLocked) as stopped:
        print(f"pipeline stopped: {stopped}", file=sys.stderr)
        return stopped.exit_code
    print(summary["end_block"], flush=True)  # (Prefect's "Stopping temporary server" line follows, at exit)
    return 0


if __name__ == "__main__":
    status = main()
    if status == EXIT_PREEMPTED:  # stopped, state saved, runs ended: leave in seconds (issue 12.5)
        flows.exit_promptly(status)
    sys.exit(status)
