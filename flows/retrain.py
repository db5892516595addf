"""Retraining: ``python -m flows.retrain`` (one run), ``--serve`` (on a cron), or the ``rlhf-retrain``
deployment of prefect.yaml (on its cron and on every ``rlhf.feedback.ingested`` event of the intake).

A retraining run works from the committed state, never from someone's working copy: it checks out the
branch's last commit in a temporary ``git worktree`` (sharing the checkout's DVC cache and remotes, so
unchanged stages are restored, not retrained), re-runs what changed through the pipeline flow (new
feedback batches in ``incoming/``, a new ``prepare.source_revision``, code or params), evaluates,
registers (``champion`` moves only on a win), pushes data and models to the DVC remote and commits
``dvc.lock``, ``metrics/``, ``plots/`` and the README's results table on a branch ``retrain/<UTC stamp>``, with
a tag ``rlhf-policy-v<N>`` per registered version: ``git checkout <ref> && dvc pull`` restores that version's
data and weights. Then the record lands on the branch it retrained (a fast-forward; in the checkout, whose
DVC outputs follow), so the branch is again up to date with its data; if the branch moved meanwhile, the
record stays on its own branch and ``make land-retrain REF=retrain/<stamp>`` lands it
(``python -m flows.retrain --land REF``). The MLflow store is the checkout's (``$MLFLOW_TRACKING_URI`` when set).
``--serve`` needs a Prefect server (``make serve``, or ``prefect server start --host 127.0.0.1`` with
``PREFECT_API_URL=http://127.0.0.1:4200/api``); no Prefect Cloud.
"""

from __future__ import annotations

from flows.process import configure_logging, configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import contextlib
import datetime as dt
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from prefect import flow

from flows.pipeline import pipeline
from flows.report import refresh_readme
from tasks.process.locking import add_wait_argument, checkout_lock
from tasks.process.outcome import classify
from tasks.run.supervisor import PipelineRun, pipeline_run
from tasks.store.dvc_ops import push_outputs
from tasks.store.mlflow_runs import mlflow_setup, tracking_uri
from tasks.run.worktree import (GitError, close_worktree, current_branch, git, land_result, open_worktree, record_result,
                            restore_checkout_outputs)

DEFAULT_CRON = "0 3 * * 1"  # Mondays 03:00; prefect.yaml holds the deployed schedule
COMMAND = "python -m flows.retrain"


@contextlib.contextmanager
def _tracking_of(root: str) -> Iterator[None]:
    """Stages in the worktree log to the checkout's MLflow store (its registry holds the champion)."""
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    os.environ["MLFLOW_TRACKING_URI"] = tracking_uri(root)
    mlflow_setup(root)  # creates the experiment with the checkout's artifact folder, not the worktree's
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous


@flow(name="rlhf-retrain", log_prints=False)  # log_prints: see flows/process.py
def retrain(root: str = ".", branch: str | None = None, push: bool = True, remote: str | None = None,
            record: bool = True, land: bool = True) -> dict:
    """Retrain ``branch`` (default: the one checked out in ``root``) from its last commit; record the result and
    (``land``) bring it to the branch."""
    configure_logging()  # a deployed run's process was not started by ``main`` (prefect.yaml's entry point)
    root = str(Path(root).resolve())
    branch = branch or current_branch(root)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    # Supervised as every run of the checkout (tasks/run/supervisor.py): its lock, held to the end (a `make run` in the
    # same checkout waits for, or refuses with the name of, this run while it trains in its worktree, registers and
    # pushes), stop handlers, and what killed runs left behind cleaned. The CLI opened it already; a deployed run
    # opens it here. records=False: this checkout's dvc.lock is not written here (the worktree's pipeline records).
    with pipeline_run(root, COMMAND, records=False):
        worktree = open_worktree(root, branch, stamp)
        try:
            base = git(worktree, "rev-parse", "HEAD")  # the branch's commit the run starts from
            with _tracking_of(root):
                summary = pipeline(worktree)
            summary["branch"] = branch
            if push:
                summary["pushed"] = push_outputs(worktree, remote)
            if record:
                refresh_readme(Path(worktree))  # the results table the record commits beside metrics/
                summary["git"] = record_result(worktree, branch, stamp, summary["registry"])
        finally:
            close_worktree(root, worktree)
        if record and land:
            summary["git"].update(land_result(root, branch, base, summary["git"]))
    return summary


