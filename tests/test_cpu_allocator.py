"""rlhf_core.cpu_allocator: when glibc is told to keep freed memory, and that it then stops page-faulting."""

import os
import subprocess
import sys
import textwrap

import pytest

from rlhf_core import cpu_allocator
from rlhf_core.cpu_allocator import OPT_OUT_ENV, skip_reason

linux_glibc = pytest.mark.skipif(cpu_allocator._glibc_mallopt() is None, reason="needs glibc")


def test_the_environment_form_names_the_same_values():
    assert cpu_allocator.ENVIRONMENT == {"MALLOC_MMAP_THRESHOLD_": "1073741824", "MALLOC_TRIM_THRESHOLD_": "1073741824",
                                         "MALLOC_TOP_PAD_": "67108864"}


def test_a_plain_linux_environment_applies_the_settings():
    assert skip_reason({}, "linux") is None
    assert skip_reason({OPT_OUT_ENV: "1", "LD_PRELOAD": ""}, "linux") is None


@pytest.mark.parametrize("environ, platform, reason", [
    ({OPT_OUT_ENV: "0"}, "linux", f"{OPT_OUT_ENV}=0"),
    ({OPT_OUT_ENV: "off"}, "linux", f"{OPT_OUT_ENV}=off"),
    ({}, "darwin", "not Linux"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "linux", "malloc settings given in the environment (MALLOC_MMAP_THRESHOLD_)"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "linux",
     "malloc settings given in the environment (GLIBC_TUNABLES)"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "linux", "jemalloc is preloaded"),
])
def test_the_user_s_choice_or_another_allocator_leaves_malloc_alone(environ, platform, reason):
    assert skip_reason(environ, platform) == reason


# Minor page faults of four "steps" that allocate, fill and free 40-64 MiB tensors of mixed sizes (as a PPO
# step's logits and gradients), after two such steps have run.
_FAULTS = textwrap.dedent("""
    import resource, torch
    from rlhf_core.cpu_allocator import keep_freed_cpu_memory
    applied = keep_freed_cpu_memory()
    def step():
        a, b = torch.ones(12 << 20), torch.ones(16 << 20)
        c, d = a[: 8 << 20] + b[: 8 << 20], torch.ones(10 << 20)
        del a
        e = torch.ones(14 << 20)
    for _ in range(2):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(env_extra: dict[str, str]) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env={**env, **env_extra}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0], int(out[1])


@linux_glibc
def test_kept_memory_is_reused_without_page_faults():
    applied, faults_kept = _faults({})
    skipped, faults_returned = _faults({OPT_OUT_ENV: "0"})
    assert (applied, skipped) == ("True", "False")
    # Returned to the kernel, every block faults in again page by page (4 steps x 240 MiB = 245,760 pages of
    # 4 KiB); kept, freed blocks are reused (measured: 36,864 faults, from the heap's fragmentation).
    assert faults_returned > 200_000
    assert faults_kept < faults_returned / 4


def test_ppo_trainer_on_the_cpu_keeps_freed_memory(monkeypatch):
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm
    from rlhf_core.trainers.ppo import trainer as ppo_trainer

    calls = []
    monkeypatch.setattr(ppo_trainer, "keep_freed_cpu_memory", lambda: calls.append(True))
    tokenizer = build_tokenizer()
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer))
    PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer)
    assert calls == [True]
