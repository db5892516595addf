"""The Prefect flow run this code runs in, if any: whether there is one, its id, and renaming it.

Prefect is imported inside each function: ``tasks/store/mlflow_runs.py`` imports this module, and ``make mlflow-ui``
(``flows/ui.py``) imports that one without running any flow.
"""

from __future__ import annotations

from tasks.process.logs import get_logger


def in_prefect_run() -> bool:
    """True inside a Prefect flow run or task run (``run_stage`` called directly is not one)."""
    from prefect.context import FlowRunContext, TaskRunContext  # prefect: see the module docstring

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def prefect_flow_run_id() -> str:
    """The current Prefect flow run's id, or ``""`` outside one (tags MLflow runs with it)."""
    from prefect.runtime import flow_run  # prefect: see the module docstring

    try:
        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - no Prefect context
        return ""


def rename_flow_run(name: str) -> None:
    """Rename the current Prefect flow run (nothing outside a run; a failure only logs)."""
    from prefect import get_client  # prefect: see the module docstring
    from prefect.context import FlowRunContext

    try:
        context = FlowRunContext.get()
        if context is None or context.flow_run is None:
            return
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(context.flow_run.id, name=name)
    except Exception as error:  # noqa: BLE001 - a name is not worth failing a finished pipeline
        get_logger().debug("flow run not renamed: %s", error)


__all__ = ["in_prefect_run", "prefect_flow_run_id", "rename_flow_run"]
