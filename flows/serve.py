"""Team mode on one machine: ``python -m flows.serve start|stop`` (``make serve`` / ``make serve-stop``).

``start`` brings up, on 127.0.0.1 only: a Prefect server, a ``process`` work pool with a worker, and an
MLflow tracking server on the project's SQLite store; deploys ``prefect.yaml`` (the pipeline, retraining on its
cron and on every ingested feedback batch, and the daily collection of reviewers' judgements); prints the URLs and PIDs and writes them to
``.serve/pids.json`` (logs beside it). ``stop`` stops exactly those processes, by PID (each was started as
the leader of its own process group, so its children stop with it). docs/lifecycle.md says how the same
deployments move to a Docker or Kubernetes work pool and MLflow to PostgreSQL + object storage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from flows.process import configure_process

HOST = "127.0.0.1"
POOL = "local-process"
STATE_DIR = ".serve"


def _bin(name: str) -> str:
    """The console script beside this interpreter (the project's venv), else the one on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def wait_http(url: str, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    """Return once ``url`` answers 200; RuntimeError if ``proc`` exits first, TimeoutError after ``timeout`` seconds
    (both name ``log``, the process's output)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited ({proc.returncode}); see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s; see {log}")


def _spawn(name: str, cmd: list[str], root: Path, env: dict, state: Path) -> subprocess.Popen:
    log = state / f"{name}.log"
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, cwd=root, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _prefect(args: list[str], root: Path, env: dict) -> str:
    out = subprocess.run([_bin("prefect"), "--no-prompt", *args], cwd=root, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out.stdout


def start(root: Path, prefect_port: int = 4200, mlflow_port: int = 5000, prefect_file: str = "prefect.yaml",
          timeout: float = 180.0) -> dict:
    """Start the servers and the worker, deploy; returns the state written to .serve/pids.json."""
    state = root / STATE_DIR
    if (state / "pids.json").exists():
        raise RuntimeError(f"{state / 'pids.json'} exists: already serving? (`make serve-stop` first)")
    state.mkdir(exist_ok=True)
    prefect_api = f"http://{HOST}:{prefect_port}/api"
    mlflow_url = f"http://{HOST}:{mlflow_port}"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "MLFLOW_TRACKING_URI": mlflow_url,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["prefect-server"] = _spawn("prefect-server", [_bin("prefect"), "server", "start", "--host", HOST,
                                                            "--port", str(prefect_port)], root, env, state)
        procs["mlflow-server"] = _spawn("mlflow-server", [
            _bin("mlflow"), "server", "--host", HOST, "--port", str(mlflow_port),
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root", (root / "mlartifacts").as_uri()], root, env, state)
        wait_http(f"{prefect_api}/health", timeout, procs["prefect-server"], state / "prefect-server.log")
        _prefect(["work-pool", "create", POOL, "--type", "process", "--overwrite"], root, env)
        # prefect.yaml's pull step runs flows in {{ $PWD }}: the project root, whatever the caller's cwd
        _prefect(["deploy", "--all", "--prefect-file", prefect_file], root, {**env, "PWD": str(root)})
        procs["prefect-worker"] = _spawn("prefect-worker", [_bin("prefect"), "worker", "start", "--pool", POOL],
                                         root, env, state)
        wait_http(f"{mlflow_url}/health", timeout, procs["mlflow-server"], state / "mlflow-server.log")
    except BaseException:
        _stop_pids({name: p.pid for name, p in procs.items()})
        raise
    info = {"pids": {name: p.pid for name, p in procs.items()},
            "urls": {"prefect_ui": f"http://{HOST}:{prefect_port}", "prefect_api": prefect_api, "mlflow": mlflow_url},
            "logs": str(state)}
    (state / "pids.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _stop_pids(pids: dict[str, int], grace: float = 15.0) -> list[str]:
    """SIGTERM each PID's process group, SIGKILL what is left after ``grace`` seconds."""
    stopped = []
    for name, pid in pids.items():
        try:
            os.killpg(pid, signal.SIGTERM)
            stopped.append(name)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + grace
    for pid in pids.values():
        if not _wait_gone(pid, deadline):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            _wait_gone(pid, time.monotonic() + 5)
    return stopped


def _wait_gone(pid: int, deadline: float) -> bool:
    """Whether ``pid``'s process group is gone by ``deadline``. A child of this process (``start()`` ran here) is
    reaped on the way: until then it stays a zombie, which still counts as a member of its group."""
    while True:
        with contextlib.suppress(ChildProcessError):  # not our child: its own parent reaps it
            os.waitpid(pid, os.WNOHANG)
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.3)


def stop(root: Path) -> list[str]:
    """Stop the processes listed in .serve/pids.json; returns their names."""
    path = root / STATE_DIR / "pids.json"
    if not path.exists():
        return []
    stopped = _stop_pids(json.loads(path.read_text())["pids"])
    path.unlink()
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--prefect-port", type=int, default=int(os.environ.get("PREFECT_PORT", 4200)))
    parser.add_argument("--mlflow-port", type=int, default=int(os.environ.get("MLFLOW_PORT", 5000)))
    parser.add_argument("--prefect-file", default="prefect.yaml", help="deployments to create")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    if args.action == "stop":
        stopped = stop(root)
        print(f"stopped: {', '.join(stopped) or 'nothing was running'}")
        return 0
    info = start(root, args.prefect_port, args.mlflow_port, args.prefect_file)
    print("Team mode is up (127.0.0.1 only):")
    print(f"  Prefect UI:  {info['urls']['prefect_ui']}   (deployments rlhf-pipeline, rlhf-retrain, "
          "rlhf-collect-feedback)")
    print(f"  MLflow:      {info['urls']['mlflow']}")
    for name, pid in info["pids"].items():
        print(f"  {name:15s} pid {pid}")
    print(f"  logs:        {info['logs']}/*.log")
    print(f"In another shell: export PREFECT_API_URL={info['urls']['prefect_api']} "
          f"MLFLOW_TRACKING_URI={info['urls']['mlflow']}; then `make intake FILE=...` triggers a retrain.")
    print("Stop with: make serve-stop")
    return 0


if __name__ == "__main__":
    # the environment defaults and CPU kernel pins go to the servers and the worker, hence to every deployed flow run
    configure_process()
    sys.exit(main())
