"""Wall-clock timing of a trainer's phases: one context manager instead of start/stop bookkeeping per phase."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


@contextlib.contextmanager
def phase_timer(timing: dict[str, float], phase: str, prefix: str = "time/ppo") -> Iterator[None]:
    """Record the wall time of the block as ``timing[f"{prefix}/{phase}"]`` (seconds), also when it raises."""
    start = time.time()
    try:
        yield
    finally:
        timing[f"{prefix}/{phase}"] = time.time() - start
