"""Reviewers' judgements -> versioned feedback: ``python -m flows.collect_feedback`` (``make intake-feedback``), and
the ``rlhf-collect-feedback`` deployment of prefect.yaml (daily in team mode).

Collects the ratings and side-by-side choices reviewers made on served generations since the last collection
(MLflow assessments: ``tasks/feedback/collect.py``), and ingests them as ``make intake`` ingests a file: the same
checks, a DVC-versioned batch per kind with each row's trace id, assessment id and reviewer, the manifest, a git
commit, the ``rlhf.feedback.ingested`` event. Then retraining starts exactly as after a file intake: with a Prefect
server (``PREFECT_API_URL``) the event triggers the ``rlhf-retrain`` deployment; without one it runs here and now
(``--no-retrain`` only collects). Judgements left out (an empty answer, a duplicate, ...) are listed with why, and
marked on their traces. Running it again with nothing new judged adds nothing.
"""

from __future__ import annotations

from flows.process import configure_logging, configure_process

if __name__ == "__main__":  # the entry point: configure the process before the imports below load torch
    configure_process()

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from prefect import flow  # noqa: E402

from flows.intake import add_intake_options, intake_options, retrain_now, run_intake  # noqa: E402
from tasks.feedback.collect import Collection, collect  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.collect_feedback", description=__doc__.splitlines()[0])
    add_intake_options(parser)
    return parser


@flow(name="rlhf-collect-feedback", log_prints=False)  # log_prints: see flows/process.py
def collect_feedback(root: str = ".", push: bool = True) -> dict:
    """The scheduled collection (team mode): ingest new judgements; the intake's event starts the retraining."""
    configure_logging()  # a deployed run's process was not started by ``main`` (prefect.yaml's entry point)
    args = _parser().parse_args(["--root", root] + ([] if push else ["--no-push"]))
    return summary(collect(Path(root).resolve(), **intake_options(args)))


def summary(collection: Collection) -> dict:
    return {"batches": [{k: r[k] for k in ("kind", "sha256", "rows", "file")} for r in collection.records],
            "refused": [{"assessment_id": r.assessment_id, "trace_id": r.trace_id, "reason": r.reason}
                        for r in collection.refused]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.root).resolve()
    options = intake_options(args)
    collection, refused = run_intake("intake-feedback", lambda: collect(root, **options))
    if refused is not None:
        return refused
    for r in collection.records:
        print(f"ingested {r['kind']} batch {r['sha256']} ({r['rows']} judgements) -> {options['store_dir']}/{r['file']}")
    for r in collection.refused:
        print(f"left out {r.assessment_id} (trace {r.trace_id}): {r.reason}")
    if not collection.records:
        print("intake-feedback: no new judgements to ingest")
        return 0
    return retrain_now(root, args)


if __name__ == "__main__":
    sys.exit(main())
