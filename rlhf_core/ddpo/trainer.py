"""``DDPOTrainer``: Denoising Diffusion Policy Optimization (Black et al., 2023) with the classic TRL API.

One epoch (``step``) reads like the algorithm:

    sample trajectories (DDIM with eta > 0, log-prob of every step recorded)
    -> rewards from the decoded images (optionally in a thread pool)
    -> advantages (normalised over the batch or per prompt, clipped in the loss)
    -> inner epochs: shuffle samples and, per sample, timesteps; for each batch and trained timestep,
       recompute the step's log-prob and take the clipped PPO loss; accumulate; clip; optimizer step
    -> stats, image hook, checkpoint.

The math lives in ``rlhf_core.ddpo.math``; the model calls in ``rlhf_core.ddpo.pipeline``.
Checkpoints are safetensors (weights, optimizer tensors, RNG states) plus JSON (counters, buffers).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlhf_core.core import set_seed
from rlhf_core.ddpo.math import PerPromptStatTracker, ddpo_clipped_loss, normalize_rewards
from rlhf_core.ddpo.pipeline import DDPOStableDiffusionPipeline
from rlhf_core.tracking import make_tracker
from rlhf_core.ddpo.config import DDPOConfig

CHECKPOINT_PATTERN = re.compile(r"^checkpoint_(\d+)$")
# Per-trajectory tensors of a sample dict, and those indexed by timestep (N, S, ...).
TIMESTEP_KEYS = ("timesteps", "latents", "next_latents", "log_probs")


class DDPOTrainer:
    """Fine-tunes a diffusion pipeline's UNet with DDPO on ``reward_function(images, prompts, metadata)``.

    ``prompt_function()`` returns ``(prompt, metadata)``. ``reward_function`` returns a tensor (B,) or a
    ``(rewards, reward_metadata)`` pair. ``image_samples_hook(prompt_image_data, global_step, tracker)`` is
    called once per epoch, where ``prompt_image_data`` is a list (one entry per sampling batch) of
    ``[images, prompts, prompt_metadata, rewards, reward_metadata]``.
    """

    def __init__(
        self,
        config: DDPOConfig,
        reward_function: Callable[[torch.Tensor, tuple[str, ...], tuple[Any, ...]], torch.Tensor],
        prompt_function: Callable[[], tuple[str, Any]],
        sd_pipeline: DDPOStableDiffusionPipeline,
        image_samples_hook: Callable[[Any, Any, Any], Any] | None = None,
        *,
        tracker: Any = None,
    ) -> None:
        """``tracker``: a ready ``rlhf_core.tracking.Tracker`` (else the one ``config.log_with`` names)."""
        if not isinstance(config, DDPOConfig):
            raise ValueError(f"config must be a DDPOConfig, got {type(config).__name__}")
        for name, fn in (("reward_function", reward_function), ("prompt_function", prompt_function)):
            if not callable(fn):
                raise ValueError(f"{name} must be callable")
        if image_samples_hook is not None and not callable(image_samples_hook):
            raise ValueError("image_samples_hook must be callable or None")
        self.config = config
        self.reward_fn = reward_function
        self.prompt_fn = prompt_function
        self.sd_pipeline = sd_pipeline
        self.image_samples_callback = image_samples_hook
        set_seed(config.seed)
        self.device = self._pick_device()
        self.sd_pipeline.to(self.device)
        self.sd_pipeline.set_timesteps(config.sample_num_steps)
        self.generator = torch.Generator(device="cpu").manual_seed(config.seed)
        self.stat_tracker = (
            PerPromptStatTracker(config.per_prompt_stat_tracking_buffer_size, config.per_prompt_stat_tracking_min_count)
            if config.per_prompt_stat_tracking else None
        )
        self.trainable_parameters = [p for p in sd_pipeline.get_trainable_layers().parameters() if p.requires_grad]
        if not self.trainable_parameters:
            raise ValueError("sd_pipeline has no trainable parameters (requires_grad is False everywhere)")
        self.optimizer = self._setup_optimizer(self.trainable_parameters)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self._amp_dtype() == torch.float16)
        self.executor = ThreadPoolExecutor(max_workers=config.max_workers) if config.async_reward_computation else None
        self.negative_prompt_embed = sd_pipeline.encode_prompts([config.negative_prompts or ""])  # (1, L, D)
        self.first_epoch, self.global_step = 0, 0
        self.checkpoint_dir = self._checkpoint_dir()
        if config.resume_from:
            self.load_checkpoint(config.resume_from)
        if tracker is None:
            tracker = make_tracker(config.log_with, config.tracker_project_name, **(config.tracker_kwargs or {}))
        self.tracker = tracker
        self.tracker.log_params(config.to_dict())

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------

    def _pick_device(self) -> torch.device:
        """CUDA when available (unless ``accelerator_kwargs={"cpu": True}``), else the CPU."""
        kwargs = dict(self.config.accelerator_kwargs or {})
        force_cpu = bool(kwargs.pop("cpu", False))
        if kwargs:
            warnings.warn(f"DDPOTrainer runs in one process and ignores accelerator_kwargs {sorted(kwargs)}")
        if torch.cuda.is_available() and not force_cpu:
            torch.backends.cuda.matmul.allow_tf32 = bool(self.config.allow_tf32)
            return torch.device("cuda")
        if self.config.mixed_precision == "fp16":
            warnings.warn("mixed_precision='fp16' needs CUDA; the UNet runs in fp32 on the CPU")
        return torch.device("cpu")

    def _amp_dtype(self) -> torch.dtype | None:
        """Autocast dtype for the UNet: bf16 anywhere, fp16 on CUDA only, else None (fp32)."""
        if self.config.mixed_precision == "bf16":
            return torch.bfloat16
        if self.config.mixed_precision == "fp16" and self.device.type == "cuda":
            return torch.float16
        return None

    def autocast(self):
        """Context manager running the UNet under the configured mixed precision."""
        dtype = self._amp_dtype()
        return torch.autocast(self.device.type, dtype=dtype) if dtype is not None else nullcontext()

    def _setup_optimizer(self, parameters: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW (bitsandbytes' 8-bit AdamW when ``train_use_8bit_adam``) over the trainable parameters."""
        config = self.config
        optimizer_cls = torch.optim.AdamW
        if config.train_use_8bit_adam:
            try:
                import bitsandbytes
            except ImportError as error:
                raise ImportError("train_use_8bit_adam=True needs bitsandbytes: pip install bitsandbytes") from error
            optimizer_cls = bitsandbytes.optim.AdamW8bit
        return optimizer_cls(
            parameters, lr=config.train_learning_rate, betas=(config.train_adam_beta1, config.train_adam_beta2),
            weight_decay=config.train_adam_weight_decay, eps=config.train_adam_epsilon,
        )

    def _checkpoint_dir(self) -> str:
        """``{project_dir or logdir}/{run_name}/checkpoints``; a resumed run keeps writing beside its checkpoint."""
        if self.config.resume_from:
            resolved = resolve_checkpoint(self.config.resume_from)
            return os.path.dirname(os.path.abspath(resolved))
        root = (self.config.project_kwargs or {}).get("project_dir") or self.config.logdir
        run_name = self.config.run_name or f"{self.config.exp_name}_{time.strftime('%Y%m%d_%H%M%S')}"
        return os.path.join(root, run_name, "checkpoints")

    # ------------------------------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------------------------------

    def train(self, epochs: int | None = None) -> None:
        """Run epochs ``first_epoch .. epochs - 1`` (``config.num_epochs`` when ``epochs`` is None)."""
        global_step = self.global_step
        for epoch in range(self.first_epoch, epochs if epochs is not None else self.config.num_epochs):
            global_step = self.step(epoch, global_step)

    def step(self, epoch: int, global_step: int) -> int:
        """One DDPO epoch: sample, reward, advantages, inner PPO epochs, log, checkpoint. Returns global_step."""
        sample_batches, prompt_image_data = self._generate_samples(
            self.config.sample_num_batches_per_epoch, self.config.sample_batch_size, start_rewards=True
        )
        samples = collate_samples(sample_batches)  # (N, ...) per key
        rewards = self._collect_rewards(prompt_image_data)  # (N,)
        self.tracker.log({
            "reward_mean": rewards.mean().item(), "reward_std": rewards.std(unbiased=False).item(), "epoch": epoch,
        }, step=global_step)
        if self.image_samples_callback is not None:
            self.image_samples_callback(prompt_image_data, global_step, self.tracker)
        prompts = [prompt for entry in prompt_image_data for prompt in entry[1]]  # (N,)
        samples["advantages"] = self._advantages(prompts, rewards).to(self.device)  # (N,)
        for inner_epoch in range(self.config.train_num_inner_epochs):
            batches = self._shuffled_batches(samples)
            global_step = self._train_batched_samples(inner_epoch, epoch, global_step, batches)
        self.global_step = global_step
        if (epoch + 1) % self.config.save_freq == 0:
            self.save_checkpoint(epoch, global_step)
        return global_step

    def _generate_samples(
        self, iterations: int, batch_size: int, start_rewards: bool = False
    ) -> tuple[list[dict[str, torch.Tensor]], list[list[Any]]]:
        """Sample ``iterations`` batches of ``batch_size`` trajectories, as TRL 0.11.4 returns them.

        Returns one sample dict per batch (``prompt_embeds`` (B, L, D), ``timesteps`` (B, S), ``latents`` (B, S, C,
        h, w) the latent before each step, ``next_latents`` the one after it, ``log_probs`` (B, S) and
        ``negative_prompt_embeds`` (B, L, D)) and one ``[images, prompts, prompt_metadata]`` per batch. With
        ``start_rewards`` (``step``) each of those also gets its rewards, started as soon as the batch is sampled
        (in threads when rewards are asynchronous, not awaited) and an empty reward metadata:
        ``[images, prompts, prompt_metadata, rewards (Future or value), {}]``.
        """
        config = self.config
        samples, prompt_image_data = [], []
        for _ in range(iterations):
            prompts, metadata = zip(*[self.prompt_fn() for _ in range(batch_size)])
            prompt_embeds = self.sd_pipeline.encode_prompts(prompts)  # (B, L, D)
            negative = self.negative_prompt_embed.expand(batch_size, -1, -1)  # (B, L, D)
            with self.autocast():
                out = self.sd_pipeline(
                    prompt_embeds, negative, num_inference_steps=config.sample_num_steps,
                    guidance_scale=config.sample_guidance_scale, eta=config.sample_eta, generator=self.generator,
                )
            samples.append({
                "prompt_embeds": prompt_embeds,
                "timesteps": out.timesteps,  # (B, S)
                "latents": out.latents[:, :-1],  # (B, S, C, h, w)  x_t
                "next_latents": out.latents[:, 1:],  # (B, S, C, h, w)  x_{t-1}
                "log_probs": out.log_probs,  # (B, S)
                "negative_prompt_embeds": negative,
            })
            prompt_image_data.append([out.images, prompts, metadata])
            if start_rewards:
                prompt_image_data[-1] += [self._start_reward(out.images, prompts, metadata), {}]
        return samples, prompt_image_data

    def _start_reward(self, images: torch.Tensor, prompts, metadata) -> Future | tuple[torch.Tensor, Any]:
        """Call the reward function now, or submit it to the thread pool when rewards are asynchronous."""
        if self.executor is not None:
            return self.executor.submit(self.reward_fn, images, prompts, metadata)
        return self.reward_fn(images, prompts, metadata)

    def _collect_rewards(self, prompt_image_data: list[list[Any]]) -> torch.Tensor:
        """Wait for every batch's rewards, store them in ``prompt_image_data`` and return them (N,) in float32."""
        all_rewards = []
        for entry in prompt_image_data:
            result = entry[3].result() if isinstance(entry[3], Future) else entry[3]
            rewards, reward_metadata = _split_reward_output(result, len(entry[1]))
            entry[3], entry[4] = rewards, reward_metadata
            all_rewards.append(rewards)
        return torch.cat(all_rewards)

    def _advantages(self, prompts: list[str], rewards: torch.Tensor) -> torch.Tensor:
        """Advantages (N,): per-prompt statistics when tracking is on, else over the whole epoch."""
        if self.stat_tracker is not None:
            return self.stat_tracker.update(prompts, rewards).float()
        return normalize_rewards(rewards).float()

    def _shuffled_batches(self, samples: dict[str, Any]) -> list[dict[str, Any]]:
        """Shuffle samples, then each sample's timesteps independently; split into training batches."""
        n, steps = samples["timesteps"].shape
        order = torch.randperm(n, generator=self.generator)  # (N,)
        per_step = torch.stack([torch.randperm(steps, generator=self.generator) for _ in range(n)])  # (N, S)
        rows = torch.arange(n)[:, None]  # (N, 1)
        shuffled = {}
        for key, value in samples.items():
            value = value[order.to(value.device)]
            if key in TIMESTEP_KEYS:
                value = value[rows.to(value.device), per_step.to(value.device)]  # (N, S, ...) timestep order shuffled
            shuffled[key] = value
        size = self.config.train_batch_size
        return [
            {key: value[start:start + size] for key, value in shuffled.items()} for start in range(0, n, size)
        ]

    def _train_batched_samples(
        self, inner_epoch: int, epoch: int, global_step: int, batched_samples: list[dict[str, Any]]
    ) -> int:
        """Clipped PPO updates over the batches; one optimizer step per ``train_gradient_accumulation_steps`` batches."""
        config = self.config
        accumulation, train_steps = config.train_gradient_accumulation_steps, config.num_train_timesteps
        info: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.sd_pipeline.get_trainable_layers().train()
        for index, batch in enumerate(batched_samples):
            embeds = batch["prompt_embeds"]  # (b, L, D)
            if config.train_cfg:
                negative = self.negative_prompt_embed.expand(embeds.shape[0], -1, -1)
                embeds = torch.cat([negative, embeds])  # (2b, L, D)
            for j in range(train_steps):
                with self.autocast():
                    loss, approx_kl, clipfrac = self.calculate_loss(
                        batch["latents"][:, j], batch["timesteps"][:, j], batch["next_latents"][:, j],
                        batch["log_probs"][:, j], batch["advantages"], embeds,
                    )
                self.scaler.scale(loss / (accumulation * train_steps)).backward()
                info["approx_kl"].append(approx_kl)
                info["clipfrac"].append(clipfrac)
                info["loss"].append(loss.detach())
            if (index + 1) % accumulation == 0:
                grad_norm = self._optimizer_step()
                global_step += 1
                stats = {key: torch.stack(values).mean().item() for key, values in info.items()}
                stats.update(grad_norm=grad_norm, epoch=epoch, inner_epoch=inner_epoch)
                self.tracker.log(stats, step=global_step)
                info.clear()
        self.sd_pipeline.get_trainable_layers().eval()
        return global_step

    def _optimizer_step(self) -> float:
        """Unscale, clip the gradient norm to ``train_max_grad_norm``, step and zero the gradients."""
        self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, self.config.train_max_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # ------------------------------------------------------------------------------------------
    # the loss
    # ------------------------------------------------------------------------------------------

    def compute_log_prob(
        self, latents: torch.Tensor, timesteps: torch.Tensor, next_latents: torch.Tensor, embeds: torch.Tensor
    ) -> torch.Tensor:
        """Log-prob (b,) of ``next_latents`` given ``latents`` at ``timesteps`` under the current UNet.

        latents, next_latents: (b, C, h, w); timesteps: (b,); embeds: (2b, L, D) as ``[negative; prompt]``
        when ``train_cfg`` (guided with ``sample_guidance_scale``), else (b, L, D).
        """
        config = self.config
        if config.train_cfg:
            negative, prompt = embeds.chunk(2)  # (b, L, D) each
            noise_pred = self.sd_pipeline.noise_prediction(
                latents, timesteps, prompt, negative, config.sample_guidance_scale
            )
        else:
            noise_pred = self.sd_pipeline.noise_prediction(latents, timesteps, embeds)
        step = self.sd_pipeline.scheduler_step(
            noise_pred.float(), timesteps, latents.float(), config.sample_eta, prev_sample=next_latents.float()
        )
        return step.log_probs

    def loss(self, advantages: torch.Tensor, clip_range: float, ratio: torch.Tensor) -> torch.Tensor:
        """TRL 0.11's clipped surrogate from a ratio: ``mean(max(-A * ratio, -A * clip(ratio, 1 +- clip_range)))``,
        advantages and ratio (B,) -> scalar."""
        unclipped = -advantages * ratio  # (B,)
        clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)  # (B,)
        return torch.mean(torch.maximum(unclipped, clipped))

    def calculate_loss(
        self, latents: torch.Tensor, timesteps: torch.Tensor, next_latents: torch.Tensor, log_probs: torch.Tensor,
        advantages: torch.Tensor, embeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Clipped DDPO loss of one denoising step for a batch: returns ``(loss, approx_kl, clipfrac)``.

        latents, next_latents: (b, C, h, w); timesteps, log_probs (recorded while sampling), advantages: (b,);
        embeds as in ``compute_log_prob``.
        """
        log_prob = self.compute_log_prob(latents, timesteps, next_latents, embeds)  # (b,)
        loss, stats = ddpo_clipped_loss(
            log_prob, log_probs, advantages, self.config.train_clip_range, self.config.train_adv_clip_max
        )
        return loss, stats["approx_kl"], stats["clipfrac"]

    # ------------------------------------------------------------------------------------------
    # saving and resuming
    # ------------------------------------------------------------------------------------------

    def save_pretrained(self, save_directory: str) -> None:
        """Save the trained model (LoRA weights or the full pipeline) to ``save_directory``."""
        self.sd_pipeline.save_pretrained(save_directory)

    def save_checkpoint(self, epoch: int, global_step: int) -> str:
        """Write ``checkpoint_{epoch}`` atomically (temp dir + rename) and prune to ``num_checkpoint_limit``."""
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        target = os.path.join(self.checkpoint_dir, f"checkpoint_{epoch}")
        staging = tempfile.mkdtemp(prefix=f".checkpoint_{epoch}.", dir=self.checkpoint_dir)
        save_file(self.sd_pipeline.trainable_state_dict(), os.path.join(staging, "trainable.safetensors"))
        tensors, meta = _flatten_optimizer_state(self.optimizer.state_dict())
        save_file(tensors, os.path.join(staging, "optimizer.safetensors"))
        save_file(self._rng_tensors(), os.path.join(staging, "rng.safetensors"))
        state = {
            "epoch": epoch, "global_step": global_step, "optimizer": meta, "python_rng": _python_rng_state(),
            "numpy_rng": _numpy_rng_state(), "stat_tracker": self.stat_tracker.state_dict() if self.stat_tracker else None,
        }
        with open(os.path.join(staging, "trainer_state.json"), "w") as handle:
            json.dump(state, handle)
        if os.path.exists(target):
            shutil.rmtree(target)
        os.replace(staging, target)
        prune_checkpoints(self.checkpoint_dir, self.config.num_checkpoint_limit)
        return target

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer, RNGs, stat tracker and counters; training resumes at the next epoch."""
        path = resolve_checkpoint(path)
        self.sd_pipeline.load_trainable_state_dict(load_file(os.path.join(path, "trainable.safetensors")))
        with open(os.path.join(path, "trainer_state.json")) as handle:
            state = json.load(handle)
        optimizer_tensors = load_file(os.path.join(path, "optimizer.safetensors"))
        self.optimizer.load_state_dict(_unflatten_optimizer_state(optimizer_tensors, state["optimizer"]))
        rng = load_file(os.path.join(path, "rng.safetensors"))
        torch.set_rng_state(rng["torch"])
        self.generator.set_state(rng["generator"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        random.setstate((state["python_rng"][0], tuple(state["python_rng"][1]), state["python_rng"][2]))
        np.random.set_state(_numpy_state_from_json(state["numpy_rng"]))
        if self.stat_tracker is not None and state["stat_tracker"] is not None:
            self.stat_tracker.load_state_dict(state["stat_tracker"])
        self.first_epoch, self.global_step = state["epoch"] + 1, state["global_step"]

    def _rng_tensors(self) -> dict[str, torch.Tensor]:
        """The torch RNG states (global CPU, the sampling generator, CUDA when present) as uint8 tensors."""
        tensors = {"torch": torch.get_rng_state(), "generator": self.generator.get_state()}
        if torch.cuda.is_available():
            tensors["cuda"] = torch.cuda.get_rng_state()
        return tensors


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def collate_samples(sample_batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``_generate_samples``' per-batch dicts as one dict, each tensor concatenated over the batches: (N, ...)."""
    return {key: torch.cat([batch[key] for batch in sample_batches]) for key in sample_batches[0]}


def _split_reward_output(result: Any, batch_size: int) -> tuple[torch.Tensor, Any]:
    """Accept ``rewards`` or ``(rewards, metadata)`` from a reward function; rewards become float32 (B,).

    A pair counts as ``(rewards, metadata)`` only when its first item is not a scalar, so a batch of two
    plain-float rewards ``(0.5, 0.7)`` is read as two rewards.
    """
    metadata: Any = {}
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (torch.Tensor, np.ndarray, list, tuple)):
        result, metadata = result
    rewards = torch.as_tensor(_to_numpy(result), dtype=torch.float32).reshape(-1)
    if rewards.shape[0] != batch_size:
        raise ValueError(f"reward_function returned {rewards.shape[0]} rewards for {batch_size} images")
    if not torch.isfinite(rewards).all():
        raise ValueError("reward_function returned a non-finite reward")
    return rewards, metadata


def _to_numpy(values: Any) -> np.ndarray:
    """Tensor, array or sequence of numbers -> numpy array (tensors detached and moved to the CPU)."""
    if torch.is_tensor(values):
        return values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=np.float64)


def resolve_checkpoint(path: str) -> str:
    """``path`` if it is a ``checkpoint_N`` folder, else the newest ``checkpoint_N`` inside it."""
    path = os.path.normpath(path)
    if not os.path.isdir(path):
        raise ValueError(f"resume_from={path!r} is not a directory")
    if CHECKPOINT_PATTERN.match(os.path.basename(path)):
        return path
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"resume_from={path!r} holds no checkpoint_N folder")
    return found[-1]


def list_checkpoints(directory: str) -> list[str]:
    """``checkpoint_N`` folders in ``directory``, oldest (smallest N) first."""
    if not os.path.isdir(directory):
        return []
    numbered = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := CHECKPOINT_PATTERN.match(name))]
    return [os.path.join(directory, name) for _, name in sorted(numbered)]


