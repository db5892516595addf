"""One supervisor for a run of the pipeline, or of one stage, in a checkout: :class:`PipelineRun`.

Entering it, in this order: SIGTERM/SIGINT become stop requests, Prefect's temporary server is kept out of our
process group, the checkout's lock is taken (once: a second run waits or refuses, naming this one), params.yaml and
``prepare.source`` are checked (:class:`ConfigError`: nothing started), and what killed runs left behind is cleaned
(``tasks/run/orphans.py``). Inside it:

- ``run.stage(name)``: the pipeline runs the stage if DVC says it is stale and records it in dvc.lock after;
  one stage run by ``dvc repro`` (``records=False``) always runs and DVC records it. Either way it is stopped first
  if a stop was requested, guarded against its inputs changing while it runs, and its abandoned resume states go.
- ``run.stages(names, workers=N)``: stages that depend only on earlier ones (the policies), side by side when N > 1.
- ``run.registry()``: the registry step.
- ``run.parent_run()``: the pipeline's MLflow parent run, ended with the status ``tasks.process.outcome.classify``
  gives the run's exception (a stop, inputs that changed, any other failure), or ``FINISHED``.

A CLI enters the run before Prefect starts; the flow it calls joins it (:func:`pipeline_run`), so nothing is taken
twice. ``tasks.process.outcome.classify`` is the one mapping of an exception to a CLI's exit status.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from rlhf_core.checkpointing import Preempted, on_stop_signal, stop_requested
from tasks.process.distributed import is_main_process, require_single_process
from tasks.process.locking import checkout_lock
from tasks.process.logs import get_logger
from tasks.process.outcome import EXIT_STOPPED, ConfigError, classify
from tasks.process.prefect_context import in_prefect_run, rename_flow_run
from tasks.registry.gate import registry_task
from tasks.run.orphans import clean_after_dead_runs, detach_temporary_server
from tasks.run.parallel_stages import raise_for_status, run_side_by_side
from tasks.run.stage_task import run_stage, run_stage_task
from tasks.spec.params import PARAMS_FILE, Params
from tasks.spec.paths import remove_stage_checkpoints
from tasks.stages import DEFAULT_STAGES, LAUNCHABLE, load_params
from tasks.stages.common.scoring import read_results
from tasks.stages.common.source import check_source, source_changed
from tasks.store.dvc_ops import changed_inputs, inputs_unchanged, record_stage, stage_snapshot, stage_status
from tasks.store.mlflow_runs import end_pipeline_run, start_pipeline_run

def install_stop_handlers() -> dict:
    """SIGTERM/SIGINT become a stop request for the whole process (``rlhf_core.checkpointing.stop_requested``):
    a training stage saves its state at its next step boundary and raises ``Preempted``. Returns the handlers it
    replaced (nothing outside the main thread, where Python cannot set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, on_stop_signal)
    return previous


