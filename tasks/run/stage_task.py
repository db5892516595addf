"""The one way a stage runs, whichever entry point asked for it: :func:`run_stage`, and the Prefect task around it.

1. params.yaml is read once, every section checked (a bad value fails here, before anything is written);
2. a stage that may not run under a launcher refuses one (every rank would otherwise run it);
3. a disabled stage (``enabled: false``) writes its placeholders: no MLflow run, no training (``tasks/store/placeholders.py``);
4. otherwise its MLflow child run opens (``tasks/store/stage_run.py``) and its body runs (``tasks/stages/<stage>.py``);
5. what the body returned is written the same way for every stage: ``metrics/<stage>.json``, its plots, its numbers
   logged as ``final/<key>``, the run's summary; then the body's ``finish`` (its resumable state removed).
"""

from __future__ import annotations

import numbers
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.process.distributed import require_single_process
from tasks.process.logs import get_logger
from tasks.process.outcome import classify
from tasks.spec.params import PARAMS_FILE, StageParams, cross_section_values, stage_enabled
from tasks.spec.stage import WINDOW_COLUMNS, Stage, StageContext, StageIO, StageResult
from tasks.stages import BY_NAME, LAUNCHABLE, load_params
from tasks.store.outputs import write_csv, write_json
from tasks.store.placeholders import write_placeholder
from tasks.store.stage_run import stage_run

RETRY_DELAY_S = 2


def run_stage(name: str, root: str | Path = ".", parent_run_id: str | None = None) -> dict:
    """Run stage ``name`` in the project ``root``; returns what it wrote to ``metrics/<name>.json``. The stage run
    hangs under the MLflow run ``parent_run_id`` when given (the pipeline's), else it is a top-level run."""
    stage, root = BY_NAME[name], Path(root).resolve()
    params = load_params(root / PARAMS_FILE)
    if not stage.launchable:
        require_single_process(name, LAUNCHABLE)
    io = stage.io(params.paths)
    if not stage_enabled(params, name):
        return write_placeholders(stage, root, io)
    if not stage.serves_task(params):
        return write_placeholders(stage, root, io, f"task.name: {params.task.name} (it serves {', '.join(stage.serves)})")
    section = params.section(name)
    with stage_run(name, root, section, list(io.deps.values()), parent_run_id,
                   reads=cross_section_values(params, stage.reads)) as run:
        result = stage.body(StageContext(stage, root, StageParams(params, name, stage.reads), section, io, run))
        write_result(stage, root, io, result)
        run.log_metrics({f"final/{k}": v for k, v in result.metrics.items()
                         if isinstance(v, numbers.Real) and not isinstance(v, bool)})
        run.summary.update(result.metrics if result.summary is None else result.summary)
        if result.finish is not None:
            result.finish()
    return result.metrics


def write_result(stage: Stage, root: Path, io: StageIO, result: StageResult) -> None:
    """``metrics/<stage>.json`` and every plot file of the row from what the body returned."""
    if (result.windows is not None) != stage.windows or set(result.plots) != set(stage.extra_plots):
        raise ValueError(f"stage {stage.name}: its body returned windows={result.windows is not None} and plots "
                         f"{sorted(result.plots)}, its row declares windows={stage.windows} and plots "
                         f"{sorted(stage.extra_plots)} (tasks/stages/__init__.py)")
    write_json(root / io.metrics, result.metrics)
    write_csv(root / io.plots["curve"], list(result.curve), list(stage.plot_columns))
    if stage.windows:
        write_csv(root / io.plots["windows"], list(result.windows), list(WINDOW_COLUMNS))
    for name, (columns, rows) in result.plots.items():
        write_csv(root / io.plots[name], list(rows), list(columns))


def write_placeholders(stage: Stage, root: Path, io: StageIO, reason: str | None = None) -> dict:
    """A disabled stage's outputs (or those of a stage that does not serve the task, ``reason``): a placeholder at
    each output, ``{"enabled": false}``, header-only plots."""
    for out in io.outs.values():
        write_placeholder(root / out, stage.name)
    metrics = {"enabled": False}
    write_json(root / io.metrics, metrics)
    write_csv(root / io.plots["curve"], [], list(stage.plot_columns))
    if stage.windows:
        write_csv(root / io.plots["windows"], [], list(WINDOW_COLUMNS))
    get_logger().info("%s: disabled (%s); placeholder outputs written", stage.name, reason or f"{stage.name}.enabled: false")
    return metrics


def retry_unless_bad_input(task, task_run, state) -> bool:
    """Retry transient I/O errors, never bad input nor a stop (``tasks.process.outcome.classify``)."""
    try:
        state.result()
    except Exception as error:  # noqa: BLE001 - classified, never raised here
        return classify(error).retry
    return False


@task(name="stage", cache_policy=NO_CACHE)  # renamed after each stage (``run_stage_task``); training: no cache
def _stage(name: str, root: str = ".", parent_run_id: str | None = None) -> dict:
    return run_stage(name, root, parent_run_id)


def run_stage_task(name: str, root: str | Path = ".", parent_run_id: str | None = None) -> dict:
    """:func:`run_stage` as a Prefect task run (inside a flow run) named after the stage, retried when its row says
    so (never on bad input)."""
    retries = BY_NAME[name].retries
    task_run = _stage.with_options(name=name, retries=retries, retry_delay_seconds=RETRY_DELAY_S if retries else 0,
                                   retry_condition_fn=retry_unless_bad_input if retries else None)
    return task_run(name, str(root), parent_run_id)


__all__ = ["retry_unless_bad_input", "run_stage", "run_stage_task", "write_placeholders",
           "write_result"]
