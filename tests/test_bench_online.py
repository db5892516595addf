"""bench/run.py's online rows (issue 14 point 6): medians, the three targets and by how much each is missed;
``--merge`` carrying the other workloads' rows over, labelled. No TRL venv needed: runs are given as dicts."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_run", ROOT / "bench" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(gain, secs, rss, kl=0.01):
    return {"gold_first": 0.1, "gold_last": 0.1 + gain, "gold_gain": gain, "gold_gain5": gain / 2,
            "seconds_per_step": secs, "peak_rss_mb": rss, "rss_after_imports_mb": 300.0, "train_seconds": 10.0,
            "wall_seconds": 20.0, "final_kl": kl, "gold_per_step": [0.1, 0.1 + gain], "lib": "x"}


def _row(run, runs):
    settings = {"method": "grpo", "steps": 2, "seeds": [0, 1, 2]}
    row = {"workload": "online", "size": "grpo", "settings": settings, "threads": 1, "runs": runs}
    return run.summarise_online(row, runs)


def test_online_targets_use_medians_and_say_by_how_much(run):
    runs = {"ours": [_run(0.3, 1.0, 700), _run(0.1, 3.0, 720), _run(0.2, 2.0, 710)],
            "trl116": [_run(0.25, 2.0, 800), _run(0.15, 2.0, 705), _run(0.3, 9.0, 690)]}
    row = _row(run, runs)
    t = row["targets"]
    # medians: ours gain 0.2, 2.0 s, 710 MB; TRL gain 0.25, 2.0 s, 705 MB
    assert t["gold_gain"]["ours"] == pytest.approx(0.2) and t["gold_gain"]["trl116"] == pytest.approx(0.25)
    assert t["gold_gain"]["met"] is False and t["gold_gain"]["missed_by"] == pytest.approx(0.05)
    assert t["seconds_per_step"]["ratio"] == pytest.approx(1.0)
    assert t["seconds_per_step"]["met"] is False and t["seconds_per_step"]["missed_by"] == pytest.approx(1.0)
    assert t["peak_rss_mb"]["met"] is False and t["peak_rss_mb"]["missed_by"] == pytest.approx(5.0)
    assert row["met"] is False
    # one exact command per seed, each naming its seed and the method as its own flag
    cmds = row["commands"]["trl116"].split(" ; ")
    assert len(cmds) == 3 and "--lib trl116 --method grpo" in cmds[0] and '"seed":2' in cmds[2]
    assert "seeds" not in cmds[0] and '"method"' not in cmds[0]


def test_online_targets_met(run):
    row = _row(run, {"ours": [_run(0.3, 0.9, 700)], "trl116": [_run(0.3, 2.0, 700)]})
    assert row["met"] is True and all(x["missed_by"] is None for x in row["targets"].values())


def test_merge_keeps_other_rows_labelled(run, tmp_path):
    old = {"machine_start": {"date": "D0", "loadavg": [1.0, 1.0, 1.0]},
           "machine_end": {"date": "D1", "loadavg": [2.0, 2.0, 2.0]}, "matmul_peak_flops": 1e11,
           "rows": [{"workload": "step", "size": "tiny"}, {"workload": "online", "size": "grpo", "old": True}],
           "parity": {"passed": True}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(old))
    new = {"rows": [{"workload": "online", "size": "grpo"}]}
    merged = run.merge_previous(new, path, {"online"})
    assert [(r["workload"], r.get("old")) for r in merged["rows"]] == [("step", None), ("online", None)]
    assert merged["rows"][0]["measured_in"]["date"] == "D0" and merged["parity"]["measured_in"]["date"] == "D0"
    assert merged["carried_over"] == ["parity", "step"]
    assert run.merge_previous({"rows": []}, tmp_path / "missing.json", {"online"}) == {"rows": []}


def test_report_table_says_which_target_is_missed_and_by_how_much(run):
    import report

    row = _row(run, {"ours": [_run(0.2, 2.0, 710)], "trl116": [_run(0.25, 2.0, 705)]})
    row["settings"].update(completions_per_step=64, num_generations=8, learning_rate=1e-4, beta=0.04,
                           max_completion_length=20, prompt_words=4)
    text = "\n".join(report._online_table([row]))
    assert "| grpo | **missed** by 0.05 gold | **missed** by 1 s (1) | **missed** by 5 MB (1.01) |" in text


def test_report_flags_rows_measured_under_load(run):
    import report

    def timed(load):
        return {"seconds_per_step": 1.0, "load_before": load}

    quiet = {"workload": "step", "size": "mid", "settings": {"batch_size": 16},
             "runs": {"ours": [timed(1.0), timed(1.2)], "trl": [timed(1.1), timed(1.0)]}}
    loaded = {"workload": "step", "size": "tiny", "settings": {"batch_size": 32, "torch_compile": True},
              "runs": {"ours": [timed(1.0), timed(1.72)], "trl": [timed(1.3), timed(1.0)]}}
    assert report.loaded_runs_note([quiet]) == []
    note = "\n".join(report.loaded_runs_note([quiet, loaded]))
    assert "tiny step [torch_compile] [batch 32] (up to 1.72)" in note and "mid" not in note
