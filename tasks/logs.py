"""Logs and progress bars for the stage tasks: Prefect's run logger inside a run, rank 0 tells the story."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from tasks.ranks import is_main_process


def get_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow/task run (logs stream into the Prefect UI), else a plain one."""
    try:
        from prefect import get_run_logger
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


def progress(iterable: Iterable, **kwargs) -> Iterable:
    """``tqdm`` over ``iterable``, shown only on a terminal and on the main process."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not on_terminal() or not is_main_process(), **kwargs)


__all__ = ["get_logger", "on_terminal", "progress"]
