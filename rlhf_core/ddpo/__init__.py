"""DDPO (Black et al., "Training Diffusion Models with Reinforcement Learning") as one package.

- ``config``: ``DDPOConfig``, the classic TRL fields and defaults;
- ``trainer``: ``DDPOTrainer`` (sampling, scoring, clipped PPO updates, checkpoints);
- ``math``: the pure math (DDIM step as a Gaussian policy, per-prompt reward normalisation, the loss);
- ``pipeline``: the diffusion pipeline interface, its Stable Diffusion implementation and an offline tiny pipeline;
- ``rewards``: the paper's JPEG (in)compressibility image rewards.

Names are imported on first use, so ``import rlhf_core.ddpo`` needs neither diffusers nor PIL.
"""

from __future__ import annotations

from rlhf_core._lazy import lazy_exports

# the modules whose public names (rlhf_core._lazy.PUBLIC) this package exports
__all__, __getattr__, __dir__ = lazy_exports(__name__, globals(), "rlhf_core.ddpo")
