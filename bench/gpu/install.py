"""Install one library set of ``wheels.txt`` from the bundle into a ``--target`` folder (standard library only).

    python3 bench/gpu/install.py SET TARGET [--bundle bench/gpu/bundle]

Each requirement ``name==version`` of the set is the bundle's wheel of that name and version this interpreter can
install: from ``wheels/`` (CPython 3.12), or its twin in ``twins/`` (the CPU smoke run's interpreter). Installed
with ``pip install --no-index --no-deps --target`` where the interpreter has pip, else unpacked (a wheel is a zip;
its ``*.data/purelib|platlib`` go to the top). The target is emptied first.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def set_requirements(name: str, path: Path = HERE / "wheels.txt") -> list[str]:
    """The ``name==version`` requirements of one set of ``wheels.txt``."""
    reqs = []
    for line in path.read_text().splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) == 2 and parts[0] == name:
            reqs.append(parts[1])
    if not reqs:
        raise SystemExit(f"{path}: no set named {name!r}")
    return reqs


def normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def installable(wheel: str, version: tuple[int, int] = sys.version_info[:2]) -> bool:
    """Whether this interpreter can install ``wheel`` (by its file name's python and ABI tags; Linux x86-64)."""
    python, abi, platform = wheel[:-4].split("-")[-3:]
    tags = python.split(".")
    here = {f"py{version[0]}", f"py{version[0]}{version[1]}", f"cp{version[0]}{version[1]}"}
    if abi == "abi3":  # the stable ABI: CPython 3.x from the tagged minor version on
        ok = any(t.startswith("cp3") and int(t[3:]) <= version[1] for t in tags)
    else:
        ok = any(t in here for t in tags)
    return ok and (platform == "any" or "x86_64" in platform)


def wheel_for(requirement: str, bundle: Path) -> Path:
    """The bundle's wheel for ``name==version`` that this interpreter can install."""
    name, version = requirement.split("==")
    for folder in ("wheels", "twins"):
        for wheel in sorted((bundle / folder).glob("*.whl")):
            parts = wheel.name.split("-")
            if normal(parts[0]) == normal(name) and parts[1] == version and installable(wheel.name):
                return wheel
    raise SystemExit(f"the bundle {bundle} has no wheel of {requirement} for Python "
                     f"{sys.version_info.major}.{sys.version_info.minor} (make bench-gpu-bundle)")


def unpack(wheels: list[Path], target: Path) -> None:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
    for data in target.glob("*.data"):
        for kind in ("purelib", "platlib"):
            for entry in (data / kind).glob("*") if (data / kind).is_dir() else []:
                shutil.move(str(entry), str(target / entry.name))


def has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("set")
    parser.add_argument("target")
    parser.add_argument("--bundle", default=str(HERE / "bundle"))
    opts = parser.parse_args()
    bundle, target = Path(opts.bundle), Path(opts.target)
    wheels = [wheel_for(r, bundle) for r in set_requirements(opts.set)]
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    how = "pip" if has_pip() and not os.environ.get("FORCE_UNZIP") else "unzip"
    if how == "pip":
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--disable-pip-version-check", "--target", str(target),
                        *map(str, wheels)], check=True)
    else:
        unpack(wheels, target)
    print(f"{opts.set}: {len(wheels)} wheels into {target} ({how})")


if __name__ == "__main__":
    main()
