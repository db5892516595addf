"""Soak: 300 PPO steps on a tiny model; no resident-memory growth after warm-up and no step-time growth.

The figures are printed to the terminal (and kept as test properties). The full benchmark is
``bench/soak.py``; ``RLHF_SOAK_STEPS`` shortens this test on a slow machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_soak():
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_300_ppo_steps_do_not_grow_memory_or_step_time(capsys, record_property):
    steps = int(os.environ.get("RLHF_SOAK_STEPS", "300"))
    threads = torch.get_num_threads()
    try:
        result = load_soak().run_soak(steps=steps, warmup=50)
    finally:
        torch.set_num_threads(threads)
    summary = {k: v for k, v in result.items() if k != "rss_samples"}
    for key, value in summary.items():
        record_property(key, value)
    with capsys.disabled():
        print("\nsoak:", json.dumps(summary))
    # memory: flat after warm-up (a leak of one small tensor per step would show as a steady slope)
    assert result["rss_growth_mb"] < 10, summary
    assert result["rss_slope_mb_per_100_steps"] < 2, summary
    # time: CPU time per step (insensitive to other processes) does not drift upward
    assert result["cpu_time_ratio_last_over_first"] < 1.5, summary
