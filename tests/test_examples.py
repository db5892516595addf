"""Every example script runs as written (offline, on local tiny models)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, tmp_path: Path, **env: str) -> str:
    environment = {**os.environ, "RLHF_CORE_EXAMPLES_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", **env}
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=EXAMPLES, env=environment,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_minimal_example(tmp_path):
    assert "objective/kl=0.0000" in run_example("minimal_example.py", tmp_path)


def test_readme_example_with_batch_size_one(tmp_path):
    assert "mini_batch_size=1" in run_example("readme_example.py", tmp_path)


def test_training_loop_example(tmp_path):
    assert "training loop: 2 epochs done" in run_example("training_loop.py", tmp_path)
    assert (tmp_path / "cache" / "tiny-causal-ppo" / "model.safetensors").exists()


def test_programmatic_reward_example_runs(tmp_path):
    out = run_example("ppo_programmatic_reward.py", tmp_path, PPO_EXAMPLE_STEPS="2")
    assert "step   1  mean score" in out
