"""Which process of a launch this is, read from the launcher's environment (no process group needed).

``accelerate launch`` / ``torchrun`` (and ``mpirun``) set these variables before Python starts, so the rank is
known before any collective exists. A leaf module (standard library only): ``tasks.process.logs`` and
``tasks.process.distributed`` both read it, and neither needs the other for it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

WORLD_SIZE_ENV = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
RANK_ENV = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def _int_env(names: Sequence[str], default: int) -> int:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return int(value)
    return default


def world_size() -> int:
    """Number of processes in this launch (1 without a launcher)."""
    return max(1, _int_env(WORLD_SIZE_ENV, 1))


def process_rank() -> int:
    """Global rank of this process (0 without a launcher)."""
    return _int_env(RANK_ENV, 0) if world_size() > 1 else 0


def is_main_process() -> bool:
    """True in the process that writes (global rank 0), and always in a single process."""
    return process_rank() == 0


__all__ = ["RANK_ENV", "WORLD_SIZE_ENV", "is_main_process", "process_rank", "world_size"]
