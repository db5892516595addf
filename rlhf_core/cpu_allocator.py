"""Keep freed CPU memory in the process for the next tensor, as CUDA's caching allocator does on a GPU.

Why: PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves every block above its mmap
threshold (128 KiB, adapting up to 32 MiB) with a fresh ``mmap`` and gives it back to the kernel on ``free``,
so each large temporary (a PPO mini-batch's (b, A, V) logits, their log-softmax, their gradient: 20-60 MB
each, tens per step) is page-faulted in and zeroed by the kernel again. On the mid-size PPO step bench that
kernel work was about 40% of the step (``/usr/bin/time``: sys 10.1 s of 33 s). Raising the mmap and trim
thresholds makes glibc serve those blocks from its heap and keep freed ones for reuse: the same arithmetic on
the same bytes, only fewer page faults. The cost is resident memory the process keeps after a peak (measured
on the bench: peak RSS +19% at mid size, -2% at GPT-2 small; ``docs/bench.md``).

Applied once per process by the trainers when they train on the CPU (``keep_freed_cpu_memory``). It is
skipped where it cannot apply or the user chose otherwise: not glibc, another allocator preloaded (jemalloc,
tcmalloc, mimalloc), glibc malloc settings already given in the environment (``MALLOC_*_`` or
``GLIBC_TUNABLES``), or ``RLHF_CORE_KEEP_CPU_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

OPT_OUT_ENV = "RLHF_CORE_KEEP_CPU_MEMORY"
"""Set to ``0`` to leave the C allocator as it is."""

# glibc's mallopt parameter numbers (malloc.h) and the values set.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_MMAP_THRESHOLD: 1 << 30,  # blocks below 1 GiB come from the heap, not from a fresh mmap each time
    M_TRIM_THRESHOLD: 1 << 30,  # give the heap top back to the kernel only when 1 GiB of it is free
    M_TOP_PAD: 64 << 20,  # grow the heap 64 MiB at a time
}
ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(SETTINGS[M_MMAP_THRESHOLD]),
               "MALLOC_TRIM_THRESHOLD_": str(SETTINGS[M_TRIM_THRESHOLD]), "MALLOC_TOP_PAD_": str(SETTINGS[M_TOP_PAD])}
"""The same settings as glibc's environment variables, for a process that does not import rlhf_core."""
_USER_SETTINGS = (*ENVIRONMENT, "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

_state: dict[str, bool] = {}


def skip_reason(environ: dict[str, str] | None = None, platform: str | None = None) -> str | None:
    """Why the settings must not be applied in this process (``None``: apply them)."""
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{OPT_OUT_ENV}={environ[OPT_OUT_ENV]}"
    if not (platform or sys.platform).startswith("linux"):
        return "not Linux"
    chosen = [name for name in _USER_SETTINGS if name in environ]
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    if chosen:
        return f"malloc settings given in the environment ({', '.join(chosen)})"
    preloaded = [name for name in _OTHER_ALLOCATORS if name in environ.get("LD_PRELOAD", "")]
    if preloaded:
        return f"{preloaded[0]} is preloaded"
    return None


def keep_freed_cpu_memory() -> bool:
    """Apply ``SETTINGS`` to glibc malloc once per process; True when they are in effect.

    Results do not change (the same operations on the same values); only where freed memory goes does.
    """
    if "applied" not in _state:
        _state["applied"] = _apply()
    return _state["applied"]


def _apply() -> bool:
    reason = skip_reason()
    if reason is None:
        mallopt = _glibc_mallopt()
        if mallopt is None:
            reason = "the C library has no mallopt (not glibc)"
        elif not all(mallopt(param, value) == 1 for param, value in SETTINGS.items()):
            reason = "glibc refused a mallopt setting"
    if reason is not None:
        logger.info("CPU allocator left as it is: %s", reason)
        return False
    logger.info("CPU allocator: freed blocks below 1 GiB are kept for reuse (%s=0 turns this off)", OPT_OUT_ENV)
    return True


def _glibc_mallopt():
    """glibc's ``mallopt`` (``int mallopt(int, int)``), or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return None
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
