"""Logs and progress bars for the stage tasks: Prefect's run logger inside a run, rank 0 tells the story."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from tasks.process.ranks import is_main_process


EXPECTED_LOAD_REPORTS = {
    ("MISSING", "score."): "the score head is new (expected: the reward model starts from the SFT language model "
                           "and trains this head)",
    ("UNEXPECTED", "v_head."): "the PPO value head is not loaded (expected: a policy is used as a plain language "
                               "model; the value head only served PPO training)",
}
"""(status, key prefix) of transformers load-report rows this pipeline expects -> the one-line explanation."""

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def load_report_rows(message: str) -> list[tuple[str, str]]:
    """The (key, status) rows of a transformers ``LOAD REPORT`` message (ANSI colours removed)."""
    rows = []
    for line in _ANSI.sub("", message).splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 2 and cells[1] in ("MISSING", "UNEXPECTED", "MISMATCH", "CONVERSION"):
            rows.append((cells[0], cells[1]))
    return rows


def explain_load_report(message: str) -> str | None:
    """One line for a load report whose every row is expected (``EXPECTED_LOAD_REPORTS``); None for any other
    report (it is then shown in full: a real mismatch must stay visible)."""
    rows = load_report_rows(message)
    if not rows:
        return None
    reasons = []
    for key, status in rows:
        reason = next((text for (st, prefix), text in EXPECTED_LOAD_REPORTS.items()
                       if st == status and key.startswith(prefix)), None)
        if reason is None:
            return None
        if reason not in reasons:
            reasons.append(reason)
    head = _ANSI.sub("", message).splitlines()[0].replace(" LOAD REPORT", "").strip()  # "<Class> from: <path>"
    keys = ", ".join(key for key, _ in rows)
    return f"load {head}: {keys}: " + "; ".join(reasons)


class ExpectedLoadReportFilter(logging.Filter):
    """Turns an expected transformers load report (a multi-line warning table) into one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - never break logging
            return True
        if "LOAD REPORT" in message and (line := explain_load_report(message)) is not None:
            record.msg, record.args = line, ()
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install_load_report_filter() -> None:
    """Attach ``ExpectedLoadReportFilter`` to the logger transformers reports loads on (once)."""
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, ExpectedLoadReportFilter) for f in logger.filters):
        logger.addFilter(ExpectedLoadReportFilter())


KNOWN_HARMLESS = {
    ("transformers.modeling_utils", "`loss_type=None` was set in the config but it is unrecognized"):
        # transformers says this of every causal LM whose config names no loss type (ours never do): nothing was
        # set, and the default it falls back to, ForCausalLMLoss, is the loss such a model has
        "no loss type configured: the causal-LM default applies",
    ("dvc.repo.scm_context", "\nTo track the changes with git, run:"):
        # printed after `dvc add` in the intake: the intake stages and commits those files itself (tasks/feedback/intake.py)
        "the intake commits the .dvc files itself",
    ("dvc.repo.scm_context", "\nTo enable auto staging, run:"):
        # the same hint's second half: auto staging would let DVC stage files the intake must commit atomically
        "the intake stages files itself",
}
"""(logger, message start) -> why it is harmless: known messages of third-party libraries that the entry points
drop (``quiet_known_messages``), each with the reason it needs no action. Anything else stays visible."""


class KnownMessageFilter(logging.Filter):
    """Drops the records listed in :data:`KNOWN_HARMLESS` for the logger it is attached to."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - never break logging
            return True
        return not message.startswith(self.starts)


def quiet_known_messages() -> None:
    """Attach a :class:`KnownMessageFilter` to each logger of :data:`KNOWN_HARMLESS` (once; the entry points call
    it before the libraries log: a logger created now is the one the library gets later)."""
    by_logger: dict[str, list[str]] = {}
    for (name, start), _why in KNOWN_HARMLESS.items():
        by_logger.setdefault(name, []).append(start)
    for name, starts in by_logger.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, KnownMessageFilter) for f in logger.filters):
            logger.addFilter(KnownMessageFilter(tuple(starts)))


DVC_LOGGERS = ("dvc", "dvc_objects", "dvc_data")
"""The loggers ``import dvc`` gives their own stdout/stderr handlers (``dvc.logger.setup``)."""


def single_dvc_output() -> None:
    """Drop the console handlers ``import dvc`` adds, so each DVC message (``Updating lock file``) is printed
    once, by the pipeline's own handlers, instead of twice (DVC's plain line plus the propagated record)."""
    root_console = any(isinstance(h, logging.StreamHandler) for h in logging.getLogger().handlers)
    if not root_console:  # nothing would print DVC's warnings: keep its handlers
        return
    for name in DVC_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler).__module__.startswith("dvc"):
                logger.removeHandler(handler)


def get_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow/task run (logs stream into the Prefect UI), else a plain one.
    (Also installs ``ExpectedLoadReportFilter``: stages get their logger before they load models.)"""
    install_load_report_filter()
    try:
        from prefect import get_run_logger  # prefect: only when a stage logs (flows/process.py imports this module before torch)
        from prefect.exceptions import MissingContextError

        try:
            return get_run_logger()
        except MissingContextError:
            pass
    except ImportError:  # pragma: no cover
        pass
    logger = logging.getLogger("rlhf_pipeline")
    if not logger.handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logger.setLevel(logging.INFO if is_main_process() else logging.WARNING)  # launched: rank 0 tells the story
    return logger


