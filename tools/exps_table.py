"""``make exps``: DVC experiments as one narrow table, one headline metric per policy.

Reads ``dvc exp show --csv`` (kept columns: Experiment, rev, typ, Created and ``<policy>.<metric>``) on stdin and
prints ``experiment  created  sft  ppo  dpo ...  best`` (``best``: the best non-SFT policy by that metric, for the
metrics with a direction), about 70-90 columns wide for six policies, where ``dvc exp show`` prints three per policy.

    dvc exp show --drop '.*' --keep '(Experiment|rev|typ|Created|.*\\.gold_reward)$' --csv | python tools/exps_table.py gold_reward
"""

from __future__ import annotations

import csv
import sys

BEST = {"gold_reward": max, "rm_reward": max, "win_rate": max, "perplexity": min}
"""Which way is better, per evaluate.json key (``kl`` has none: no ``best`` column)."""


def rows_of(lines: list[str], metric: str) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the narrow table from ``dvc exp show --csv`` lines."""
    records = list(csv.DictReader(lines))
    suffix = f".{metric}"
    policies = [c[: -len(suffix)] for c in (records[0] if records else {}) if c.endswith(suffix)]
    best = BEST.get(metric)
    header = ["experiment", "created", *policies, *(["best"] if best else [])]
    out = []
    for r in records:
        name = r.get("Experiment") or r.get("rev") or ""
        if r.get("typ", "baseline") != "baseline":
            name = f"  {name}"  # an experiment, under its baseline commit
        values = [r.get(f"{p}{suffix}", "") for p in policies]
        scored = [(float(v), p) for v, p in zip(values, policies) if _is_number(v) and p != "sft"]
        winner = [best(scored)[1] if scored else "-"] if best else []
        out.append([name[:20], (r.get("Created") or "-")[:16].replace("T", " "), *[_short(v) for v in values], *winner])
    return header, out


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def _short(value: str) -> str:
    try:
        return f"{float(value):.3f}"
    except ValueError:
        return value or "-"


def main(argv: list[str]) -> int:
    metric = argv[1] if len(argv) > 1 else "gold_reward"
    header, rows = rows_of(sys.stdin.read().splitlines(), metric)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"{metric} per policy (metrics/evaluate.json; `make exps METRIC=kl` shows another key)")
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