def files_in_the_way(root: str, ref: str) -> list[str]:
    """Files with local changes (staged, unstaged or untracked) that the record ``ref`` changes: a merge would refuse
    to overwrite them (git names only the first few, and the old advice to retrain did not help)."""
    changed = set(git(root, "diff", "--name-only", f"HEAD...{ref}").splitlines())
    local = set(git(root, "diff", "--name-only", "HEAD").splitlines())  # staged or not
    local |= set(git(root, "ls-files", "--others", "--exclude-standard").splitlines())
    return sorted(changed & local)


def land(root: str, ref: str) -> str:
    """Merge a retraining record ``ref`` into the branch checked out in ``root`` and restore its outputs (what
    ``make land-retrain REF=...`` runs when the branch moved during the retrain). A merge that conflicts is
    undone: the branch changed what the record changes, so retrain from it instead (``make retrain``)."""
    with checkout_lock(root, "python -m flows.retrain --land"):
        in_the_way = files_in_the_way(root, ref)
        if in_the_way:
            raise GitError(f"local changes to {', '.join(in_the_way)} would be overwritten by {ref} (it changes "
                           f"them); nothing changed. Commit or stash them (`git stash`), then run `make land-retrain "
                           f"REF={ref}` again")
        try:
            git(root, "merge", "--no-edit", "-q", ref)
        except GitError as error:
            with contextlib.suppress(GitError):
                git(root, "merge", "--abort")
            raise GitError(f"{ref} does not merge cleanly into {current_branch(root)} ({error}); nothing changed. "
                           "The branch changed what the record changes: run `make retrain` to retrain from it") from None
        restore_checkout_outputs(root)
        return git(root, "rev-parse", "HEAD")


def main(argv: list[str] | None = None) -> int:
    """Exit status as ``python -m flows.pipeline``'s (``tasks.process.outcome.classify``): 75 when SIGTERM/SIGINT
    stopped a training stage after saving its state, 73 when another run holds the checkout."""
    parser = argparse.ArgumentParser(prog="python -m flows.retrain", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--branch", default=None, help="branch to retrain (default: the one checked out)")
    parser.add_argument("--serve", action="store_true", help="serve the retraining deployment on a cron schedule")
    parser.add_argument("--cron", default=DEFAULT_CRON, help=f"schedule for --serve (default: {DEFAULT_CRON!r})")
    parser.add_argument("--no-push", action="store_true", help="do not push to the DVC remote")
    parser.add_argument("--no-record", action="store_true", help="do not commit the result on a retrain/ branch")
    parser.add_argument("--no-land", action="store_true", help="leave the record on its retrain/ branch")
    parser.add_argument("--land", metavar="REF", default=None,
                        help="only land an earlier record (a retrain/<stamp> branch) on the checked-out branch")
    add_wait_argument(parser)
    args = parser.parse_args(argv)
    if args.land:
        try:
            head = land(str(Path(args.root).resolve()), args.land)
        except Exception as error:  # noqa: BLE001 - a git failure or a held checkout: said, not a traceback
            if not isinstance(error, GitError) and classify(error).exit_status is None:
                raise
            print(f"land-retrain: {error}", file=sys.stderr)
            return classify(error).exit_status or 1
        print(f"Landed {args.land}: {current_branch(args.root)} is at {head[:12]}; outputs restored (dvc checkout)")
        return 0
    if args.serve:
        retrain.serve(name="rlhf-retrain-local", cron=args.cron,
                      parameters={"root": str(Path(args.root).resolve()), "branch": args.branch,
                                  "push": not args.no_push, "record": not args.no_record})
        return 0
    try:
        # the lock, stop handlers (one run; not --serve: there SIGTERM must stop the server), Prefect's temporary
        # server out of our process group: refused here, before Prefect starts
        with PipelineRun(args.root, COMMAND, records=False):
            summary = retrain(args.root, branch=args.branch, push=not args.no_push, record=not args.no_record,
                              land=not args.no_land)
    except Exception as stopped:  # noqa: BLE001 - mapped to an exit status, or re-raised
        # Preempted: the worktree (and a stage's saved state in it) is gone; the next run re-runs that stage.
        if (status := classify(stopped).exit_status) is None:
            raise
        print(f"retrain stopped: {stopped}", file=sys.stderr)
        return status
    if "git" in summary:
        record = summary["git"]
        print(f"Recorded on {record['branch']} ({record['commit'][:12]})"
              + (f", tag {record['tag']}" if record["tag"] else "")
              + f"; restore with: git checkout {record['tag'] or record['branch']} && .venv/bin/dvc pull")
        if "landed" in record:
            print(("Landed: " if record["landed"] else "Not landed: ") + record["reason"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