def on_terminal() -> bool:
    """Progress bars only when a person is watching."""
    return sys.stderr.isatty()


def console_loggers() -> list[logging.Logger]:
    """Every configured logger (root included) with a handler writing to the terminal (stdout/stderr)."""
    candidates = [logging.getLogger(), *(lg for lg in logging.root.manager.loggerDict.values()
                                         if isinstance(lg, logging.Logger))]
    return [lg for lg in candidates if any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
                                           and getattr(h, "stream", None) in (sys.stdout, sys.stderr)
                                           for h in lg.handlers)]


@contextlib.contextmanager
def bar_safe_logging(enabled: bool = True) -> Iterator[None]:
    """While a progress bar is open, log records go through ``tqdm.write`` (above the bar, never into it)."""
    if not enabled:
        yield
        return
    with logging_redirect_tqdm(loggers=console_loggers()):
        yield


@contextlib.contextmanager
def progress_bar(total: int, **kwargs) -> Iterator[Any]:
    """A ``tqdm`` bar of ``total`` steps (``bar.update(n)``), shown only on a terminal and on the main process;
    log lines written while it is open appear above the bar (``bar_safe_logging``)."""
    shown = on_terminal() and is_main_process()
    with bar_safe_logging(shown), tqdm(total=total, disable=not shown, dynamic_ncols=True, **kwargs) as bar:
        yield bar


HEADLINE_KEYS = ("loss", "reward", "kl", "rewards/margins", "rewards/accuracies", "learning_rate")
"""The Trainer log keys a progress line shows, the first :data:`HEADLINE_SHOWN` present, in this order; every
other key goes to MLflow and the stage's CSV only (GRPO/KTO log about 25 keys a step)."""
HEADLINE_SHOWN = 4
PROGRESS_LINES = 10
"""About this many progress lines per training stage (one per window of ``max_steps / PROGRESS_LINES`` steps)."""
SUMMARY_KEYS = ("train_runtime", "train_loss")
"""Keys of the Trainer's end-of-training record: its line shows these instead."""


def log_line(stage: str, step: int, max_steps: int, logs: Mapping[str, Any]) -> str:
    """One short line for a Trainer log record, e.g. ``sft step 20/64 (epoch 0.31): loss 1.234, learning_rate
    0.0005`` (the first :data:`HEADLINE_SHOWN` of :data:`HEADLINE_KEYS` present; numbers to 4 significant digits).
    The end-of-training record shows :data:`SUMMARY_KEYS`."""
    keys = SUMMARY_KEYS if "train_runtime" in logs else HEADLINE_KEYS
    numbers = {k: logs[k] for k in keys if isinstance(logs.get(k), (int, float)) and not isinstance(logs[k], bool)}
    shown = [f"{k} {v:.4g}" for k, v in list(numbers.items())[:HEADLINE_SHOWN]]
    epoch = f" (epoch {logs['epoch']:.2f})" if isinstance(logs.get("epoch"), (int, float)) else ""
    return f"{stage} step {step}/{max_steps}{epoch}: " + (", ".join(shown) or "-")


def progress_window(max_steps: int) -> int:
    """Steps per progress line: about :data:`PROGRESS_LINES` lines per stage, at least one step."""
    return max(1, -(-max_steps // PROGRESS_LINES))


def shows_progress(step: int, max_steps: int, logs: Mapping[str, Any]) -> bool:
    """Whether the log record of ``step`` gets a progress line: the last step of each window, the final step
    and the end-of-training summary (the other records go to MLflow and the CSVs only)."""
    return "train_runtime" in logs or step == max_steps or step % progress_window(max_steps) == 0


def quiet_trainer_output(trainer: Any, stage: str) -> None:
    """Replace transformers' log printers (``PrinterCallback`` prints raw dicts; ``ProgressCallback`` writes them
    under its bar) with ``StageProgressCallback``: one bar on a terminal, one log line per logging step."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback  # transformers: only when a Trainer-based stage runs

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(stage_progress_callback(stage))


def stage_progress_callback(stage: str) -> Any:
    """A ``TrainerCallback`` for one training stage: a tqdm bar named after it on a terminal (log records routed
    above it), and one short ``log_line`` per progress window through the stage's logger (no raw dicts)."""
    from transformers import TrainerCallback  # transformers: only when a Trainer-based stage runs

    class StageProgressCallback(TrainerCallback):
        def __init__(self) -> None:
            self.bar, self.redirect = None, contextlib.ExitStack()

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero and on_terminal():
                self.redirect.enter_context(bar_safe_logging())
                self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=stage, unit="step",
                                dynamic_ncols=True)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and shows_progress(state.global_step, state.max_steps, logs):
                get_logger().info(log_line(stage, state.global_step, state.max_steps, logs))

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            self.redirect.close()

    return StageProgressCallback()


__all__ = ["DVC_LOGGERS", "EXPECTED_LOAD_REPORTS", "ExpectedLoadReportFilter", "KNOWN_HARMLESS", "KnownMessageFilter",
           "quiet_known_messages", "bar_safe_logging", "explain_load_report",
           "install_load_report_filter", "load_report_rows", "console_loggers", "get_logger", "log_line", "on_terminal",
           "progress_bar", "progress_window", "quiet_trainer_output", "shows_progress", "single_dvc_output",
           "stage_progress_callback"]
