"""Issue 33 row 4: under the pipeline's CPU kernel pins (``flows/process.py``), which libraries a GRPO step reaches
and whether the kernel sets the pins leave free change its bits.

``models/grpo`` hashed differently on an Intel Xeon (AVX-512/AMX) than on AMD. What a GRPO training step runs,
measured here (``MKL_VERBOSE=1``, ``ONEDNN_VERBOSE=1``): every matrix product is MKL's SGEMM in its
``CNR:COMPATIBLE`` branch (``MKL_CBWR``, pinned), no oneDNN primitive is created (so ``ONEDNN_MAX_CPU_ISA`` is moot
for it), and everything else is ATen's own kernels (``ATEN_CPU_CAPABILITY``, pinned). The kernel choices outside the
pins that a machine could make (MKL's instruction set, ``MKL_ENABLE_INSTRUCTIONS``) are forced here one by one: the
weights after every step stay bit-identical. On an AMD machine MKL may keep its own branch whatever is forced; on an
Intel one each is taken. Slow: four tiny trainings in fresh interpreters.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

TRAIN = """
import hashlib, sys
from flows.process import configure_process
configure_process()
import torch
from transformers import TrainerCallback
sys.path.insert(0, "tests")
from _online_rl import count_e, prompt_dataset
from rlhf_core import GRPOConfig, GRPOTrainer
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

hashes = []

class Hash(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        digest = hashlib.md5()
        for _, value in sorted(model.state_dict().items()):
            digest.update(value.detach().contiguous().numpy().tobytes())
        hashes.append(digest.hexdigest())

tok = build_tokenizer()
torch.manual_seed(0)
args = GRPOConfig(output_dir=sys.argv[1], report_to=[], per_device_train_batch_size=16, num_generations=8,
                  max_completion_length=12, max_steps=4, logging_steps=1, save_strategy="no", seed=0,
                  learning_rate=5e-4, beta=0.04, epsilon=0.2, num_iterations=2, loss_type="dapo",
                  scale_rewards="group", disable_tqdm=True)  # the grpo stage's settings, smaller
GRPOTrainer(tiny_causal_lm(tok), count_e, args=args, train_dataset=prompt_dataset(32), processing_class=tok,
            callbacks=[Hash()]).train()
print("HASHES", " ".join(hashes))
"""


def _train(tmp_path: Path, name: str, **env: str) -> tuple[list[str], str]:
    """The per-step weight hashes of a tiny GRPO run with ``env`` added, and what it printed."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MKL_", "ONEDNN_", "DNNL_", "ATEN_"))}
    out = subprocess.run([sys.executable, "-c", TRAIN, str(tmp_path / name)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600, env={**clean, **env, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("HASHES ")]
    return line.split()[1:], out.stdout + out.stderr


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """The pinned run, verbose: (per-step hashes, what MKL and oneDNN said)."""
    return _train(tmp_path_factory.mktemp("grpo"), "pinned", MKL_VERBOSE="1", ONEDNN_VERBOSE="1")


def test_a_grpo_step_reaches_mkl_sgemm_in_its_compatible_branch_and_no_onednn(pinned):
    hashes, printed = pinned
    calls = [ln.split()[1].split("(")[0] for ln in printed.splitlines() if ln.startswith("MKL_VERBOSE ")
             and "(" in ln.split()[1]]
    assert calls and set(calls) == {"SGEMM"}, sorted(set(calls))
    assert all("CNR:COMPATIBLE" in ln for ln in printed.splitlines() if ln.startswith("MKL_VERBOSE SGEMM"))
    assert not [ln for ln in printed.splitlines() if ln.startswith("onednn_verbose") and ",exec," in ln]
    assert len(hashes) == 4 and len(set(hashes)) == 4  # every step moved the weights


@pytest.mark.parametrize("isa", ["AVX2", "AVX512", "AVX512_E4"])  # E4: the AMX-era branch (MKL ignores what it lacks)
def test_mkls_instruction_set_leaves_every_grpo_step_bit_identical(pinned, tmp_path, isa):
    """The pins set MKL's branch (MKL_CBWR), not its instruction set: forcing each one changes no bit. (oneDNN's ISA
    is pinned and, above, reached by no primitive.)"""
    assert _train(tmp_path, isa, MKL_ENABLE_INSTRUCTIONS=isa)[0] == pinned[0]
