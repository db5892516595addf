"""Git side of a retraining run: a clean worktree of the committed branch in, a commit (and tag) out.

A retraining run never works in someone's checkout (no uncommitted edits, no ``dvc exp`` applied there):
:func:`open_worktree` checks out the branch's last commit in a temporary ``git worktree`` that shares the
checkout's DVC cache and remotes (so unchanged stages are restored, not retrained). :func:`record_result`
commits ``dvc.lock``, ``metrics/``, ``plots/`` and the README's results table on a new branch
``retrain/<stamp>`` and tags a registered version ``<model>-v<N>``: ``git checkout <ref> && dvc pull`` restores
exactly its data and weights. :func:`land_result` then brings that record to the branch it retrained (a
fast-forward: the record's parent is the commit the run started from), so the branch's committed state is
again one that ``dvc status`` finds up to date; when the branch moved meanwhile, or the checkout holds edits
of the recorded files, the record stays on ``retrain/<stamp>`` and the one command that lands it is named.
The next retraining of a branch that has not landed a record starts from the newest one
(:func:`previous_result`), so only what changed since re-runs.

A retraining worktree is locked (``git worktree lock``) with its owner, ``rlhf-retrain pid=<pid> host=<host>``;
the next run removes those whose owner died (``kill -9``, power loss) before it opens its own
(:func:`prune_dead_worktrees`), so a killed run leaves no registered worktree behind for long (issue 24).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.checkpointing import pid_alive
from tasks.process.logs import get_logger
from tasks.store.dvc_ops import _repo

RECORDED = ("dvc.lock", "metrics", "plots", "README.md")
"""What a retraining run records in git: the lock, what git tracks of the outputs, the README's results table."""
TRAILER = "Retrained-branch"
PREFIX = "rlhf-retrain-"
"""Name prefix of a retraining worktree's directory (in the temporary folder)."""
OWNER = re.compile(r"^rlhf-retrain pid=(?P<pid>\d+) host=(?P<host>\S+)$")
"""The lock reason of a retraining worktree: the process that owns it."""


class GitError(RuntimeError):
    """A git command of the retraining run failed; the message has the command and git's stderr."""


