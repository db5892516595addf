"""Parity with classic TRL: one PPO step from identical weights, dropout off, one mini-batch per epoch.

Runs bench/workloads/parity.py in .venv (rlhf_core) and in bench/.trl-venv (trl==0.11.4), then
compares every scalar stat (losses, KL, entropy, returns, values), the per-sample KL and every
updated weight within 1e-4. Skipped when the TRL environment has not been built
(``bash bench/setup_trl_venv.sh``). Run by ``make bench`` through bench/run.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PYTHONS = {"ours": ROOT / ".venv" / "bin" / "python", "trl": BENCH / ".trl-venv" / "bin" / "python"}
TOL = 1e-4

pytestmark = pytest.mark.skipif(not PYTHONS["trl"].exists(), reason="bench/.trl-venv missing (bash bench/setup_trl_venv.sh)")


def _run(lib: str, out: Path, kl_penalty: str, **extra) -> dict:
    python = PYTHONS[lib] if lib == "trl" else Path(sys.executable)
    args = json.dumps({"out": str(out), "kl_penalty": kl_penalty, "threads": 1, **extra})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if lib == "ours":  # this checkout's rlhf_core, whatever the venv's editable install points at
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([str(python), str(BENCH / "workloads" / "parity.py"), "--lib", lib, "--args", args],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["kl", "full"])
def both(request, tmp_path_factory):
    sys.path.insert(0, str(BENCH))
    import prepare  # the cached tokenizer and tiny model, shared with the workloads

    prepare.ensure_default_tokenizer()
    prepare.ensure_models()
    out = tmp_path_factory.mktemp(f"parity-{request.param}")
    return {lib: _run(lib, out, request.param) for lib in ("ours", "trl")}, out


def test_step_stats_match_classic_trl(both):
    results, _ = both
    ours, trl = results["ours"]["stats"], results["trl"]["stats"]
    for key, value in trl.items():
        if key == "ppo/policy/advantages_mean":  # whitened: 0 up to rounding in both (1e-9 vs 0.0)
            assert abs(ours[key]) < TOL and abs(value) < TOL
            continue
        assert ours[key] == pytest.approx(value, abs=TOL, rel=TOL), key
    assert ours["objective/kl"] != 0.0  # the probe moved the policy off the reference


def test_updated_weights_match_classic_trl(both):
    from safetensors.torch import load_file

    _, out = both
    ours, trl = load_file(str(out / "ours.safetensors")), load_file(str(out / "trl.safetensors"))
    assert set(ours) == set(trl)
    worst = max((ours[k] - trl[k]).abs().max().item() for k in ours)
    assert worst < TOL, f"max |w_ours - w_trl| = {worst:.3g}"


@pytest.mark.slow  # compiling the tiny model's forward and backward takes ~1.5 min on CPU
def test_compiled_step_matches_classic_trl(both, request):
    """The ``torch_compile`` opt-in: same stats and updated weights within the parity tolerance."""
    from safetensors.torch import load_file

    results, out = both
    kl_penalty = request.node.callspec.params["both"]
    compiled = _run("ours", out, kl_penalty, torch_compile=True)["stats"]
    for key, value in results["trl"]["stats"].items():
        assert compiled[key] == pytest.approx(value, abs=TOL, rel=TOL), key
    ours, trl = load_file(str(out / "ours-compiled.safetensors")), load_file(str(out / "trl.safetensors"))
    worst = max((ours[k] - trl[k]).abs().max().item() for k in trl)
    assert worst < TOL, f"max |w_compiled - w_trl| = {worst:.3g}"
