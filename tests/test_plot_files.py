"""Every CSV that a DVC plot reads has a value in every cell it draws: DVC's plots draw a blank cell as 0, so a
missing value would show as a fall to zero (GRPO/RLOO rewards logged only when a batch is generated did)."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml

from tasks.stages.common.group_policy import fill_reused_batches


def drawn_columns(dvc_yaml: dict) -> dict[str, set[str]]:
    """CSV file -> the columns some plot of ``dvc.yaml`` draws (its x and y), over stage and top-level plots."""
    drawn: dict[str, set[str]] = {}
    for stage in dvc_yaml["stages"].values():
        for entry in stage.get("plots", []):
            path, spec = next(iter(entry.items())) if isinstance(entry, dict) else (entry, {})
            if str(path).endswith(".csv"):
                drawn.setdefault(path, set()).update(c for c in (spec.get("x"), spec.get("y")) if c)
    for definition in dvc_yaml.get("plots", []):
        spec = next(iter(definition.values()))
        for path, columns in (spec.get("y") or {}).items():
            drawn.setdefault(path, set()).update([*columns, spec["x"]] if spec.get("x") else columns)
    return drawn


def blank_cells(path: Path, columns: set[str]) -> list[str]:
    """``file:line: column`` for every drawn column that is missing from the header or blank in a row."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [f"{path.name}:1: no column {c!r}" for c in sorted(columns - set(reader.fieldnames or []))]
        return missing + [f"{path.name}:{line}: {c} is blank" for line, row in enumerate(reader, start=2)
                          for c in sorted(columns) if c in row and (row[c] or "").strip() == ""]


def test_no_committed_plot_draws_a_blank_cell(committed_tree):
    drawn = drawn_columns(yaml.safe_load((committed_tree / "dvc.yaml").read_text()))
    assert {"plots/grpo.csv", "plots/rloo.csv", "plots/ppo.csv", "plots/evaluate.csv"} <= set(drawn)
    problems = [p for rel, columns in sorted(drawn.items()) for p in blank_cells(committed_tree / rel, columns)]
    assert not problems, "plots would draw these as 0:\n  " + "\n  ".join(problems)


def test_blank_cells_names_file_line_and_column(tmp_path):
    path = tmp_path / "grpo.csv"
    path.write_text("step,reward,kl\n1,0.5,0.0\n2,,0.1\n")
    assert blank_cells(path, {"step", "reward"}) == ["grpo.csv:3: reward is blank"]
    assert blank_cells(path, {"entropy"}) == ["grpo.csv:1: no column 'entropy'"]


def test_a_reused_batch_carries_the_reward_it_was_generated_with():
    # num_iterations=2: steps 1 and 3 generate; steps 2 and 4 optimise the same completions again
    rows = [{"step": 1, "reward": 0.5, "reward_std": 1.0, "kl": 0.0, "loss": 0.1},
            {"step": 2, "reward": None, "reward_std": None, "kl": None, "loss": 0.2},
            {"step": 3, "reward": 0.7, "reward_std": 0.9, "kl": 0.01, "loss": 0.3},
            {"step": 4, "reward": None, "reward_std": None, "kl": 0.02, "loss": 0.4}]
    filled = fill_reused_batches(rows, num_iterations=2)
    assert [r["reward"] for r in filled] == [0.5, 0.5, 0.7, 0.7]
    assert [r["reward_std"] for r in filled] == [1.0, 1.0, 0.9, 0.9]
    assert [r["kl"] for r in filled] == [0.0, 0.0, 0.01, 0.02]  # a value logged on a re-use step is kept
    assert [r["loss"] for r in filled] == [0.1, 0.2, 0.3, 0.4] and rows[1]["reward"] is None  # input untouched
    assert fill_reused_batches(rows, num_iterations=1) == rows  # every step generates: nothing to fill


def test_a_metric_no_step_logged_is_null_not_nan():
    """GRPO with beta 0 logs no KL: metrics/grpo.json says `"kl_last": null` (NaN is not JSON: DVC cannot read it)."""
    import json

    from tasks.stages.common.policy import last_fifth_mean

    rows = [{"step": s, "reward": s / 10, "kl": None} for s in range(1, 11)]
    assert last_fifth_mean(rows, "reward") == 0.95 and last_fifth_mean(rows, "kl") is None
    assert json.loads(json.dumps({"kl_last": last_fifth_mean(rows, "kl")}, allow_nan=False)) == {"kl_last": None}