def prune_checkpoints(directory: str, limit: int | None) -> None:
    """Remove the oldest checkpoints beyond ``limit`` (``None`` keeps all)."""
    if limit is None:
        return
    found = list_checkpoints(directory)
    for old in found[: max(0, len(found) - limit)]:
        shutil.rmtree(old)


def _flatten_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into tensors (for safetensors) and JSON-able metadata."""
    tensors, scalars = {}, {}
    for index, param_state in state_dict["state"].items():
        for key, value in param_state.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def _unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    """Inverse of ``_flatten_optimizer_state``."""
    state: dict[int, dict[str, Any]] = defaultdict(dict)
    for source in (tensors, meta["scalars"]):
        for name, value in source.items():
            index, key = name.split(".", 1)
            state[int(index)][key] = value
    return {"state": dict(state), "param_groups": meta["param_groups"]}


def _python_rng_state() -> list[Any]:
    """``random.getstate()`` as JSON-able lists."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state() -> dict[str, Any]:
    """``np.random.get_state()`` as a JSON-able dict."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_state_from_json(state: dict[str, Any]) -> tuple:
    """Inverse of ``_numpy_rng_state``."""
    keys = np.asarray(state["keys"], dtype=np.uint32)
    return state["name"], keys, state["pos"], state["has_gauss"], state["cached"]
