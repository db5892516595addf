"""GRPO's group standard deviation has the same bits on every CPU (issue 33 row 4).

torch's float32 ``sqrt`` on a CPU is MKL's vector math, which is not correctly rounded and differs between AMD and
Intel machines (../shared/ENVIRONMENT.md); ``losses.correctly_rounded_sqrt`` is, whatever kernels run.
"""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_core.losses import _nanstd, _nearest_root, correctly_rounded_sqrt, group_relative_advantages

ROOT = Path(__file__).resolve().parents[1]
SPECIAL = [0.0, -0.0, float("inf"), float("nan"), -1.0, 1.4e-45, 1.2e-38, 3.4e38, 1.0, 2.0, 4.0]


def inputs(n: int = 400_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.cat([torch.rand(n, generator=g) * 4, torch.rand(n, generator=g) * 1e6,
                      torch.rand(n // 4, generator=g) * 1e-30, torch.tensor(SPECIAL)])


def nearest(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 root: the hardware's float64 root (IEEE) rounded once more (a float64 root of
    a float32 has more than 2 x 24 + 2 bits, so the second rounding never errs)."""
    with np.errstate(invalid="ignore"):
        return torch.from_numpy(np.sqrt(x.double().numpy()).astype(np.float32))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def test_the_root_is_correctly_rounded_for_every_input_and_torch_sqrt_may_not_be():
    x = inputs()
    assert same_bits(correctly_rounded_sqrt(x), nearest(x))
    # what the function exists for (on this project's AMD machine ~1 in 5 of these is 1 ulp off; a CPU where
    # torch's root is exact makes this line moot, not wrong)
    print("torch.sqrt off by an ulp:", int((x.sqrt() != nearest(x)).sum() - nearest(x).isnan().sum()))


@pytest.mark.parametrize("direction", [float("inf"), 0.0])
def test_a_guess_one_ulp_off_either_way_is_corrected(direction):
    x = inputs(100_000)
    exact = nearest(x)
    positive = torch.isfinite(exact) & (x > 0)
    x, exact = x[positive], exact[positive]
    guess = torch.nextafter(exact, torch.full_like(exact, direction))
    assert (guess != exact).all()
    assert same_bits(_nearest_root(x, guess), exact)


def test_other_dtypes_keep_torchs_root():
    x = torch.rand(100, dtype=torch.float64)
    assert torch.equal(correctly_rounded_sqrt(x), x.sqrt())


def test_grpos_group_std_uses_the_correctly_rounded_root():
    rewards = torch.rand(64, generator=torch.Generator().manual_seed(3))
    grouped = rewards.view(8, 8)
    variance = ((grouped - grouped.mean(1, keepdim=True)) ** 2).sum(1) / 7
    assert same_bits(_nanstd(grouped, dim=1), nearest(variance))
    _, std = group_relative_advantages(rewards, 8)
    assert same_bits(std, nearest(variance).repeat_interleave(8))


PROBE = """
import hashlib, sys
import torch
sys.path.insert(0, {root!r})
from rlhf_core.losses import correctly_rounded_sqrt
g = torch.Generator().manual_seed(0)
x = torch.cat([torch.rand(300_000, generator=g) * 4, torch.rand(300_000, generator=g) * 1e6])
print(torch.backends.cpu.get_cpu_capability(), hashlib.md5(correctly_rounded_sqrt(x).numpy().tobytes()).hexdigest(),
      hashlib.md5(x.sqrt().numpy().tobytes()).hexdigest())
"""

# Each kernel set this machine can run: ATen's (default, AVX2, AVX-512 where the CPU has it) and MKL's branches
KERNEL_SETS = [
    {},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"},  # the pipeline's pins
    {"ATEN_CPU_CAPABILITY": "avx512"},
    {"MKL_CBWR": "AVX2"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    {"MKL_CBWR": "COMPATIBLE,STRICT"},
]


def test_the_same_bits_under_every_kernel_set_this_cpu_can_run():
    """The pipeline pins ATen to AVX2 and MKL's matmuls to COMPATIBLE; the root does not rely on either."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(300_000, generator=g) * 4, torch.rand(300_000, generator=g) * 1e6])
    expected = hashlib.md5(nearest(x).numpy().tobytes()).hexdigest()
    seen = {}
    for extra in KERNEL_SETS:
        env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR",
                                                                 "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")}
        env.update(extra, OMP_NUM_THREADS="1")
        out = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        capability, ours, torchs = out.stdout.split()
        seen[str(extra)] = (capability, torchs)
        assert ours == expected, (extra, capability)
    print(seen)  # which kernels ran, and whether torch's own root changed with them
