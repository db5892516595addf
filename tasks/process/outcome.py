"""How a run that raised ends: the one taxonomy of the pipeline's exceptions, :func:`classify`.

Every entry point reads its answer from here: a CLI's exit status (``python -m flows.pipeline``, ``flows.stage``,
``flows.retrain``), the MLflow status of a stage's run and of the pipeline's parent run, what the pipeline's
Prefect flow run is renamed to and which ``rlhf.<tag>`` names the stage, and whether Prefect may retry a stage
(never bad input, never a stop: they fail the same way twice, or were asked for).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.checkpointing import Preempted
from rlhf_core.data import DataFormatError
from tasks.process.distributed import LauncherError
from tasks.process.locking import EXIT_LOCKED, CheckoutLocked
from tasks.spec.param_rules import ParamsError

EXIT_USAGE = 2
"""A configuration error (params.yaml, ``prepare.source``: nothing started), or a stage that runs in one process
started by a launcher with several."""
EXIT_STOPPED = 75
"""Stopped by SIGTERM/SIGINT with its state saved, or its params/inputs changed while it ran (not recorded): run it
again to resume (``EX_TEMPFAIL``)."""


class ConfigError(ValueError):
    """params.yaml or the data it names is wrong; the run stopped before anything started (the message says what)."""


class StageInputsChanged(RuntimeError):
    """A stage's params or dependencies changed while it ran: its outputs match neither version, so it is not
    recorded in dvc.lock (run it again: the CLIs exit 75, :data:`EXIT_STOPPED`)."""

    def __init__(self, stage: str, changed: list[str]) -> None:
        self.stage, self.changed = stage, changed
        super().__init__(f"stage {stage}: {', '.join(changed)} changed while it ran; not recorded in dvc.lock "
                         "(it stays stale: run it again to train on the current values)")


@dataclass(frozen=True)
class Outcome:
    """What an exception means for the run it ended. ``flow_run_name`` and ``warning`` take ``{stage}`` and
    ``{error}``."""

    kind: str
    """``config``, ``launcher``, ``locked``, ``stopped``, ``inputs_changed``, ``bad_input`` or ``failed``."""
    exit_status: int | None
    """A CLI's exit status; None: a failure the CLI lets propagate (exit 1, with its traceback)."""
    mlflow_status: str
    """The status the stage's run and the pipeline's parent run end with."""
    retry: bool
    """Prefect may retry the stage (a transient failure), when its row allows retries."""
    tag: str | None = None
    """``rlhf.<tag>`` of the parent run names the stage it happened in."""
    flow_run_name: str | None = "pipeline: FAILED at {stage}"
    """The pipeline's Prefect flow run is renamed to this."""
    warning: str | None = None
    """Logged by the pipeline when it ends this way."""


_FAILED = Outcome("failed", None, "FAILED", retry=True)
OUTCOMES: tuple[tuple[tuple[type[BaseException], ...], Outcome], ...] = (
    ((ConfigError,), Outcome("config", EXIT_USAGE, "FAILED", retry=False)),
    ((LauncherError,), Outcome("launcher", EXIT_USAGE, "FAILED", retry=False)),
    ((CheckoutLocked,), Outcome("locked", EXIT_LOCKED, "FAILED", retry=True)),
    # earlier stages stay recorded; this one is not; no registry step
    ((Preempted,), Outcome("stopped", EXIT_STOPPED, "KILLED", retry=False, tag="preempted", flow_run_name=None,
                           warning="stage {stage} stopped ({error}); run the pipeline again to resume it")),
    # earlier stages stay recorded; this one and later ones stay stale
    ((StageInputsChanged,), Outcome("inputs_changed", EXIT_STOPPED, "KILLED", retry=False, tag="inputs_changed",
                                    flow_run_name="pipeline: inputs changed during {stage}",
                                    warning="{error}; later stages and the registry step skipped")),
    # a malformed file or params fail the same way twice
    ((DataFormatError, ParamsError, FileNotFoundError, ValueError), Outcome("bad_input", None, "FAILED", retry=False)),
)
"""The taxonomy, most specific first: the first row whose types match decides; anything else is :data:`_FAILED`."""


def classify(error: BaseException) -> Outcome:
    """What ``error`` means for the run it ended (:data:`OUTCOMES`)."""
    return next((outcome for kinds, outcome in OUTCOMES if isinstance(error, kinds)), _FAILED)


__all__ = ["ConfigError", "EXIT_STOPPED", "EXIT_USAGE", "OUTCOMES", "Outcome", "StageInputsChanged", "classify"]
