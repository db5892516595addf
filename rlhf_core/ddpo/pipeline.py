"""Diffusion pipelines for DDPO: the interface the trainer uses, a Stable Diffusion implementation, and an
offline tiny Stable-Diffusion-style pipeline built from configs.

The trainer only talks to ``DDPOStableDiffusionPipeline``: it encodes prompts, samples trajectories with
the log-probability of every DDIM step, predicts noise (with classifier-free guidance) and exposes the
trainable parameters. ``DefaultDDPOStableDiffusionPipeline`` implements it over a diffusers
``StableDiffusionPipeline`` loaded from a local directory, a hub id (for users online) or an existing
pipeline object; LoRA adapters (peft) are trained by default, the whole UNet with ``use_lora=False``.
Shapes: ``B`` batch, ``S`` sampling steps, ``C`` latent channels, ``h``/``w`` latent size, ``L`` prompt
tokens, ``D`` text-embedding width.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rlhf_core.ddpo.math import classifier_free_guidance, ddim_step_with_logprob

LORA_TARGET_MODULES = ("to_k", "to_q", "to_v", "to_out.0")
# Adding the convolutions lets LoRA learn on the tiny UNet, whose attention sits in one 8x8 block only
# (measured: attention-only LoRA barely moves the tiny model's reward; with these, rank 8, lr 3e-2 it does).
LORA_CONV_TARGET_MODULES = LORA_TARGET_MODULES + ("conv1", "conv2", "conv_in", "conv_out", "proj_in", "proj_out")
# Std of the tiny decoder's input-convolution bias (see ``_smooth_decoder``).
DECODER_INPUT_BIAS_STD = 3.0
# The random UNet's 10-step samples have a latent std of about 10; the VAE divides by this to decode them
# at about unit scale (Stable Diffusion's 0.18215 plays the same role for its trained UNet).
LATENT_SCALING_FACTOR = 0.25
PREDICTION_TYPE = "sample"

# Prompts of the DDPO paper's "simple animals" task; the tiny pipeline's tokenizer is trained on them.
ANIMAL_PROMPTS = (
    "cat", "dog", "horse", "monkey", "rabbit", "zebra", "spider", "bird", "sheep", "deer", "cow", "goat",
    "lion", "tiger", "bear", "raccoon", "fox", "wolf", "lizard", "beetle", "ant", "butterfly", "fish", "shark",
)


@dataclass
class DDPOPipelineOutput:
    """A batch of sampled trajectories."""

    images: torch.Tensor
    """(B, 3, H, W) decoded images in [0, 1]."""
    latents: torch.Tensor
    """(B, S + 1, C, h, w) latents x_T, ..., x_0 (index 0 is the initial noise)."""
    log_probs: torch.Tensor
    """(B, S) log-probability of latents[:, s + 1] given latents[:, s] (mean over latent elements)."""
    timesteps: torch.Tensor
    """(B, S) the DDIM timestep of each step."""


@dataclass
class DDPOSchedulerOutput:
    """One DDIM step with its log-probability."""

    latents: torch.Tensor
    """(B, C, h, w) the next (less noisy) latent x_{t-1}."""
    log_probs: torch.Tensor
    """(B,) log-probability of ``latents`` under the step's Gaussian."""


