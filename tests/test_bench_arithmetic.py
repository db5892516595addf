"""bench row (f), GRPO on the arithmetic task against TRL 1.16 (issue 32 point 5): the reward both trainers get
agrees with rlhf_core's accuracy_reward; the row's medians, gains and commands; its table; the error when the
arithmetic pipeline's outputs are missing. No TRL venv and no training: runs are given as dicts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from rlhf_core.rewards import accuracy_reward

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def run():
    sys.path.insert(0, str(ROOT / "bench"))
    return _load("bench_run", ROOT / "bench" / "run.py")


@pytest.fixture(scope="module")
def workload(run):
    return run.arithmetic_task


COMPLETIONS = ["7 + 5 = 12 <answer>12</answer>", "<answer> 12. </answer>", "<answer>13</answer>", "12",
               "#### 12", "\\boxed{24/2}", "<answer>1</answer> no, <answer>12</answer>", "<answer>-3</answer>",
               "<answer>12", [{"role": "assistant", "content": "<answer>12.0</answer>"}], ""]


def test_shared_reward_agrees_with_accuracy_reward(workload):
    """The standalone reward (rlhf_core's answer rules loaded by path, for the TRL venv) gives accuracy_reward's
    verdicts, and records each call's mean (the per-step training reward)."""
    reward = workload.ExactAnswer()
    digests = []
    for solution in ("12", "-3", 12):
        solutions = [solution] * len(COMPLETIONS)
        expected = accuracy_reward(COMPLETIONS, solutions)
        got = reward(prompts=["Q"] * len(COMPLETIONS), completions=COMPLETIONS, solution=solutions,
                     completion_ids=[[1]] * len(COMPLETIONS))
        assert got == expected
        assert reward.means[-1] == pytest.approx(sum(expected) / len(expected))
        digests.append(reward.first_digest)
    assert digests[0] is not None and len(set(digests)) == 1  # the first call's completions only
    assert sum(accuracy_reward(COMPLETIONS, ["12"] * len(COMPLETIONS))) == 6  # the cases are not all one verdict
    with pytest.raises(ValueError, match="no readable number"):
        reward(completions=["<answer>1</answer>"], solution=["n/a"])


def test_missing_task_outputs_name_the_path_and_the_command(workload, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"models/sft.*make run TASK=arithmetic"):
        workload.task_paths(tmp_path)


def _train(seed, secs, first, last, digest="d"):
    return {"lib": "x", "seed": seed, "seconds_per_step": secs, "reward_first10": first, "reward_last10": last,
            "train_seconds": 100 * secs, "peak_rss_mb": 600.0, "first_step_completions_md5": digest}


def _eval(seed, sft, ours, trl):
    return {"seed": seed, "command": f"evaluate {seed}", "sft": {"pass@1": sft}, "ours": {"pass@1": ours},
            "trl116": {"pass@1": trl}}


def test_row_medians_gains_and_commands(run, monkeypatch):
    monkeypatch.delenv("ARITHMETIC_DIR", raising=False)
    runs = {"ours": [_train(0, 0.2, 0.4, 0.5), _train(1, 0.4, 0.4, 0.6), _train(2, 0.3, 0.4, 0.7)],
            "trl116": [_train(0, 0.3, 0.4, 0.5), _train(1, 0.5, 0.4, 0.5, "other"), _train(2, 0.6, 0.4, 0.5)]}
    evals = [_eval(0, 0.5, 0.55, 0.5), _eval(1, 0.5, 0.6, 0.45), _eval(2, 0.5, 0.5, 0.52)]
    settings = next(a for w, _, a in run.WORKLOADS if w == "arithmetic")  # the bench's own row
    args = {**settings, "steps": 2, "threads": 1, "seeds": [0, 1, 2]}
    row = run.summarise_arithmetic("sft-3x128", args, runs, evals)
    o, t = row["median"]["ours"], row["median"]["trl116"]
    assert o["pass@1_before"] == t["pass@1_before"] == 0.5
    assert o["pass@1_after"] == pytest.approx(0.55) and t["pass@1_after"] == pytest.approx(0.5)
    assert o["pass@1_gain"] == pytest.approx(0.05) and t["pass@1_gain"] == pytest.approx(0.0)
    assert o["seconds_per_step"] == pytest.approx(0.3) and t["seconds_per_step"] == pytest.approx(0.5)
    assert row["ratio"] == pytest.approx(0.6) and row["met"] is None
    cmds = row["commands"]["trl116"].split(" ; ")
    assert len(cmds) == 3 and '"seed":2' in cmds[2] and '"save_dir":"bench/.cache/arithmetic/trl116-seed2"' in cmds[2]
    assert row["commands"]["evaluate"] == "evaluate 0 ; evaluate 1 ; evaluate 2"
    import report

    text = "\n".join(report._arithmetic_table([row]))
    assert "| ours | 0.5 | 0.55 | 0.05 |" in text and "**0.6**" in text
    assert "identical in both stacks (digest) for seeds [0, 2] of [0, 1, 2]" in text