class PipelineRun:
    """One run in the checkout ``root``: the pipeline (``records=True``: it asks DVC what is stale and records each
    stage), or a run that records nothing in the checkout's dvc.lock itself (``records=False``: one stage that DVC
    runs and records; a retrain, whose pipeline records in its worktree). ``command`` names the run to a second one
    that finds the checkout taken; ``parent_run_id``: the MLflow run the stage runs hang under (a single stage gets
    it from its caller; the pipeline starts its own in :meth:`parent_run`).

    Under a launcher, only the main process (rank 0) takes the lock and cleans up; the others just run the stage."""

    _active: dict[Path, PipelineRun] = {}  # the run supervising each checkout in this process

    def __init__(self, root: str | Path, command: str, *, records: bool = True,
                 parent_run_id: str | None = None) -> None:
        self.root, self.command, self.records = Path(root).resolve(), command, records
        self.parent_run_id = parent_run_id or None
        self.params: Params | None = None
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.current = ""
        """The stage (or ``registry``) running now: where a failure happened."""
        self.decision: dict = {"registered": False, "reason": "registry disabled"}
        self.kept = False
        """Whether the pipeline's MLflow parent run was kept (a run that did nothing is deleted)."""
        self._stack = contextlib.ExitStack()

    @classmethod
    def active(cls, root: str | Path) -> PipelineRun | None:
        """The run supervising ``root`` in this process, if one is open."""
        return cls._active.get(Path(root).resolve())

    def __enter__(self) -> PipelineRun:
        if self.active(self.root) is not None:
            raise RuntimeError(f"{self.root}: a pipeline run is already open in this process (join it with "
                               "tasks.run.supervisor.pipeline_run)")
        with contextlib.ExitStack() as stack:
            previous = install_stop_handlers()
            stack.callback(lambda: [signal.signal(sig, handler) for sig, handler in previous.items()])
            if is_main_process():
                if self.records:  # the pipeline flow is single-process
                    require_single_process("the pipeline flow", LAUNCHABLE, "`python -m flows.pipeline`; launch only "
                                           "the training stages, one at a time (`accelerate launch ... -m flows.stage "
                                           "sft`)")
                detach_temporary_server()  # a signal to our process group must not kill Prefect's server first
                stack.enter_context(checkout_lock(self.root, self.command))
                if self.records:  # (one stage reads params.yaml itself, and not prepare.source unless it is prepare)
                    self.params = self._checked_params()
                clean_after_dead_runs(self.root)  # MLflow runs and Prefect servers a killed run left behind
            self._active[self.root] = self
            stack.callback(self._active.pop, self.root, None)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _checked_params(self) -> Params:
        """params.yaml and the data ``prepare.source`` names, checked before any server or model starts."""
        try:
            params = load_params(self.root / PARAMS_FILE)
            check_source(params.prepare, self.root)
        except (ValueError, FileNotFoundError) as error:  # ParamsError, DataFormatError are ValueErrors
            raise ConfigError(str(error)) from error
        return params

    def stage(self, name: str, force: bool = False) -> dict | None:
        """Run stage ``name`` (the pipeline: only if stale, or ``force``); returns what it wrote to its metrics
        file, None when it was up to date. Raises ``Preempted`` when a stop was requested before it started, and
        ``StageInputsChanged`` when its params or deps changed while it ran (it is then not recorded)."""
        self.current = name
        if not is_main_process():  # a rank of a launch besides rank 0, which supervises: the stage's body alone
            return run_stage(name, self.root, self.parent_run_id)
        if not self._due(name, force):
            return None
        with inputs_unchanged(self.root, name):  # params/deps edited mid-run: not recorded (issue 12.1)
            result = self._run(name)
        self._finish(name)
        return result

    def stages(self, names: tuple[str, ...], force: bool = False, workers: int = 1) -> None:
        """Run the stages ``names``, which depend only on stages before them: one after another with ``workers``
        1, else the stale ones side by side, each in its own ``flows.stage`` process (``tasks/run/parallel_stages.py``),
        recorded in ``names``' order once all ended; a failed or stopped one raises after the others are recorded."""
        if workers <= 1 or len(names) == 1 or not is_main_process():
            for name in names:
                self.stage(name, force=force)
            return
        due = [name for name in names if self._due(name, force)]
        if not due:
            return
        self.current = ",".join(due)
        before = {name: stage_snapshot(self.root, name) for name in due}
        codes = run_side_by_side(due, self.root, self.parent_run_id, workers)
        for name in due:  # inputs edited after a stage ended, before it is recorded: not recorded (issue 12.1)
            if codes[name] == 0 and changed_inputs(before[name], stage_snapshot(self.root, name)):
                get_logger().warning("stage %s: its params or deps changed while it ran: NOT recorded", name)
                codes[name] = EXIT_STOPPED
            if codes[name] == 0:
                self._finish(name)
        raise_for_status(codes)

    def _due(self, name: str, force: bool) -> bool:
        """Whether ``name`` runs now (stale, forced, or a stage run that DVC records); raises ``Preempted`` when a
        stop was requested."""
        if stop_requested():  # a signal during a stage without step checks (prepare, evaluate): stop here
            raise Preempted("", message=f"stopped by a stop request before stage {name} (nothing of it ran); "
                                        "run the pipeline again to go on")
        if not self.records:
            return True
        changes = self._changes(name)
        if not (changes or force):
            get_logger().info("stage %s: up to date, skipped", name)
            self.skipped.append(name)
            return False
        get_logger().info("stage %s: running (%s)", name, describe_changes(changes) if changes else "forced")
        return True

    def _finish(self, name: str) -> None:
        """``name`` completed: its abandoned resume states go, the pipeline records it in dvc.lock."""
        self._forget_abandoned_states(name)
        if self.records:
            record_stage(str(self.root), name)
        self.ran.append(name)

    def _changes(self, name: str) -> dict:
        """What DVC says changed for ``name`` ({} when up to date); for prepare also the file ``prepare.source``
        names, which DVC cannot see."""
        changes = stage_status(str(self.root), name)
        if name == "prepare" and not changes:
            why = source_changed(self.params.prepare, self.root, self.root / self.params.paths.data)
            changes = {"prepare": [why]} if why else {}
        return changes

    def _run(self, name: str) -> dict:
        """The stage's Prefect task inside a flow run, else its function (a non-main rank: no Prefect at all)."""
        if in_prefect_run():
            return run_stage_task(name, self.root, self.parent_run_id)
        return run_stage(name, self.root, self.parent_run_id)

    def _forget_abandoned_states(self, name: str) -> None:
        """The stage completed: resume states in ``.checkpoints/`` of its earlier (abandoned) params go too."""
        removed = remove_stage_checkpoints(self.root, name)
        if removed:
            get_logger().info("stage %s: removed %d abandoned resume state(s): %s", name, len(removed),
                              ", ".join(p.name for p in removed))

    def registry(self) -> dict:
        """The registry step: register the evaluated challenger, move ``champion`` if it wins."""
        self.current = "registry"
        self.decision = registry_task(str(self.root), self.parent_run_id)
        return self.decision

    @contextlib.contextmanager
    def parent_run(self) -> Iterator[PipelineRun]:
        """The pipeline's MLflow parent run around the block, named for what the run did when it ends; ended as
        ``classify`` says when the block raises (the exception propagates)."""
        self.parent_run_id = start_pipeline_run(self.root, entry="prefect") or None
        try:
            yield self
        except BaseException as error:
            self._end(error)
            raise
        self._end(None)

    def _end(self, error: BaseException | None) -> None:
        summary, ending = {"ran": ",".join(self.ran)}, None
        if error is None:
            summary = {"ran": ",".join(self.ran) or "nothing", "registry": self.decision.get("reason")}
            rename_flow_run(f"pipeline: {','.join(self.ran) or 'up to date'}")
        else:
            ending = classify(error)
            if ending.warning:
                get_logger().warning(ending.warning.format(stage=self.current, error=error))
            if ending.flow_run_name:
                rename_flow_run(ending.flow_run_name.format(stage=self.current))
            if ending.tag:
                summary[ending.tag] = self.current
        self.kept = end_pipeline_run(
            self.root, self.parent_run_id or "", ending.mlflow_status if ending else "FINISHED", summary, params=self.params,
            ran=self.ran, skipped=self.skipped, registry=None if ending else self.decision,
            failed_stage=self.current if ending else None, error=error, results=read_results(self.root, self.params.paths),
            default_stages=DEFAULT_STAGES)


@contextlib.contextmanager
def pipeline_run(root: str | Path, command: str, **options) -> Iterator[PipelineRun]:
    """The run supervising ``root`` in this process: the one its CLI opened before Prefect started, else a new
    :class:`PipelineRun` (a flow called from Python: a test, the retraining flow's worktree)."""
    active = PipelineRun.active(root)
    if active is not None:
        yield active
        return
    with PipelineRun(root, command, **options) as run:
        yield run


def describe_changes(changes: dict) -> str:
    """DVC's ``status`` of a stage as one short line (``changed deps: ...; changed params: ...``)."""
    parts = []
    for entries in changes.values():
        for entry in entries:
            if isinstance(entry, dict):
                for kind, what in entry.items():
                    parts.append(f"{kind}: {', '.join(what) if isinstance(what, dict) else what}")
            else:
                parts.append(str(entry))
    return "; ".join(parts)[:300] or "changed"


__all__ = ["PipelineRun", "describe_changes", "install_stop_handlers", "pipeline_run"]
