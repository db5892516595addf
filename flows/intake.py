"""Ingest new feedback: ``python -m flows.intake FILE...`` (or ``make intake FILE=...``).

Each FILE (``.jsonl``, ``.csv`` or ``.parquet``) holds preference pairs (prompt, chosen, rejected) or
unpaired ratings (prompt, completion, label true/false). All files are validated first (schema, UTF-8,
empty or identical pairs, duplicates within and across batches, size limits); the first problem stops
the intake with ``file:line: message`` and nothing is ingested. A file that is exactly a batch ingested before
is reported as such and adds nothing (exit 0), so retrying an intake that was killed is always safe. Then each file becomes one batch
``incoming/<kind>/<sha256>.jsonl`` tracked by DVC, pushed to the DVC remote, listed in
``incoming/manifest.jsonl`` (source, time, user, hash, rows) and committed to git. Then retraining starts: with
``PREFECT_API_URL`` set (team mode), the event ``rlhf.feedback.ingested`` triggers the retraining deployment
(prefect.yaml); without it, the retraining flow runs here and now (``python -m flows.retrain``: stale stages,
evaluate, the registry's gate, the record landed on the branch). ``--no-retrain`` only ingests.
"""

from __future__ import annotations

from flows.process import configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch (it retrains)
    configure_process()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TypeVar  # noqa: E402

from rlhf_core.checkpointing import pid_alive  # noqa: E402
from rlhf_core.data import DataFormatError  # noqa: E402
from rlhf_core.feedback import IntakeLimits  # noqa: E402
from tasks.feedback.intake import IntakeError, ingest  # noqa: E402
from tasks.process.locking import describe, lock_path, read_holder  # noqa: E402
from tasks.spec.params import PARAMS_FILE  # noqa: E402
from tasks.stages import load_params  # noqa: E402

EXIT_BAD_INPUT = 65  # EX_DATAERR
EXIT_NOT_VERSIONED = 74  # EX_IOERR
T = TypeVar("T")


def add_intake_options(parser: argparse.ArgumentParser) -> None:
    """The options of an intake (this one and ``flows.collect_feedback``'s): project, DVC, git, event, retrain, limits."""
    parser.add_argument("--root", default=".", help="project directory (default: current)")
    parser.add_argument("--no-push", action="store_true", help="do not push the batches to the DVC remote")
    parser.add_argument("--no-commit", action="store_true", help="do not commit the manifest and .dvc files")
    parser.add_argument("--no-event", action="store_true", help="do not emit the rlhf.feedback.ingested event")
    parser.add_argument("--no-retrain", action="store_true",
                        help="only ingest (without a Prefect server the intake otherwise retrains right away)")
    parser.add_argument("--remote", default=None, help="DVC remote to push to (default: the configured default)")
    parser.add_argument("--max-rows", type=int, default=IntakeLimits.max_rows, help="most records per file")
    parser.add_argument("--max-file-bytes", type=int, default=IntakeLimits.max_file_bytes, help="largest file")
    parser.add_argument("--max-field-chars", type=int, default=IntakeLimits.max_field_chars, help="longest text")


def intake_options(args: argparse.Namespace) -> dict:
    """``ingest``'s keyword arguments from the parsed options (store and metrics folders from params.yaml)."""
    paths = load_params(Path(args.root).resolve() / PARAMS_FILE).paths
    limits = IntakeLimits(max_file_bytes=args.max_file_bytes, max_rows=args.max_rows,
                          max_field_chars=args.max_field_chars)
    return {"store_dir": paths.incoming, "push": not args.no_push, "commit": not args.no_commit,
            "emit": not args.no_event, "remote": args.remote, "limits": limits, "metrics_dir": paths.metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.intake", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", metavar="FILE", help="feedback files (.jsonl, .csv, .parquet)")
    add_intake_options(parser)
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    options = intake_options(args)
    store = options["store_dir"]
    records, refused = run_intake("intake", lambda: ingest(root, args.files, **options))
    if refused is not None:
        return refused
    for r in records:
        print(f"ingested {r['kind']} batch {r['sha256']} ({r['rows']} rows) from {r['source']} -> {store}/{r['file']}")
    return retrain_now(root, args) if records else 0  # a batch ingested before: nothing new to train on


def run_intake(label: str, call: Callable[[], T]) -> tuple[T | None, int | None]:
    """``(call(), None)``; a refused intake is printed (``<label> refused ...``) and gives ``(None, exit code)``."""
    try:
        return call(), None
    except DataFormatError as err:
        print(f"{label} refused (nothing ingested): {err}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    except IntakeError as err:
        print(str(err), file=sys.stderr)
        return None, EXIT_NOT_VERSIONED


def retrain_now(root: Path, args: argparse.Namespace) -> int:
    """Local mode: retrain on what was just committed (team mode: the event starts the deployment instead; a
    retrain killed after an intake is run again with ``make retrain``). ``args``: the intake options
    (``no_retrain``, ``no_commit``, ``no_push``)."""
    from prefect.settings import PREFECT_API_URL  # prefect: only when deciding whether to retrain here

    if args.no_retrain or args.no_commit or PREFECT_API_URL.value():
        return 0
    from flows.retrain import main as retrain_main  # flows.retrain loads torch: only when the intake retrains here

    print(retrain_message(running_holder(root)))
    return retrain_main(["--root", str(root), "--wait", str(QUEUE_WAIT_S)] + (["--no-push"] if args.no_push else []))


QUEUE_WAIT_S = 6 * 3600
"""How long the intake's retrain waits for another run holding the checkout (a retrain takes minutes on a CPU; the
batch is committed already, so waiting loses nothing, and a stopped wait leaves it for ``make retrain``)."""


def running_holder(root: Path) -> dict | None:
    """The run holding the checkout's lock now (its record), or None."""
    holder = read_holder(lock_path(root))
    pid = holder.get("pid")
    return holder if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid) else None


def retrain_message(holder: dict | None) -> str:
    """What the intake says before it retrains: now, or queued behind the run holding the checkout."""
    if holder is None:
        return "retraining on the new feedback now (python -m flows.retrain; --no-retrain to skip)"
    return (f"the new feedback is committed; another run holds this checkout ({describe(holder)}): retraining on it "
            f"is queued and starts when that run finishes (waiting up to {QUEUE_WAIT_S // 3600} h; if this wait is "
            "stopped, `make retrain` trains the batch)")


if __name__ == "__main__":
    sys.exit(main())
