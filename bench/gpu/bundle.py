"""``make bench-gpu-bundle``: the git-ignored folder a network-less GPU machine needs to run the GPU bench.

    .venv/bin/python bench/gpu/bundle.py [--out bench/gpu/bundle]

Downloads (from the package index, no dependencies resolved: the lists are exact) every wheel of
``bench/gpu/wheels.txt`` for CPython 3.12 on manylinux x86-64 into ``<out>/wheels/``; for the wheels that are
specific to one Python version, also their twin for this interpreter into ``<out>/twins/`` (what the CPU smoke run,
``SMOKE=1 bash bench/gpu/run.sh``, installs instead); copies the rt-polarity corpus the online workloads read into
``<out>/data/rt-polarity/``; writes ``<out>/MANIFEST.json`` (every file, its size and sha256). Prints the bundle's
size beside the working tree's (tracked and untracked files, not ignored ones): both travel to the GPU machine,
and together they must stay under ``LIMIT_MIB``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIMIT_MIB = 60  # what the device tool carries (64 MiB of ignored paths), with room to spare
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def requirements(path: Path = HERE / "wheels.txt") -> dict[str, list[str]]:
    """``{set: [requirement, ...]}`` from ``wheels.txt`` ("set requirement" per line, # comments)."""
    sets: dict[str, list[str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or "==" not in parts[1]:
            raise ValueError(f"{path}:{number}: expected 'SET NAME==VERSION', got {line!r}")
        sets.setdefault(parts[0], []).append(parts[1])
    return sets


def pip_download(reqs: list[str], dest: Path, cross: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest)]
    if cross:
        cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    subprocess.run(cmd + reqs, check=True)


def version_specific(wheel: str) -> bool:
    """A wheel only one Python version can install (not ``py3-none-*``, not the stable ``abi3``)."""
    python, abi = wheel[:-4].split("-")[-3:-1]
    return not any(tag in ("py2", "py3") for tag in python.split(".")) and abi != "abi3"


def directory_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def tree_mib() -> float:
    """The working tree that travels: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         check=True, capture_output=True).stdout.decode()
    files = [ROOT / name for name in out.split("\0") if name]
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def manifest(out: Path) -> dict:
    files = {}
    for f in sorted(out.rglob("*")):
        if f.is_file() and f.name != "MANIFEST.json":
            files[str(f.relative_to(out))] = {"bytes": f.stat().st_size,
                                              "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
    return {"files": files, "sets": requirements()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "bundle"))
    parser.add_argument("--rt-polarity", default=str(ROOT.parent / "shared" / "data" / "rt-polarity"))
    opts = parser.parse_args()
    out = Path(opts.out)
    wheels, twins, data = out / "wheels", out / "twins", out / "data" / "rt-polarity"
    shutil.rmtree(out, ignore_errors=True)
    for d in (wheels, twins, data):
        d.mkdir(parents=True)
    sets = requirements()
    for reqs in sets.values():  # one call per set: two sets pin two versions of one name
        pip_download(reqs, wheels, cross=True)
    union = sorted({r for reqs in sets.values() for r in reqs})
    specific = [w.name for w in wheels.glob("*.whl") if version_specific(w.name)]
    names = {w.split("-")[0].lower().replace("_", "-") for w in specific}
    for r in union:
        if r.split("==")[0].lower().replace("_", "-") in names:
            pip_download([r], twins, cross=False)
    corpus = sorted(Path(opts.rt_polarity).glob("rt-polarity.*.txt"))
    if not corpus:
        sys.exit(f"no rt-polarity corpus in {opts.rt_polarity} (--rt-polarity DIR)")
    for f in corpus:
        shutil.copy2(f, data / f.name)
    (out / "MANIFEST.json").write_text(json.dumps(manifest(out), indent=1))
    bundle, tree = directory_mib(out), tree_mib()
    print(f"bundle {out}: {len(list(wheels.glob('*.whl')))} wheels, {len(specific)} with a twin for Python "
          f"{sys.version_info.major}.{sys.version_info.minor}; {bundle:.1f} MiB; working tree {tree:.1f} MiB; "
          f"together {bundle + tree:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if bundle + tree > LIMIT_MIB:
        sys.exit(f"bundle + working tree exceed {LIMIT_MIB} MiB: the GPU machine cannot receive them")


if __name__ == "__main__":
    main()
