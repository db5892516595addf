"""Whether this code runs inside a Prefect flow/task run, and that run's id (empty outside one)."""

from __future__ import annotations


def in_prefect_run() -> bool:
    """True inside a Prefect flow run or task run (``task.fn(...)`` called directly is not one)."""
    try:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None
    except ImportError:  # pragma: no cover
        return False


def prefect_flow_run_id() -> str:
    """The current Prefect flow run's id, or ``""`` outside one (tags MLflow runs with it)."""
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - no Prefect context
        return ""


__all__ = ["in_prefect_run", "prefect_flow_run_id"]
