"""Optional-dependency probes at TRL 0.11's ``trl.import_utils`` names (scripts and tests branch on them)."""

from __future__ import annotations

import importlib.util


def _installed(package: str) -> bool:
    """True when ``package`` can be imported (nothing is imported to find out)."""
    return importlib.util.find_spec(package) is not None


def is_diffusers_available() -> bool:
    """diffusers is installed (DDPO's Stable Diffusion pipeline)."""
    return _installed("diffusers")


def is_peft_available() -> bool:
    """peft is installed (LoRA policies, PEFT reference models)."""
    return _installed("peft")


def is_wandb_available() -> bool:
    """wandb is installed (``log_with="wandb"``)."""
    return _installed("wandb")


def is_liger_kernel_available() -> bool:
    """Always False: rlhf_core does not use Liger kernels."""
    return False
