"""DDPO on JPEG compressibility (the DDPO paper's first task), offline on a tiny Stable-Diffusion-style pipeline.

    python examples/ddpo_compressibility.py                      # tiny pipeline, 20-40 s on a CPU
    python examples/ddpo_compressibility.py --reward incompressibility --epochs 10
    python examples/ddpo_compressibility.py --lora --learning-rate 3e-2  # LoRA (rank 8, attention + convs)
    python examples/ddpo_compressibility.py --model runwayml/stable-diffusion-v1-5 --lora \\
        --image-steps 50 --epochs 100                            # online, a real SD model on a GPU

Prints the reward curve and writes a grid of samples before and after training to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from rlhf_core.ddpo.pipeline import (  # noqa: E402
    ANIMAL_PROMPTS,
    LORA_CONV_TARGET_MODULES,
    DefaultDDPOStableDiffusionPipeline,
    tiny_stable_diffusion_pipeline,
)
from rlhf_core.ddpo.rewards import image_grid, jpeg_compressibility, jpeg_incompressibility  # noqa: E402
from rlhf_core.ddpo.config import DDPOConfig  # noqa: E402
from rlhf_core.ddpo.trainer import DDPOTrainer  # noqa: E402

REWARDS = {"compressibility": jpeg_compressibility, "incompressibility": jpeg_incompressibility}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="local directory or hub id; empty = the offline tiny pipeline")
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters (default for real models)")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="compressibility")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--image-steps", type=int, default=5, help="DDIM steps per image")
    parser.add_argument("--batch-size", type=int, default=16, help="images sampled per epoch")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/ddpo_compressibility")
    return parser.parse_args(argv)


def build_pipeline(model: str, lora: bool, seed: int) -> DefaultDDPOStableDiffusionPipeline:
    """The tiny offline pipeline or a real one from a directory / hub id (LoRA or the full UNet)."""
    if not model:
        # the tiny UNet needs LoRA on its convolutions too (and a learning rate around 3e-2)
        return DefaultDDPOStableDiffusionPipeline(
            tiny_stable_diffusion_pipeline(seed=seed), use_lora=lora, lora_rank=8,
            lora_target_modules=LORA_CONV_TARGET_MODULES,
        )
    return DefaultDDPOStableDiffusionPipeline(model, use_lora=lora)


def sample_grid(pipeline: DefaultDDPOStableDiffusionPipeline, steps: int, seed: int):
    """Eight images for fixed prompts and fixed noise (comparable before and after training)."""
    embeds = pipeline.encode_prompts(list(ANIMAL_PROMPTS[:8]))
    out = pipeline(embeds, None, num_inference_steps=steps, guidance_scale=1.0,
                   generator=torch.Generator().manual_seed(seed))
    return out.images


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    random.seed(args.seed)
    pipeline = build_pipeline(args.model, args.lora, args.seed)
    config = DDPOConfig(
        num_epochs=args.epochs, seed=args.seed, mixed_precision="no", log_with="memory", save_freq=args.epochs,
        logdir=os.path.join(args.output_dir, "logs"), run_name="run",
        sample_num_steps=args.image_steps, sample_batch_size=args.batch_size, sample_num_batches_per_epoch=1,
        sample_guidance_scale=1.0, train_batch_size=4, train_learning_rate=args.learning_rate, train_clip_range=5e-2,
    )
    reward_fn = REWARDS[args.reward]
    trainer = DDPOTrainer(config, reward_fn, lambda: (random.choice(ANIMAL_PROMPTS[:4]), {}), pipeline)
    before = sample_grid(pipeline, args.image_steps, seed=123)
    trainer.train()
    after = sample_grid(pipeline, args.image_steps, seed=123)

    os.makedirs(args.output_dir, exist_ok=True)
    image_grid(torch.cat([before, after]), columns=8).save(os.path.join(args.output_dir, "before_after.png"))
    trainer.save_pretrained(os.path.join(args.output_dir, "model"))
    curve = [m["reward_mean"] for _, m in trainer.tracker.metrics if "reward_mean" in m]
    print("reward_mean per epoch:", " ".join(f"{r:.4f}" for r in curve))
    print(f"{args.reward} on fixed noise: before {reward_fn(before).mean():.4f} after {reward_fn(after).mean():.4f}")
    print(f"samples (top: before, bottom: after) -> {os.path.join(args.output_dir, 'before_after.png')}")


if __name__ == "__main__":
    main()
