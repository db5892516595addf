"""What a killed run leaves behind, cleaned on the next start (issue 12.5; a torn ``dvc.lock``: issue 24).

- **Prefect's temporary server** (started by a flow when no ``PREFECT_API_URL`` is set) runs in its own session:
  a Ctrl-C or SIGTERM sent to the terminal's process group (``timeout``, Slurm, systemd do the same) reaches the
  pipeline, which saves its state and exits 75, instead of killing the server first (the run then retried the
  dead server for minutes and exited 1). The server's environment names its owner (``RLHF_PREFECT_OWNER``: pid),
  so a server whose owner died (``kill -9``) is stopped by the next run (``stop_orphaned_servers``); a normal
  exit stops it as before (Prefect's ``atexit``), a stopped run at once (``stop_temporary_server``).
- **MLflow runs left RUNNING**: every pipeline and stage run is tagged with its process (``RUN_OWNER_TAGS``);
  ``end_orphaned_runs`` ends the RUNNING ones whose process on this host is gone as KILLED, tagged
  ``rlhf.ended_by``.

Linux (``/proc``); elsewhere the orphan sweeps find nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import types
from pathlib import Path

from rlhf_core.checkpointing import pid_alive
from tasks.process.logs import get_logger
from tasks.store.dvc_lockfile import repair_lockfile
from tasks.store.mlflow_runs import mlflow_setup, tracking_reachable
from tasks.store.provenance import RUN_OWNER_TAGS, owner_tags  # noqa: F401  (owner_tags re-exported)

OWNER_ENV = "RLHF_PREFECT_OWNER"
SERVER_MARK = "prefect.server.api.server:create_app"


def detach_temporary_server() -> None:
    """Make Prefect start its temporary server in a new session with ``RLHF_PREFECT_OWNER`` set (idempotent)."""
    from prefect.server.api import server as prefect_server  # prefect: only when a flow will start its server

    if getattr(prefect_server.subprocess, "_rlhf_detached", False):
        return

    def popen(*args, **kwargs):
        kwargs["start_new_session"] = True  # process-group signals (Ctrl-C, timeout, Slurm) do not reach it
        kwargs["env"] = {**(kwargs.get("env") or os.environ), OWNER_ENV: str(os.getpid())}
        return subprocess.Popen(*args, **kwargs)

    shim = types.SimpleNamespace(**{k: getattr(subprocess, k) for k in dir(subprocess) if not k.startswith("__")})
    shim.Popen, shim._rlhf_detached = popen, True
    prefect_server.subprocess = shim  # only that module's Popen changes
    server = prefect_server.SubprocessASGIServer
    if not getattr(server.start, "_rlhf_serialised", False):
        server.start = serialised_start(server.start)


START_LOCK = "rlhf-server-start.lock"
"""In ``$PREFECT_HOME``: held while a temporary server starts (it creates or migrates the database there)."""


def serialised_start(start):
    """Prefect's ``SubprocessASGIServer.start``, under :func:`prefect_home_lock` until the server answers: two
    checkouts starting on a fresh ``~/.prefect`` raced its migration (an 87-line traceback); the second now waits
    for the first server to be up (the database migrated), then starts its own, saying so."""
    def start_one_at_a_time(self, timeout=None):
        if self.running:
            return start(self, timeout)
        with prefect_home_lock():
            return start(self, timeout)

    start_one_at_a_time._rlhf_serialised = True
    return start_one_at_a_time


@contextlib.contextmanager
def prefect_home_lock():
    """An exclusive lock on ``$PREFECT_HOME/rlhf-server-start.lock`` (released when the process dies)."""
    from prefect.settings import PREFECT_HOME  # prefect: only when a temporary server starts

    home = Path(PREFECT_HOME.value()).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / START_LOCK, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            get_logger().info("another checkout is starting a Prefect temporary server on %s: waiting for it", home)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def stop_temporary_server(grace_s: float = 2.0) -> list[int]:
    """Stop this process's temporary Prefect server now; returns the pids stopped.

    SIGTERM, then SIGKILL after ``grace_s`` seconds (Prefect's ``atexit`` waits up to 5 s for uvicorn's graceful
    shutdown; the server's SQLite database is safe under a kill). For a run that was stopped and has flushed
    its logs: nothing is left for the server to do. Servers naming this process as owner that Prefect does not
    know (``/proc`` scan) are killed too, so none outlives the run.
    """
    stopped = []
    try:
        from prefect.server.api.server import SubprocessASGIServer  # prefect: only on the way out of a stopped run

        servers = list(SubprocessASGIServer._instances.values())  # Prefect's registry: one server per port
    except (ImportError, AttributeError):
        servers = []
    for server in servers:
        process = getattr(server, "server_process", None)
        if process is None:
            continue
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        stopped.append(process.pid)
        server.server_process = None
        server.stop()  # Prefect's bookkeeping only (the process is gone): its atexit hook then does nothing
    for pid, owner in _servers():
        if owner == os.getpid() and pid not in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                stopped.append(pid)
    return stopped


def _servers() -> list[tuple[int, int]]:
    """``(server pid, owner pid)`` of every temporary Prefect server started by this project (``/proc`` scan)."""
    found = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if SERVER_MARK.encode() not in (entry / "cmdline").read_bytes():
                continue
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        owner = next((e.split(b"=", 1)[1] for e in env if e.startswith(OWNER_ENV.encode() + b"=")), b"")
        if owner.isdigit():
            found.append((int(entry.name), int(owner)))
    return found


def stop_orphaned_servers() -> list[int]:
    """SIGTERM every temporary Prefect server whose owning run is gone; returns their pids."""
    stopped = []
    for pid, owner in _servers():
        if not pid_alive(owner):
            try:
                os.kill(pid, signal.SIGTERM)
                stopped.append(pid)
            except ProcessLookupError:
                pass
    return stopped


def end_orphaned_runs(root: str | Path) -> list[str]:
    """End as KILLED the RUNNING MLflow runs of this project's experiment whose owning process on this host is
    gone (``kill -9``, power loss); returns their run ids. Nothing when the tracking server is unreachable."""
    import mlflow  # mlflow: only when a run starts (flows/process.py imports this module on the way out)

    if not tracking_reachable(root):
        return []
    experiment_id = mlflow_setup(root)
    client = mlflow.MlflowClient()
    host, ended = socket.gethostname(), []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=500):
        tags = run.data.tags
        pid = tags.get("rlhf.pid", "")
        if tags.get("rlhf.host") != host or not pid.isdigit() or int(pid) == os.getpid() or pid_alive(int(pid)):
            continue
        client.set_tag(run.info.run_id, "rlhf.ended_by", f"next start: owning process {pid} on {host} was gone")
        client.set_terminated(run.info.run_id, status="KILLED")
        ended.append(run.info.run_id)
    return ended


def clean_after_dead_runs(root: str | Path) -> None:
    """The start-of-run sweep (inside the checkout lock): a torn dvc.lock repaired (``tasks/store/dvc_lockfile.py``: or
    :class:`~tasks.store.dvc_lockfile.LockfileTorn` naming the command that repairs it), orphaned servers stopped, orphaned
    runs ended."""
    log = get_logger()
    repaired = repair_lockfile(root)
    if repaired:
        log.warning(repaired)
    servers = stop_orphaned_servers()
    if servers:
        log.warning("stopped %d temporary Prefect server(s) left by killed runs: pid %s", len(servers),
                    ", ".join(map(str, servers)))
    try:
        runs = end_orphaned_runs(root)
    except Exception as error:  # noqa: BLE001 - bookkeeping must not stop a run
        log.warning("could not check for MLflow runs left RUNNING by killed runs: %s", error)
        return
    if runs:
        log.warning("ended %d MLflow run(s) left RUNNING by killed runs (status KILLED): %s", len(runs),
                    ", ".join(runs))


__all__ = ["OWNER_ENV", "RUN_OWNER_TAGS", "clean_after_dead_runs", "detach_temporary_server", "end_orphaned_runs",
           "owner_tags", "stop_orphaned_servers", "stop_temporary_server"]