def git(cwd: str | Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise GitError(f"git {' '.join(args)} (in {cwd}) failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


def current_branch(root: str | Path) -> str:
    """The branch checked out in ``root`` (a detached HEAD has none: name the branch explicitly)."""
    name = git(root, "rev-parse", "--abbrev-ref", "HEAD")
    if name == "HEAD":
        raise GitError(f"{root}: HEAD is detached; pass the branch to retrain (retrain(branch=...))")
    return name


def _share_dvc(root: Path, worktree: Path) -> None:
    """The worktree uses the checkout's DVC cache and its remotes (relative URLs resolved from the checkout;
    per-user URLs in .dvc/config.local included)."""
    from dvc.repo import Repo  # dvc: only when a worktree opens

    with Repo(str(root)) as main:
        cache_dir = main.cache.local_cache_dir
        remotes = {name: dict(conf) for name, conf in main.config["remote"].items()}
    with Repo(str(worktree)) as repo:
        with repo.config.edit("local") as conf:
            conf["cache"]["dir"] = str(cache_dir)
            for name, options in remotes.items():
                conf["remote"][name] = {**options, "url": str(options["url"])}


@task(name="git-worktree", cache_policy=NO_CACHE)
def open_worktree(root: str, branch: str, stamp: str) -> str:
    """Check out ``branch``'s last commit (detached) in a fresh temporary worktree; restore the outputs its
    dvc.lock names from the shared cache (or the remote) where they are available."""
    root_path = Path(root)
    prune_dead_worktrees(root_path)
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{stamp}-"))
    path.rmdir()  # git creates it
    owner = f"rlhf-retrain pid={os.getpid()} host={socket.gethostname()}"
    git(root_path, "worktree", "add", "--detach", "--lock", "--reason", owner, str(path), branch)
    previous = previous_result(root_path, branch)
    if previous:  # start from the last retraining's record: what it trained is restored, not retrained
        git(path, "checkout", previous, "--", *[p for p in RECORDED if _in_commit(path, previous, p)])
        get_logger().info("retrain: starting from the record of %s", previous)
    _share_dvc(root_path, path)
    _restore_outputs(path)
    get_logger().info("retrain: worktree of %s@%s at %s", branch, git(path, "rev-parse", "--short", "HEAD"), path)
    return str(path)


def _in_commit(cwd: Path, ref: str, path: str) -> bool:
    return bool(git(cwd, "ls-tree", "--name-only", ref, "--", path))


def previous_result(root: Path, branch: str) -> str | None:
    """The newest ``retrain/*`` record made from ``branch``, if the branch has not committed new records
    (dvc.lock, metrics, plots) of its own since; else None (the branch's own records are newer)."""
    refs = git(root, "for-each-ref", "--sort=-creatordate", "--format=%(refname:short)", "refs/heads/retrain/")
    for ref in refs.splitlines():
        if git(root, "log", "-1", f"--format=%(trailers:key={TRAILER},valueonly)", ref).strip() != branch:
            continue
        changed = git(root, "diff", "--name-only", f"{ref}^", branch, "--", *RECORDED)
        return None if changed else ref
    return None


def _restore_outputs(worktree: Path) -> None:
    """``dvc pull`` what the lock names; whatever cannot be restored is simply re-run by the pipeline."""
    log = get_logger()
    try:
        with _repo(worktree) as repo:
            repo.pull(allow_missing=True)
    except Exception as err:  # noqa: BLE001 - a missing output only means that stage re-runs
        log.warning("retrain: could not restore every output (%s); stale stages will re-run", err)


def landing_command(record_branch: str) -> str:
    """The one command that lands a record by hand (``make land-retrain``: merge, then restore the outputs)."""
    return f"make land-retrain REF={record_branch}"


@task(name="git-land", cache_policy=NO_CACHE)
def land_result(root: str, branch: str, base: str, record: dict) -> dict:
    """Fast-forward ``branch`` to the record commit when it still points at ``base`` (where the run started), in
    the checkout ``root`` when that branch is checked out there (its working tree and DVC outputs follow), else
    as a plain ref update. Returns ``{"landed": bool, "reason": str}``; never overwrites anyone's edits."""
    log, commit = get_logger(), record["commit"]
    if git(root, "rev-parse", f"refs/heads/{branch}") != base:
        reason = f"{branch} moved since the retrain started; land it with: {landing_command(record['branch'])}"
        log.warning("retrain: not landed: %s", reason)
        return {"landed": False, "reason": reason}
    checked_out = _checked_out_branch(root) == branch
    try:
        if checked_out:
            git(root, "merge", "--ff-only", "-q", commit)
        else:
            git(root, "update-ref", f"refs/heads/{branch}", commit, base)  # compare-and-swap: atomic
    except GitError as error:  # e.g. uncommitted edits of dvc.lock or metrics/ in the checkout
        reason = f"{error}; land it with: {landing_command(record['branch'])}"
        log.warning("retrain: not landed: %s", reason)
        return {"landed": False, "reason": reason}
    if checked_out:
        restore_checkout_outputs(root)
    log.info("retrain: landed %s on %s", commit[:12], branch)
    return {"landed": True, "reason": f"{branch} fast-forwarded to {commit[:12]}"}


def _checked_out_branch(root: str | Path) -> str | None:
    name = git(root, "rev-parse", "--abbrev-ref", "HEAD")
    return None if name == "HEAD" else name


def restore_checkout_outputs(root: str | Path) -> None:
    """``dvc checkout``: the outputs the landed lock names, from the shared cache (so ``dvc status`` is clean);
    an output someone changed by hand is left alone, with the command to run named."""
    try:
        with _repo(root) as repo:
            repo.checkout()
    except Exception as error:  # noqa: BLE001 - the record is landed; only the working copy lags
        get_logger().warning("retrain: landed, but the outputs were not restored in %s (%s): run `.venv/bin/dvc "
                             "checkout` there", root, error)


def outcome(record: dict) -> str:
    """What the registry step did, in words (the retrain commit and tag say this, never an earlier decision)."""
    if record.get("registered"):
        return f"registered {record.get('model')} v{record.get('version')}: {record.get('decision')}"
    earlier = (f"; v{record['version']} holds these weights (decided {record.get('earlier_decision')} then)"
               if record.get("version") else "")
    return f"nothing registered: {record.get('reason')}{earlier}"


@task(name="git-record", cache_policy=NO_CACHE)
def record_result(worktree: str, branch: str, stamp: str, registry: dict, model_name: str = "rlhf-policy") -> dict:
    """Commit dvc.lock, metrics/ and plots/ on ``retrain/<stamp>``; tag a newly registered version."""
    log = get_logger()
    result = f"retrain/{stamp}"
    git(worktree, "switch", "-q", "-c", result)
    git(worktree, "add", "--", *[p for p in RECORDED if (Path(worktree) / p).exists()])
    record = {"branch": result, "commit": None, "tag": None}
    message = (f"retrain {stamp} of {branch}: dvc.lock, metrics, plots and the results table\n\nregistry: "
               f"{outcome(registry)}\nreason: {registry.get('reason')}\n\n{TRAILER}: {branch}")
    git(worktree, "commit", "-q", "--allow-empty", "-m", message)
    record["commit"] = git(worktree, "rev-parse", "HEAD")
    if registry.get("registered") and registry.get("version"):
        tag = f"{registry.get('model', model_name)}-v{registry['version']}"
        git(worktree, "tag", "-a", tag, "-m", f"{tag}: {registry.get('decision')} ({registry.get('reason')})")
        record["tag"] = tag
    log.info("retrain: recorded %s at %s%s", branch, record["commit"][:12],
             f", tag {record['tag']}" if record["tag"] else "")
    return record


@task(name="git-worktree-remove", cache_policy=NO_CACHE)
def close_worktree(root: str, worktree: str) -> None:
    """Remove the temporary worktree (its branch and tag stay in the repository)."""
    _remove_worktree(Path(root), worktree)


def _remove_worktree(root: Path, worktree: str) -> None:
    """Unregister and delete a (locked) worktree; its directory may be gone already."""
    try:
        git(root, "worktree", "remove", "--force", "--force", worktree)  # twice: also when locked
    except GitError:
        shutil.rmtree(worktree, ignore_errors=True)
        subprocess.run(["git", "worktree", "unlock", worktree], cwd=root, capture_output=True)
        git(root, "worktree", "prune")


def prune_dead_worktrees(root: Path) -> list[str]:
    """Remove the retraining worktrees whose owning process on this host is gone; returns their paths.

    Unlocked ones named ``rlhf-retrain-*`` in the temporary folder (left by runs from before the lock) are removed
    too: the caller holds the checkout lock, so no retraining of this checkout is running."""
    removed = []
    for path, reason in _worktrees(root):
        owner = OWNER.match(reason or "")
        if owner:
            if owner["host"] != socket.gethostname() or pid_alive(int(owner["pid"])):
                continue
        elif reason is not None or not _is_retrain_dir(path):
            continue  # someone's own worktree, or locked by someone else
        _remove_worktree(root, path)
        removed.append(path)
    if removed:
        get_logger().warning("retrain: removed %d worktree(s) left by killed runs: %s", len(removed), ", ".join(removed))
    return removed


def _worktrees(root: Path) -> list[tuple[str, str | None]]:
    """``(path, lock reason or None)`` of every linked worktree of the repository (``git worktree list``)."""
    entries: list[tuple[str, str | None]] = []
    for block in git(root, "worktree", "list", "--porcelain").split("\n\n")[1:]:  # the first is the main checkout
        lines = block.splitlines()
        path = lines[0].removeprefix("worktree ")
        locked = next((line for line in lines if line == "locked" or line.startswith("locked ")), None)
        entries.append((path, None if locked is None else locked.removeprefix("locked").strip()))
    return entries


def _is_retrain_dir(path: str) -> bool:
    return Path(path).resolve().parent == Path(tempfile.gettempdir()).resolve() and Path(path).name.startswith(PREFIX)
