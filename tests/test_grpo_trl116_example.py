"""examples/grpo_trl116.py: TRL 1.16's GRPO quick-start, with only the import swapped, runs offline."""

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_trl116_grpo_script_runs_with_only_the_import_swapped(tmp_path):
    source = (EXAMPLES / "grpo_trl116.py").read_text()
    imports = [line for line in source.splitlines() if re.match(r"\s*(from|import) (trl|rlhf_core)\b", line)]
    assert imports == ["from rlhf_core import GRPOConfig, GRPOTrainer  # noqa: E402  (the one changed line)"]
    env = {**os.environ, "RLHF_CORE_EXAMPLES_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "GRPO_EXAMPLE_STEPS": "2", "GRPO_EXAMPLE_OUTPUT": str(tmp_path / "out")}
    done = subprocess.run([sys.executable, str(EXAMPLES / "grpo_trl116.py")], cwd=EXAMPLES, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"grpo_trl116: 2 steps, reward first -?\d+\.\d+ last -?\d+\.\d+", done.stdout), done.stdout
