"""README.md's result table is generated from the committed metrics/evaluate.json (flows/report.py)."""

from __future__ import annotations

import pytest

from flows.report import END, START, replace_block, results_block, results_table


def test_readme_results_block_is_generated_from_committed_metrics(committed_tree):
    text = (committed_tree / "README.md").read_text(encoding="utf-8")
    block = results_block(committed_tree)
    assert text.count(START) == 1 and text.count(END) == 1
    assert block in text, "README.md's results table is stale: run `python -m flows.report readme`"


def test_results_table_rows_and_formatting():
    table = results_table({"sft": {"gold_reward": 0.1113, "kl": 0.0, "win_rate": 0.5},
                           "ppo": {"gold_reward": 0.66666, "kl": 3.3283, "win_rate": 0.8379}})
    assert table.splitlines() == [
        "| policy | gold_reward | kl | win_rate |",
        "|---|---|---|---|",
        "| sft | 0.111 | 0.00 | 0.500 |",
        "| ppo | 0.667 | 3.33 | 0.838 |",
    ]


def test_replace_block_keeps_the_rest_and_needs_markers():
    text = f"intro\n{START}\nold\n{END}\nafter\n"
    assert replace_block(text, f"{START}\nnew\n{END}") == f"intro\n{START}\nnew\n{END}\nafter\n"
    with pytest.raises(ValueError, match="README.md: no"):
        replace_block("no markers", "x")
