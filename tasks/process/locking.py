"""One lock per checkout: pipeline runs, retraining runs and single stages never run side by side.

``checkout_lock(root, command)`` takes an exclusive ``flock`` on ``rlhf-run.lock`` in the checkout's DVC temp folder (``.dvc`` / ``tmp``; the project
root's ``.rlhf-run.lock`` where there is no ``.dvc/``) and writes the holder into it: pid, host, command, start
time and a random token. A second run waits up to ``wait_s`` seconds (``--wait`` on the CLIs, default
``$RLHF_LOCK_WAIT_S`` or 0) and then refuses with :class:`CheckoutLocked`, naming the holder.

- A dead holder's lock is free: the kernel drops a ``flock`` when its process exits (even on ``kill -9``), so the
  next run takes it over; the file's stale contents are only reported.
- Re-entrant for one run: inside this process (the pipeline flow holds it and calls the stage tasks; the retrain
  flow holds it and calls the pipeline flow) a nested ``checkout_lock`` is a no-op; the holder's token is exported
  as ``$RLHF_LOCK_TOKEN``, so a child process (``dvc repro`` started by the holder running ``python -m flows.stage``)
  that finds the lock held by that token proceeds as part of the same run.

POSIX only (``fcntl``), like the rest of the pipeline's process handling.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from rlhf_core.tracking import env_seconds
from tasks.spec.paths import project_root

LOCK_NAME = "rlhf-run.lock"
TOKEN_ENV = "RLHF_LOCK_TOKEN"
"""The holder's token, inherited by the processes it starts (re-entrancy across ``dvc repro``)."""
WAIT_ENV = "RLHF_LOCK_WAIT_S"
"""Default seconds a run waits for the lock before refusing (0: refuse at once)."""
EXIT_LOCKED = 73
"""Exit status of a CLI refused because another run holds the checkout (``EX_CANTCREAT``)."""
POLL_S = 0.2

_held: dict[Path, str] = {}  # lock file -> token, for the locks this process holds
log = logging.getLogger("rlhf.lock")


class CheckoutLocked(RuntimeError):
    """Another run holds this checkout's lock (the message names it: pid, host, command, since when)."""


def lock_path(root: str | Path) -> Path:
    """``.dvc/tmp`` (ignored by git, DVC's own scratch) where the checkout has one, else the project root. One lock
    per checkout: a task folder's runs (``pipelines/<task>``) take the same one as the root's (they share DVC's repo
    and cache)."""
    root = project_root(root)
    return root / ".dvc" / "tmp" / LOCK_NAME if (root / ".dvc").is_dir() else root / f".{LOCK_NAME}"


def read_holder(path: str | Path) -> dict:
    """The holder recorded in the lock file (``{}`` if none or unreadable)."""
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}


def describe(holder: dict) -> str:
    if not holder:
        return "an unknown process"
    return (f"pid {holder.get('pid')} on {holder.get('host')} ({holder.get('command')!r}, "
            f"since {holder.get('started')})")


def default_wait() -> float:
    """``$RLHF_LOCK_WAIT_S`` as seconds (0 when unset); a bad value is an error naming the variable."""
    return env_seconds(WAIT_ENV, 0.0)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _write_holder(fd: int, command: str, token: str) -> None:
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": token}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)


@contextlib.contextmanager
def checkout_lock(root: str | Path, command: str | None = None, wait_s: float | None = None) -> Iterator[dict]:
    """Hold the checkout's lock for the block; yields the holder record (this run's, or the parent run's).

    ``wait_s``: seconds to wait for a running holder (``None``: :func:`default_wait`); then :class:`CheckoutLocked`.
    """
    path = lock_path(root)
    if path in _held:  # nested in this process: the same run
        yield read_holder(path)
        return
    wait_s = default_wait() if wait_s is None else wait_s
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, announced = time.monotonic() + wait_s, False
        while not _try_flock(fd):
            holder = read_holder(path)
            if holder.get("token") and holder.get("token") == os.environ.get(TOKEN_ENV):
                yield holder  # started by the holder (dvc repro -> flows.stage): part of its run
                return
            if time.monotonic() >= deadline:
                raise CheckoutLocked(f"another run holds this checkout ({path}): {describe(holder)}; "
                                     f"wait for it to finish, or pass --wait SECONDS / set ${WAIT_ENV}")
            if not announced:
                log.warning("waiting up to %.0f s for the checkout lock held by %s", wait_s, describe(holder))
                announced = True
            time.sleep(POLL_S)
        stale = read_holder(path)
        if stale.get("pid") and stale.get("pid") != os.getpid():
            log.warning("taking over the checkout lock left by %s (no longer running)", describe(stale))
        token = secrets.token_hex(8)
        _write_holder(fd, command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), token)
        _held[path], previous_env = token, os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = token
        try:
            yield read_holder(path)
        finally:
            del _held[path]
            if previous_env is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = previous_env
            os.ftruncate(fd, 0)  # released: nobody to name
    finally:
        os.close(fd)  # drops the flock


def add_wait_argument(parser: argparse.ArgumentParser) -> None:
    """The CLIs' ``--wait SECONDS``: how long to wait for another run holding the checkout (sets
    ``$RLHF_LOCK_WAIT_S``, so the ``flows.stage`` processes of a ``dvc repro`` it starts inherit it)."""
    parser.add_argument("--wait", type=float, default=None, metavar="SECONDS", action=_SetWaitEnv,
                        help=f"wait up to SECONDS for another run holding this checkout (default ${WAIT_ENV} or 0: "
                             "refuse at once, naming it)")


class _SetWaitEnv(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[WAIT_ENV] = str(values)
        setattr(namespace, self.dest, values)


__all__ = ["CheckoutLocked", "EXIT_LOCKED", "TOKEN_ENV", "WAIT_ENV", "add_wait_argument", "checkout_lock",
           "default_wait", "describe", "lock_path", "read_holder"]
