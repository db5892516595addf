"""Make the project's venv find its own tools, as an activated venv does: ``python tools/venv_path.py``.

A command typed as ``.venv/bin/mlflow models serve ...`` or ``.venv/bin/dvc repro`` starts other programs by
name: MLflow's scoring server runs ``uvicorn``, DVC runs each stage's ``python -m flows.stage``. Without an
activated venv those names resolve to the system's (``uvicorn: not found``, or a Python without the project's
packages). This writes ``rlhf_venv_bin.pth`` into the venv's site-packages: Python runs a ``.pth`` line that
starts with ``import`` at every start of that interpreter, and this one puts the venv's ``bin`` first on
``PATH`` when it is not there already (exactly what ``activate`` does, for this process and its children).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

PTH_NAME = "rlhf_venv_bin.pth"
LINE = ("import os, sys; _b = os.path.join(sys.prefix, 'bin'); _p = os.environ.get('PATH', ''); "
        "os.environ['PATH'] = _p if _b in _p.split(os.pathsep) else _b + os.pathsep + _p\n")


def install(site_packages: Path | None = None) -> Path:
    """Write the ``.pth`` file into ``site_packages`` (default: this interpreter's, which must be a venv's)."""
    if site_packages is None:
        if sys.prefix == sys.base_prefix:
            raise SystemExit("tools/venv_path.py: run it with the venv's python (.venv/bin/python), not the system's")
        site_packages = Path(sysconfig.get_paths()["purelib"])
    path = site_packages / PTH_NAME
    path.write_text(LINE, encoding="utf-8")
    return path


if __name__ == "__main__":
    print(install())
