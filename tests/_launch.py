"""What the multi-process and server tests share: a free local port, and a two-process torchrun (gloo, CPU) of a
test file that re-enters itself as the worker."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
              "ACCELERATE_USE_CPU": "1"}
"""One thread per rank, offline, CPU: the environment every two-process test gives its workers."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(*args: str, python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run`` with two local processes on a free port, then ``args``."""
    return [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), *args]


def run_two_processes(script: str | Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``script args`` as a two-process job from the repository root and require exit 0 (the output's tail
    is the assertion message)."""
    env = dict(os.environ, **WORKER_ENV, PYTHONPATH=str(ROOT))
    proc = subprocess.run(torchrun(str(Path(script).resolve()), *args), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc
