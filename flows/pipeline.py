"""The whole pipeline as one Prefect flow: ``python -m flows.pipeline``.

For each stage in order, ask DVC whether it is stale; if so run its task and record it in dvc.lock
(a stage whose section says ``enabled: false`` writes placeholder outputs and is recorded too, so ``dvc status`` is clean). Then register the evaluated policy. A second run with nothing changed trains nothing; changing a PPO
parameter re-runs ppo and evaluate only. ``dvc repro`` runs the same tasks through ``flows.stage``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import flows  # noqa: F401  (environment defaults)
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from flows.stages import STAGE_TASKS
from rlhf_core.checkpointing import Preempted, install_stop_handlers
from tasks.dvc_ops import StageInputsChanged, inputs_unchanged, record_stage, stage_status
from tasks.evaluate import policy_results
from tasks.locking import CheckoutLocked, add_wait_argument, checkout_lock
from tasks.logs import get_logger
from tasks.mlflow_runs import end_pipeline_run, mlflow_setup, mlflow_ui_link, start_pipeline_run
from tasks.orphans import clean_after_dead_runs, detach_temporary_server
from tasks.params import ALL_STAGES, PARAMS_FILE, load_params
from tasks.paths import remove_stage_checkpoints
from tasks.registry import registry_task

WHERE_TO_LOOK = """Where to look:
  MLflow UI:   make mlflow-ui   (http://127.0.0.1:5000, experiment rlhf-pipeline, model rlhf-policy)
  DVC:         dvc metrics show   |   dvc metrics diff   |   dvc status   |   plots/*.csv (charts: MLflow evaluate run)
  Prefect UI:  prefect server start --host 127.0.0.1   (http://127.0.0.1:4200; runs, logs, artifacts)"""


@flow(name="rlhf-pipeline", log_prints=False)  # see flows/__init__.py
def pipeline(root: str = ".", force: bool = False, run_registry: bool = True) -> dict:
    """Run every stale stage of the pipeline in ``root``, then the registry step (holding the checkout lock)."""
    root = str(Path(root).resolve())
    params = load_params(Path(root) / PARAMS_FILE)  # bad params fail here, before any state changes
    with checkout_lock(root, "python -m flows.pipeline"):  # a second run waits or refuses, naming this one
        clean_after_dead_runs(root)  # MLflow runs and Prefect servers a killed run left behind
        return _run_pipeline(root, params, force, run_registry)


def _run_pipeline(root: str, params, force: bool, run_registry: bool) -> dict:
    log = get_logger()
    parent = start_pipeline_run(root, entry="prefect")
    ran, skipped = [], []
    try:
        for name in ALL_STAGES:  # a disabled stage (``enabled: false``) runs too: placeholder outputs, recorded
            changes = stage_status(root, name)
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
        decision = registry_task(root, parent) if run_registry else {"registered": False, "reason": "registry disabled"}
    except Preempted as stopped:  # earlier stages stay recorded; this one is not; no registry step
        log.warning("stage %s stopped (%s); run the pipeline again to resume it", name, stopped)
        end_pipeline_run(root, parent, "KILLED", {"ran": ",".join(ran), "preempted": name})
        raise
    except StageInputsChanged as changed:  # earlier stages stay recorded; this one and later ones stay stale
        log.warning("%s; later stages and the registry step skipped", changed)
        end_pipeline_run(root, parent, "KILLED", {"ran": ",".join(ran), "inputs_changed": name})
        raise
    except BaseException:
        end_pipeline_run(root, parent, "FAILED", {"ran": ",".join(ran)})
        raise
    end_pipeline_run(root, parent, "FINISHED", {"ran": ",".join(ran) or "nothing", "registry": decision.get("reason")})
    summary = {"ran": ran, "skipped": skipped, "registry": decision, "mlflow_run": parent}
    create_markdown_artifact(_report(root, summary), key="rlhf-pipeline-summary", description="pipeline summary")
    print(f"Stages run: {', '.join(ran) or 'none (everything up to date)'}; registry: {decision.get('reason')}")
    print(WHERE_TO_LOOK)
    return summary


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
            else "none (tracking server unreachable: stages spooled to tracking-spool/, `make tracking-upload`)")
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


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 1 failed, 75 (``EXIT_PREEMPTED``) a stage was stopped by SIGTERM/SIGINT after saving
    its state, or its params/inputs changed while it ran (not recorded): earlier stages are recorded, the registry
    untouched; run the pipeline again to resume. 73 (``EXIT_LOCKED``): another run holds the checkout."""
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
            pipeline(args.root, force=args.force, run_registry=not args.no_register)
    except (Preempted, StageInputsChanged, CheckoutLocked) as stopped:
        print(f"pipeline stopped: {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0



if __name__ == "__main__":
    sys.exit(main())
