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


def test_make_metrics_fits_120_columns_and_keeps_every_number(committed_tree, tmp_path):
    """Issue 33: `dvc metrics show` printed a 1,449-column table (one column per key of every metrics file; nesting
    the keys would not change that). `make metrics` prints every stage's metrics of the committed files within 120
    columns, every value of every file in it, and a stage without a file yet says so."""
    import json
    import shutil

    from flows.report import WIDTH, metrics_view
    from tasks.stages import load_params, stage_files

    view = metrics_view(committed_tree)
    assert max(len(line) for line in view.splitlines()) <= WIDTH == 120
    words = view.split()
    for stage, io in stage_files(load_params(committed_tree / "params.yaml").paths).items():
        data = json.loads((committed_tree / io.metrics).read_text())
        policies = {k: v for k, v in data.items() if stage == "evaluate" and k != "scored"}
        for key, value in _leaves({k: v for k, v in data.items() if k not in policies}):
            shown = f"{value:.5g}" if isinstance(value, float) else str(value)
            assert f"{key}={shown}" in words, (stage, key)
        for policy, row in policies.items():  # the table's row: the policy, then its values in the header's order
            (line,) = [ln.split() for ln in view.splitlines() if ln.startswith(" ") and ln.split()[:1] == [policy]]
            assert line[1:] == [f"{v:.5g}" if isinstance(v, float) else str(v) for v in row.values()]
    (tmp_path / "metrics").mkdir()
    shutil.copy(committed_tree / "params.yaml", tmp_path / "params.yaml")
    shutil.copy(committed_tree / "metrics" / "sft.json", tmp_path / "metrics" / "sft.json")
    fresh = metrics_view(tmp_path).splitlines()
    assert fresh[0].split() == ["prepare", "(no", "metrics/prepare.json", "yet)"] and fresh[1].startswith("sft ")


def _leaves(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in data.items():
        out += _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]
    return out
