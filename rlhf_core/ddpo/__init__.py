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

# public name -> module that defines it
_EXPORTS = {
    "DDPOConfig": "rlhf_core.ddpo.config",
    "DDPOTrainer": "rlhf_core.ddpo.trainer",
    "DDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
    "DefaultDDPOStableDiffusionPipeline": "rlhf_core.ddpo.pipeline",
    "DDPOPipelineOutput": "rlhf_core.ddpo.pipeline",
    "DDPOSchedulerOutput": "rlhf_core.ddpo.pipeline",
    "tiny_stable_diffusion_pipeline": "rlhf_core.ddpo.pipeline",
    "PerPromptStatTracker": "rlhf_core.ddpo.math",
    "ddim_step_with_logprob": "rlhf_core.ddpo.math",
    "ddpo_clipped_loss": "rlhf_core.ddpo.math",
    "normalize_rewards": "rlhf_core.ddpo.math",
    "jpeg_compressibility": "rlhf_core.ddpo.rewards",
    "jpeg_incompressibility": "rlhf_core.ddpo.rewards",
    "image_grid": "rlhf_core.ddpo.rewards",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
