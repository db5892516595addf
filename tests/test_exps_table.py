"""``make exps``: one column per policy, narrow enough for an 80-100 column terminal (tools/exps_table.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("sft", "ppo", "dpo", "grpo", "rloo", "kto")
CSV = "\n".join([
    "Experiment,rev,typ,Created," + ",".join(f"{p}.gold_reward" for p in POLICIES),
    ",workspace,baseline,,0.1113,0.7102,0.4653,0.7299,0.6503,0.7289",
    ",main,baseline,2026-11-23T14:02:16,0.1113,0.7102,0.4653,0.7299,0.6503,0.7289",
    "lower-beta-exp,1a2b3c4,branch_base,2026-11-23T15:10:00,0.1113,0.7102,0.8,-,0.6503,0.7289",
])


def _table(metric: str, text: str = CSV) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "exps_table.py"), metric], input=text, text=True,
                         capture_output=True, check=True)
    return out.stdout.splitlines()


def test_one_column_per_policy_and_the_best_policy():
    lines = _table("gold_reward")
    assert lines[1].split() == ["experiment", "created", *POLICIES, "best"]
    assert lines[2].split() == ["workspace", "-", "0.111", "0.710", "0.465", "0.730", "0.650", "0.729", "grpo"]
    assert lines[3].split() == ["main", "2026-11-23", "14:02", "0.111", "0.710", "0.465", "0.730", "0.650", "0.729",
                                "grpo"]
    assert lines[4].startswith("  lower-beta-exp")  # an experiment sits under its baseline
    assert lines[4].split()[-1] == "dpo" and lines[4].split()[6] == "-"  # a missing value is skipped, not a winner
    assert max(len(line) for line in lines) <= 100


def test_kl_has_no_best_column():
    text = CSV.replace("gold_reward", "kl")
    assert _table("kl", text)[1].split() == ["experiment", "created", *POLICIES]
