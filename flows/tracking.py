"""``python -m flows.tracking upload <spool>...`` (``make tracking-upload``): send what stages spooled while the
MLflow tracking store was unreachable (``tracking-spool/``) to the store. Each uploaded spool is renamed
``*.uploaded``, so running it twice sends nothing twice. The spool format and its reader are the library's
(``rlhf_core.tracking.upload_spool``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from flows.process import configure_process
from rlhf_core.tracking import upload_spool


def spool_files(paths: Sequence[str]) -> list[Path]:
    """The spool files named, a directory standing for the ``*.jsonl`` files in it."""
    return [f for s in paths for f in (sorted(Path(s).glob("*.jsonl")) if Path(s).is_dir() else [Path(s)])]


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status 0 when every spool was uploaded, 1 when there was nothing to upload."""
    parser = argparse.ArgumentParser(prog="python -m flows.tracking", description="Upload spooled tracking data.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("upload", help="replay spool files (JSONL) written while MLflow was unreachable")
    up.add_argument("spools", nargs="+", help="spool files, or directories holding them")
    up.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    up.add_argument("--run-id", default=None, help="append to this run instead of the one recorded/a new one")
    args = parser.parse_args(argv)
    files = spool_files(args.spools)
    if not files:
        print("nothing to upload", file=sys.stderr)
        return 1
    for file in files:
        print(f"{file} -> run {upload_spool(file, args.tracking_uri, args.run_id)}")
    return 0


if __name__ == "__main__":
    configure_process()
    sys.exit(main())
