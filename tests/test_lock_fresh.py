"""What is committed is true: every stage's code and params dependencies match ``dvc.lock``.

A change to stage code or to ``params.yaml`` must ship with its re-run (``make run``, which rewrites
dvc.lock, metrics/ and plots/). The hashes are computed here the way DVC 3.x computes them, from the
files of the last commit alone (the ``committed_tree`` fixture: what a user's journey leaves in the working
tree is not what is committed): a file's md5 is the md5 of its bytes (no dos2unix rewrite for ``hash: md5``); a
directory's is the md5 of the JSON list of ``{"md5", "relpath"}`` of its files, sorted by relpath, plus
``.dir``, where a DVC-tracked file inside counts with the md5 its ``.dvc`` file records (so the check needs
no ``dvc pull``). Deps produced by another stage (data/, models/) are DVC's to check, not this test's; so are
the feedback batches ``make intake`` commits (``paths.incoming``): a batch not yet retrained on is a retrain
that is pending (``make retrain``), not code or params that changed without a re-run.
``test_hashing_agrees_with_dvc`` checks the hashing against DVC itself on a scratch repo.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _names(entries) -> list[str]:
    return [next(iter(e)) if isinstance(e, dict) else e for e in entries or []]


def file_md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _ignored(root: Path) -> list[str]:
    path = root / ".dvcignore"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [ln.strip().strip("/") for ln in lines if ln.strip() and not ln.startswith("#")]


def dir_md5(path: Path, ignored: list[str] = ()) -> str:
    """DVC's ``.dir`` hash of a directory; ``X.dvc`` stands for X with the md5 it records."""
    entries: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if d not in ignored]
        for name in filenames:
            if name in ignored:
                continue
            file = Path(dirpath) / name
            rel = file.relative_to(path).as_posix()
            if name.endswith(".dvc"):
                out = yaml.safe_load(file.read_text())["outs"][0]
                entries[rel[: -len(".dvc")]] = out["md5"]
            entries.setdefault(rel, file_md5(file))  # a pulled copy of X keeps the .dvc file's md5
    listing = [{"md5": md5, "relpath": rel} for rel, md5 in sorted(entries.items())]
    return hashlib.md5(json.dumps(listing, sort_keys=True).encode("utf-8")).hexdigest() + ".dir"


def dep_md5(root: Path, rel: str) -> str:
    path = root / rel
    return dir_md5(path, _ignored(root)) if path.is_dir() else file_md5(path)


def _lookup(raw: dict, dotted: str):
    node = raw
    for part in dotted.split("."):
        node = node[part]
    return node


def stale_entries(root: Path, data_deps: tuple[str, ...] = ()) -> list[str]:
    """Every way in which ``root``'s dvc.yaml, params.yaml and source files disagree with its dvc.lock (deps
    listed in ``data_deps`` are not compared: data that DVC checks, like the outputs of other stages)."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    params = yaml.safe_load((root / "params.yaml").read_text())
    produced = {out for s in stages.values() for key in ("outs", "metrics", "plots") for out in _names(s.get(key))}
    produced |= set(data_deps)
    problems = []
    for name, stage in stages.items():
        if name not in lock:
            problems.append(f"{name}: not in dvc.lock (never run)")
            continue
        locked = lock[name]
        if locked.get("cmd") != stage["cmd"]:
            problems.append(f"{name}: cmd {stage['cmd']!r} != dvc.lock {locked.get('cmd')!r}")
        locked_deps = {d["path"]: d for d in locked.get("deps", [])}
        if set(locked_deps) != set(stage.get("deps", [])):
            problems.append(f"{name}: deps {sorted(stage.get('deps', []))} != dvc.lock {sorted(locked_deps)}")
        for rel in stage.get("deps", []):
            if rel in produced or rel not in locked_deps or not (root / rel).exists():
                continue
            actual = dep_md5(root, rel)
            if actual != locked_deps[rel]["md5"]:
                problems.append(f"{name}: {rel} changed since dvc.lock (md5 {actual} != {locked_deps[rel]['md5']})")
        locked_params = locked.get("params", {}).get("params.yaml", {})
        wanted = _names(stage.get("params"))
        if set(locked_params) != set(wanted):
            problems.append(f"{name}: params {sorted(wanted)} != dvc.lock {sorted(locked_params)}")
        for key in wanted:
            if key in locked_params and _lookup(params, key) != locked_params[key]:
                problems.append(f"{name}: params.yaml {key}={_lookup(params, key)!r} != dvc.lock {locked_params[key]!r}")
    return problems


def test_committed_dvc_lock_matches_code_and_params(committed_tree):
    incoming = yaml.safe_load((committed_tree / "params.yaml").read_text())["paths"]["incoming"]
    problems = stale_entries(committed_tree, data_deps=(incoming,))
    assert not problems, ("dvc.lock does not describe this code/params; re-run the pipeline (`make run`) and "
                          "commit dvc.lock, metrics/ and plots/:\n  " + "\n  ".join(problems))


@pytest.fixture()
def scratch_repo(tmp_path):
    """A one-stage DVC repo (a code file, a directory with a DVC-tracked file, a param) recorded by DVC."""
    from _pipeline_project import run

    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "src" / "code.py").write_bytes(b"print('hi')\r\nx = 1\n")  # CRLF: no dos2unix in md5
    (root / "feedback" / "pairs").mkdir(parents=True)
    (root / "feedback" / "manifest.jsonl").write_text('{"a": 1}\n')
    (root / "params.yaml").write_text("train:\n  lr: 0.1\n  seed: 3\n")
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"train": {
        "cmd": "echo run > out.txt", "deps": ["src/code.py", "feedback"], "params": ["train.lr"], "outs": ["out.txt"]}}}))
    run(["git", "init", "-q"], root)
    run(["dvc", "init", "-q"], root)
    (root / "feedback" / "pairs" / "b.jsonl").write_text('{"prompt": "p", "chosen": " a", "rejected": " b"}\n')
    run(["dvc", "add", "-q", "feedback/pairs/b.jsonl"], root)
    run(["dvc", "repro", "-q"], root)
    return root


def test_hashing_agrees_with_dvc(scratch_repo):
    root = scratch_repo
    assert stale_entries(root) == []
    (root / "feedback" / "pairs" / "b.jsonl").unlink()  # not pulled: the .dvc file stands in for it
    assert stale_entries(root) == []
    (root / "src" / "code.py").write_bytes(b"print('hi')\nx = 1\n")  # only the line ending changed
    (root / "params.yaml").write_text("train:\n  lr: 0.2\n  seed: 4\n")  # seed is not a dep of train
    (root / "feedback" / "manifest.jsonl").write_text('{"a": 2}\n')
    problems = stale_entries(root)
    assert len(problems) == 3, problems
    assert any("src/code.py changed" in p for p in problems)
    assert any("feedback changed" in p for p in problems)
    assert any("train.lr=0.2" in p for p in problems)