class DDPOStableDiffusionPipeline(ABC):
    """What ``DDPOTrainer`` needs from a diffusion pipeline."""

    use_lora: bool = True

    @abstractmethod
    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """Text embeddings (B, L, D) of ``prompts``."""

    @abstractmethod
    def noise_prediction(
        self, latents: torch.Tensor, timesteps: torch.Tensor, prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None = None, guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """UNet output (B, C, h, w) at per-sample ``timesteps`` (B,); guided when negative embeds are given
        and ``guidance_scale > 1``."""

    @abstractmethod
    def scheduler_step(
        self, model_output: torch.Tensor, timestep: torch.Tensor, sample: torch.Tensor, eta: float,
        prev_sample: torch.Tensor | None = None, noise: torch.Tensor | None = None,
    ) -> DDPOSchedulerOutput:
        """A DDIM step with the log-probability of its result (or of ``prev_sample`` when given)."""

    @abstractmethod
    def __call__(
        self, prompt_embeds: torch.Tensor, negative_prompt_embeds: torch.Tensor | None = None,
        num_inference_steps: int = 50, guidance_scale: float = 5.0, eta: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> DDPOPipelineOutput:
        """Sample a batch of trajectories (no gradients)."""

    @abstractmethod
    def set_timesteps(self, num_inference_steps: int) -> torch.Tensor:
        """Prepare the scheduler for ``num_inference_steps`` and return its timesteps (S,)."""

    @abstractmethod
    def to(self, device: str | torch.device) -> "DDPOStableDiffusionPipeline":
        """Move every component to ``device``."""

    @abstractmethod
    def get_trainable_layers(self) -> nn.Module:
        """The module whose ``requires_grad`` parameters DDPO trains."""

    @abstractmethod
    def save_pretrained(self, output_dir: str) -> None:
        """Save the trained model (LoRA weights or the full pipeline) as safetensors."""

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the trainable parameters by name (what checkpoints store)."""
        layers = self.get_trainable_layers()
        return {name: p.detach().cpu().clone() for name, p in layers.named_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (from ``trainable_state_dict``) into the trainable parameters."""
        params = {name: p for name, p in self.get_trainable_layers().named_parameters() if p.requires_grad}
        missing, unexpected = set(params) - set(state), set(state) - set(params)
        if missing or unexpected:
            raise ValueError(f"trainable weights do not match: missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(state[name].to(param))

    def set_progress_bar_config(self, **kwargs) -> None:
        """Progress bars are not used by this sampler; kept for classic scripts."""


class DefaultDDPOStableDiffusionPipeline(DDPOStableDiffusionPipeline):
    """DDPO over a diffusers ``StableDiffusionPipeline`` (UNet trained; VAE and text encoder frozen).

    ``pretrained_model_name`` is a local directory, a hub id (needs a network; ``HF_HUB_OFFLINE=1``
    makes it fail at once) or a ready ``StableDiffusionPipeline``. The scheduler is replaced by a
    ``DDIMScheduler`` built from the pipeline's scheduler config.
    """

    def __init__(
        self, pretrained_model_name, *, pretrained_model_revision: str = "main", use_lora: bool = True,
        lora_rank: int = 4, lora_target_modules: Sequence[str] = LORA_TARGET_MODULES,
    ) -> None:
        from diffusers import DDIMScheduler, StableDiffusionPipeline

        if isinstance(pretrained_model_name, StableDiffusionPipeline):
            self.sd_pipeline = pretrained_model_name
        else:
            self.sd_pipeline = _load_stable_diffusion(str(pretrained_model_name), pretrained_model_revision)
        self.sd_pipeline.scheduler = DDIMScheduler.from_config(self.sd_pipeline.scheduler.config)
        _check_scheduler(self.sd_pipeline.scheduler)
        self.use_lora = use_lora
        self.sd_pipeline.vae.requires_grad_(False)
        self.sd_pipeline.text_encoder.requires_grad_(False)
        self.sd_pipeline.unet.requires_grad_(not use_lora)
        if use_lora:
            from peft import LoraConfig

            lora = LoraConfig(r=lora_rank, lora_alpha=lora_rank, init_lora_weights="gaussian",
                              target_modules=list(lora_target_modules))
            self.sd_pipeline.unet.add_adapter(lora)

    # ---- components ---------------------------------------------------------------------------
    @property
    def unet(self) -> nn.Module:
        """The denoising UNet (trained)."""
        return self.sd_pipeline.unet

    @property
    def vae(self) -> nn.Module:
        """The image autoencoder (frozen)."""
        return self.sd_pipeline.vae

    @property
    def text_encoder(self) -> nn.Module:
        """The prompt encoder (frozen)."""
        return self.sd_pipeline.text_encoder

    @property
    def tokenizer(self):
        """The prompt tokenizer."""
        return self.sd_pipeline.tokenizer

    @property
    def scheduler(self):
        """The DDIM scheduler."""
        return self.sd_pipeline.scheduler

    @property
    def device(self) -> torch.device:
        """Device of the UNet."""
        return next(self.unet.parameters()).device

    def to(self, device: str | torch.device) -> "DefaultDDPOStableDiffusionPipeline":
        self.sd_pipeline.to(device)
        return self

    def get_trainable_layers(self) -> nn.Module:
        return self.unet

    # ---- model calls --------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        ids = self.tokenizer(
            list(prompts), padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)  # (B, L)
        return self.text_encoder(ids)[0]  # (B, L, D)

    def noise_prediction(self, latents, timesteps, prompt_embeds, negative_prompt_embeds=None, guidance_scale=1.0):
        if negative_prompt_embeds is None or guidance_scale <= 1.0:
            return self.unet(latents, timesteps, encoder_hidden_states=prompt_embeds).sample  # (B, C, h, w)
        both = self.unet(
            torch.cat([latents, latents]),  # (2B, C, h, w)
            torch.cat([timesteps, timesteps]),  # (2B,)
            encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]),  # (2B, L, D)
        ).sample
        uncond, text = both.chunk(2)  # (B, C, h, w) each
        return classifier_free_guidance(uncond, text, guidance_scale)

    def scheduler_step(self, model_output, timestep, sample, eta, prev_sample=None, noise=None):
        scheduler = self.scheduler
        config = scheduler.config
        prev, log_prob, _, _ = ddim_step_with_logprob(
            model_output, timestep.to(scheduler.alphas_cumprod.device), sample,
            scheduler.alphas_cumprod.to(sample.device), scheduler.final_alpha_cumprod.to(sample.device),
            config.num_train_timesteps // scheduler.num_inference_steps, eta, noise=noise, prev_sample=prev_sample,
            prediction_type=config.prediction_type, clip_sample_range=config.clip_sample_range if config.clip_sample else None,
        )
        return DDPOSchedulerOutput(latents=prev, log_probs=log_prob)

    def set_timesteps(self, num_inference_steps: int) -> torch.Tensor:
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        return self.scheduler.timesteps

    @torch.no_grad()
    def __call__(self, prompt_embeds, negative_prompt_embeds=None, num_inference_steps=50, guidance_scale=5.0,
                 eta=1.0, generator=None):
        batch = prompt_embeds.shape[0]
        timesteps = self.set_timesteps(num_inference_steps)  # (S,)
        latents = self._noise((batch, *self.latent_shape), generator) * self.scheduler.init_noise_sigma
        all_latents, log_probs = [latents], []
        for t in timesteps:
            t_batch = t.expand(batch)  # (B,)
            noise_pred = self.noise_prediction(latents, t_batch, prompt_embeds, negative_prompt_embeds, guidance_scale)
            step = self.scheduler_step(noise_pred, t_batch, latents, eta, noise=self._noise(latents.shape, generator))
            latents = step.latents
            all_latents.append(latents)
            log_probs.append(step.log_probs)
        return DDPOPipelineOutput(
            images=self.decode(latents),
            latents=torch.stack(all_latents, dim=1),  # (B, S + 1, C, h, w)
            log_probs=torch.stack(log_probs, dim=1),  # (B, S)
            timesteps=timesteps.expand(batch, -1).clone(),  # (B, S)
        )

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        """(C, h, w) of the UNet's latents."""
        size = self.unet.config.sample_size
        return (self.unet.config.in_channels, size, size)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents (B, C, h, w) into images (B, 3, H, W) in [0, 1]."""
        images = self.vae.decode(latents / self.vae.config.scaling_factor).sample
        return (images.float() / 2 + 0.5).clamp(0, 1)

    def _noise(self, shape, generator: torch.Generator | None) -> torch.Tensor:
        """Standard normal noise drawn on the generator's device, moved to the UNet's."""
        device = generator.device if generator is not None else self.device
        return torch.randn(shape, generator=generator, device=device).to(self.device, self.unet.dtype)

    # ---- saving ---------------------------------------------------------------------------------
    def save_pretrained(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        if not self.use_lora:
            self.sd_pipeline.save_pretrained(output_dir, safe_serialization=True)
            return
        from peft.utils import get_peft_model_state_dict

        # peft-format keys (lora_A/lora_B): what ``load_lora_weights`` reads back for attention and convs alike
        lora_layers = get_peft_model_state_dict(self.unet)
        type(self.sd_pipeline).save_lora_weights(output_dir, unet_lora_layers=lora_layers, safe_serialization=True)


def _load_stable_diffusion(name: str, revision: str):
    """Load a ``StableDiffusionPipeline`` from a local directory or a hub id, safetensors only."""
    from diffusers import StableDiffusionPipeline

    local = os.path.isdir(name)
    return StableDiffusionPipeline.from_pretrained(
        name, revision=None if local else revision, use_safetensors=True, safety_checker=None,
        requires_safety_checker=False, local_files_only=local or os.environ.get("HF_HUB_OFFLINE") == "1",
    )


def _check_scheduler(scheduler) -> None:
    """DDPO needs a positive variance at every DDIM step and no dynamic thresholding."""
    if scheduler.config.set_alpha_to_one:
        raise ValueError(
            "scheduler config set_alpha_to_one=True gives the last DDIM step zero variance (no log-probability); "
            "use set_alpha_to_one=False, as Stable Diffusion's scheduler configs do"
        )
    if scheduler.config.thresholding:
        raise ValueError("scheduler config thresholding=True is not supported by DDPO's log-probabilities")


# --------------------------------------------------------------------------------------------
# Offline tiny pipeline
# --------------------------------------------------------------------------------------------


def tiny_stable_diffusion_pipeline(seed: int = 0, image_size: int = 32, max_prompt_tokens: int = 8):
    """A randomly initialised Stable-Diffusion-shaped ``StableDiffusionPipeline`` built offline from configs.

    UNet (block channels 32/64, one layer per block, cross-attention dim 32), VAE (32/64 channels, 4 latent
    channels, downsampling 2x), a 2-layer CLIP text encoder and a BPE tokenizer trained on the animal
    prompts; Stable Diffusion's DDIM scheduler config. Wrap it in ``DefaultDDPOStableDiffusionPipeline``.
    """
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from rlhf_core.models.tiny import DEFAULT_CORPUS, build_tokenizer

    tokenizer = build_tokenizer(list(ANIMAL_PROMPTS) + list(DEFAULT_CORPUS), vocab_size=300)
    tokenizer.model_max_length = max_prompt_tokens
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=image_size // 2, in_channels=4, out_channels=4, layers_per_block=1,
            block_out_channels=(32, 64), down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
            norm_num_groups=32,
        )
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, block_out_channels=(32, 64), latent_channels=4, layers_per_block=1,
            down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
            sample_size=image_size, norm_num_groups=32, scaling_factor=LATENT_SCALING_FACTOR,
        )
        _smooth_decoder(vae.decoder, DECODER_INPUT_BIAS_STD)
        text_encoder = CLIPTextModel(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=max_prompt_tokens, pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        ))
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1, prediction_type=PREDICTION_TYPE,
    )
    return StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


@torch.no_grad()
def _smooth_decoder(decoder: nn.Module, bias_std: float) -> None:
    """Make a random VAE decoder behave a little like a trained one (under the caller's seed).

    A random decoder paints the same high-frequency texture over every latent (its GroupNorms make it
    blind to latent scale), so JPEG rewards would barely depend on the UNet. Zeroing the residual
    branches (ResNet ``conv2``, attention output) leaves a smooth upsampler, and a per-channel bias on
    ``conv_in`` makes image contrast grow with the latents' magnitude, as in a trained decoder.
    """
    for name, module in decoder.named_modules():
        if name.endswith("conv2") or name.endswith("to_out.0"):
            module.weight.zero_()
            module.bias.zero_()
    decoder.conv_in.bias.normal_(0.0, bias_std)
