"""``make pull``: ``dvc pull``, and when an output's hash is in neither the cache nor the remote, why and what to run.

A plain ``dvc pull`` that cannot find a recorded hash ends with "Checkout failed for following targets: models/grpo
Is your cache up to date?" (issue 33: a fresh clone's pull failed so on ``models/grpo``, whose recorded bytes had
been made on another CPU kind and never pushed). :func:`pull` runs the same pull through DVC's API and, on that
failure, names each missing output with the hash and stage ``dvc.lock`` records for it and the remote it looked in,
says the two ways it happens (the run that recorded it did not push; the outputs were made elsewhere) and what to
run: ``make push`` where they were made, or ``make repro`` here (the stage trains again).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tasks.store.dvc_lockfile import atomic_dvc_writes


def missing_outputs(repo, targets: list[str]) -> list[tuple[str, str, str]]:
    """``(path, hash, stage)`` of each failed target, from the repo's index (what dvc.lock / the .dvc file records);
    a target the index does not know is reported with ``?``."""
    root = Path(repo.root_dir)
    recorded = {}
    for out in repo.index.outs:
        path = Path(out.fs_path).resolve()
        recorded[path] = (out.hash_info.value or "?", out.stage.addressing)
    found = []
    for target in targets:
        path = (root / target).resolve()
        hash_value, stage = recorded.get(path, ("?", "?"))
        found.append((path.relative_to(root).as_posix() if path.is_relative_to(root) else target, hash_value, stage))
    return found


def missing_message(missing: list[tuple[str, str, str]], remote: str) -> str:
    """What :func:`pull` says when outputs are missing: each one, why, what to run."""
    lines = [f"dvc pull: {len(missing)} output(s) of this commit are in neither the local cache nor the remote "
             f"({remote}):"]
    lines += [f"  {path}  (md5 {value}, recorded in {stage})" if stage.endswith(".dvc")
              else f"  {path}  (md5 {value}, recorded by stage {stage} in dvc.lock)" for path, value, stage in missing]
    stages = sorted({stage for _, _, stage in missing if not stage.endswith(".dvc") and stage != "?"})
    lines += ["Why: the run that recorded these hashes did not push them (`make run` and `make retrain` push; a bare "
              "`dvc repro` or `python -m flows.pipeline` does not), or it ran on another machine whose outputs "
              "were never pushed (the pipeline's bytes match across CPU kinds only where docs/pipeline.md, "
              "\"Same bytes on every CPU\", says so).",
              "What to run: `make push` on the machine that made them sends them; or make them here: "
              + (f"`.venv/bin/dvc repro {' '.join(stages)}` (or `make repro`)" if stages else "`make repro`")
              + ", then `.venv/bin/dvc status` says whether the result is the recorded one."]
    return "\n".join(lines)


def pull(root: str | Path = ".") -> int:
    """``dvc pull`` in ``root``; 0 when everything was restored, 1 (with :func:`missing_message` on stderr) when an
    output's hash was found nowhere. Other DVC errors propagate as DVC raised them."""
    from dvc.exceptions import CheckoutError  # dvc: only for the pull
    from dvc.repo import Repo

    atomic_dvc_writes()
    with Repo(str(root)) as repo:
        try:
            result = repo.pull()
        except CheckoutError as error:
            remote = repo.config["core"].get("remote", "?")
            url = repo.config["remote"].get(remote, {}).get("url", "?")
            print(missing_message(missing_outputs(repo, [str(t) for t in error.target_infos]), f"{remote}: {url}"),
                  file=sys.stderr)
            return 1
    stats = result["stats"]
    print(f"dvc pull: {stats['fetched']} file(s) fetched; {stats['added']} added, {stats['modified']} modified, "
          f"{stats['deleted']} deleted in the workspace")
    return 0


if __name__ == "__main__":
    sys.exit(pull(sys.argv[1] if len(sys.argv) > 1 else "."))
