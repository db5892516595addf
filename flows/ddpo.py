"""DDPO end to end, offline: ``python -m flows.ddpo`` fine-tunes the tiny Stable-Diffusion-style pipeline on
JPEG compressibility and logs the reward curve, sample images and the trained weights to MLflow.

MLflow's store is ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db`` in the current directory. About
1-2 minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import flows  # noqa: E402,F401  (environment defaults)
import mlflow  # noqa: E402
from prefect import flow, task  # noqa: E402

from rlhf_core.ddpo.pipeline import (  # noqa: E402
    ANIMAL_PROMPTS,
    DefaultDDPOStableDiffusionPipeline,
    tiny_stable_diffusion_pipeline,
)
from rlhf_core.ddpo.rewards import image_grid, jpeg_compressibility, jpeg_incompressibility  # noqa: E402
from rlhf_core.ddpo.config import DDPOConfig  # noqa: E402
from rlhf_core.ddpo.trainer import DDPOTrainer  # noqa: E402

REWARDS = {"compressibility": jpeg_compressibility, "incompressibility": jpeg_incompressibility}
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def log_samples_to_mlflow(prompt_image_data, global_step, tracker) -> None:
    """``image_samples_hook``: one image grid per epoch, captioned by its prompts and rewards."""
    images, prompts, _, rewards, _ = prompt_image_data[0]
    mlflow.log_image(image_grid(images, columns=4), f"samples/step_{global_step:05d}.png")
    captions = {"prompt": list(prompts), "reward": [float(r) for r in rewards]}
    mlflow.log_table(captions, artifact_file=f"samples/step_{global_step:05d}.json")


@task(name="ddpo-train")
def train_ddpo(reward: str, epochs: int, image_steps: int, batch_size: int, learning_rate: float, seed: int,
               use_lora: bool) -> dict:
    """Train on the tiny pipeline inside the active MLflow run; return the reward curve."""
    random.seed(seed)
    pipeline = DefaultDDPOStableDiffusionPipeline(tiny_stable_diffusion_pipeline(seed=seed), use_lora=use_lora)
    with tempfile.TemporaryDirectory() as workdir:
        config = DDPOConfig(
            num_epochs=epochs, seed=seed, mixed_precision="no", log_with="mlflow", logdir=workdir, run_name="ddpo",
            save_freq=epochs, sample_num_steps=image_steps, sample_batch_size=batch_size,
            sample_num_batches_per_epoch=1, sample_guidance_scale=1.0, train_batch_size=4,
            train_learning_rate=learning_rate, train_clip_range=5e-2,
        )
        trainer = DDPOTrainer(config, REWARDS[reward], lambda: (random.choice(ANIMAL_PROMPTS[:4]), {}), pipeline,
                              image_samples_hook=log_samples_to_mlflow)
        trainer.train()
        trainer.save_pretrained(os.path.join(workdir, "model"))
        mlflow.log_artifacts(os.path.join(workdir, "model"), artifact_path="model")
    history = mlflow.MlflowClient().get_metric_history(mlflow.active_run().info.run_id, "reward_mean")
    curve = [m.value for m in sorted(history, key=lambda m: m.step)]
    mlflow.log_dict({"reward_mean": curve}, "reward_curve.json")
    return {"reward_curve": curve}


@flow(name="ddpo", log_prints=False)  # see flows/__init__.py
def ddpo(reward: str = "compressibility", epochs: int = 6, image_steps: int = 5, batch_size: int = 16,
         learning_rate: float = 3e-3, seed: int = 0, use_lora: bool = False) -> dict:
    """Tiny DDPO run logged to MLflow experiment ``ddpo``."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri(DEFAULT_TRACKING_URI)
    mlflow.set_experiment("ddpo")
    with mlflow.start_run(run_name=f"ddpo-{reward}") as run:
        result = train_ddpo(reward, epochs, image_steps, batch_size, learning_rate, seed, use_lora)
        print(f"MLflow run {run.info.run_id}: reward_mean per epoch {[round(r, 4) for r in result['reward_curve']]}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.ddpo", description=__doc__.splitlines()[0])
    parser.add_argument("--reward", choices=sorted(REWARDS), default="compressibility")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters instead of the whole UNet")
    args = parser.parse_args(argv)
    ddpo(reward=args.reward, epochs=args.epochs, use_lora=args.lora)
    return 0


if __name__ == "__main__":
    sys.exit(main())
