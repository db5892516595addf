"""Stage ``ddpo``: DDPO fine-tuning of a tiny Stable-Diffusion-shaped pipeline on a JPEG reward (offline).

Image diffusion, separate from the text pipeline: it reads no other stage's outputs (the pipeline is built
from configs, randomly initialised) and is off unless ``ddpo.enabled`` is true: disabled, the stage (run by the
pipeline flow like every stage, so DVC records it) writes placeholder outputs in a blink; enabled,
``python -m flows.stage ddpo`` or ``dvc repro ddpo`` also runs it on its own. Hyper-parameters come from
``params.yaml:ddpo`` (``DDPOConfig`` keys + ``DDPOStageParams``). Writes ``models/ddpo`` (the trained pipeline, or its
LoRA weights); the wrapper writes ``metrics/ddpo.json`` and ``plots/ddpo.csv`` (reward per epoch); MLflow gets the
params, the step metrics and one sample grid per epoch through the stage run.

The one place the pipeline names DDPO's library modules (``rlhf_core.ddpo.pipeline``,
``rlhf_core.ddpo.rewards``): ``_library`` below.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tasks.process.logs import get_logger
from tasks.store.outputs import atomic_dir
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import ConfigSection
from tasks.spec.stage import StageContext, StageResult

DDPO_CONFIG_KEYS = (
    "num_epochs", "sample_num_steps", "sample_batch_size", "sample_num_batches_per_epoch", "sample_guidance_scale",
    "train_batch_size", "train_learning_rate", "train_clip_range", "seed",
)
"""The ``DDPOConfig`` fields the ddpo section sets, in params.yaml's order (types and docs: ``DDPOConfig``)."""

DDPO_REWARDS = ("compressibility", "incompressibility")

ANIMALS = 24
"""How many animal prompts ``rlhf_core.ddpo.pipeline.ANIMAL_PROMPTS`` holds (``ddpo.num_prompts`` at most)."""


@dataclass(frozen=True)
class DDPOStageParams:
    """The ddpo section's keys that are not ``DDPOConfig`` fields."""

    enabled: bool
    """Run ddpo in the default pipeline flow (``make run``) after evaluate; off: only when asked for by name."""
    reward: str
    """``compressibility`` or ``incompressibility`` (JPEG size of the generated images)."""
    use_lora: bool
    """Train LoRA adapters instead of the whole UNet."""
    num_prompts: int
    """Prompts are drawn from the first this many animal names."""


@dataclass(frozen=True)
class DDPOParams(ConfigSection, config="DDPOConfig", keys=DDPO_CONFIG_KEYS, stage=DDPOStageParams):
    """DDPO on a tiny Stable-Diffusion-shaped pipeline built from configs: ``DDPOConfig`` keys + ``DDPOStageParams``."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("sample_num_steps", "sample_batch_size", "sample_num_batches_per_epoch", "train_batch_size"),
        positive_floats=("train_learning_rate", "train_clip_range"),
        at_least_one_floats=("sample_guidance_scale",))
    """Value rules of the section (tasks/spec/param_rules.py applies them); a guidance scale below 1
    is not classifier-free guidance (DDPOConfig refuses it)."""

    def problems(self, name: str) -> list[str]:
        """A reward the stage knows, prompts that exist, at least one epoch."""
        return [message for broken, message in (
            (self.reward not in DDPO_REWARDS, f"{name}.reward must be one of {DDPO_REWARDS}"),
            (not 1 <= self.num_prompts <= ANIMALS, f"{name}.num_prompts must be in [1, {ANIMALS}] (the animal prompts)"),
            (self.num_epochs < 1, f"{name}.num_epochs must be >= 1"),
        ) if broken]


FIXED = {"mixed_precision": "no"}
"""DDPOConfig values that are not parameters: hardware (precision) is chosen outside params.yaml."""

COLUMNS = ("epoch", "step", "reward_mean", "reward_std")
"""plots/ddpo.csv: one row per epoch, the reward over all its samples."""
PLOT = dict(x="epoch", y="reward_mean")
"""DVC's options of ``plots/ddpo.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def _library() -> dict[str, Any]:
    """DDPO's library pieces (imported lazily: diffusers is an optional extra)."""
    from rlhf_core import DDPOConfig, DDPOTrainer, DefaultDDPOStableDiffusionPipeline  # diffusers is an optional extra: only when ddpo runs
    from rlhf_core.ddpo.pipeline import ANIMAL_PROMPTS, tiny_stable_diffusion_pipeline
    from rlhf_core.ddpo.rewards import image_grid, jpeg_compressibility, jpeg_incompressibility

    return {"DDPOConfig": DDPOConfig, "DDPOTrainer": DDPOTrainer, "pipeline": DefaultDDPOStableDiffusionPipeline,
            "tiny": tiny_stable_diffusion_pipeline, "prompts": ANIMAL_PROMPTS, "image_grid": image_grid,
            "rewards": {"compressibility": jpeg_compressibility, "incompressibility": jpeg_incompressibility}}


class EpochRecorder:
    """``image_samples_hook``: one row per epoch (reward mean/std over all samples) and a sample grid to MLflow."""

    def __init__(self, run: Any, image_grid: Any, workdir: Path) -> None:
        self.run, self.image_grid, self.workdir = run, image_grid, workdir
        self.rows: list[dict[str, float]] = []

    def __call__(self, prompt_image_data: list, global_step: int, tracker: Any) -> None:
        rewards = [float(r) for batch in prompt_image_data for r in batch[3]]
        self.rows.append({"epoch": len(self.rows), "step": global_step, "reward_mean": statistics.fmean(rewards),
                          "reward_std": statistics.pstdev(rewards)})
        images, prompts = prompt_image_data[0][0], prompt_image_data[0][1]
        grid = self.workdir / f"step_{global_step:05d}.png"
        self.image_grid(images, columns=4).save(grid)
        self.run.log_artifact(grid, artifact_path="samples")
        self.run.log_table(f"samples_step_{global_step:05d}",
                           [{"prompt": p, "reward": float(r)} for p, r in zip(prompts, prompt_image_data[0][3])])


def ddpo_config(p: DDPOParams, workdir: Path, library: dict[str, Any]):
    """``DDPOConfig`` from the ddpo section's DDPOConfig keys; checkpoints only at the end, in ``workdir``."""
    return library["DDPOConfig"](**p.config, **FIXED, logdir=str(workdir), run_name="ddpo",
                                 save_freq=p.num_epochs, tracker_project_name="rlhf-pipeline")


def body(ctx: StageContext) -> StageResult:
    """Train ``models/ddpo``."""
    p, run, library = ctx.section, ctx.run, _library()
    with tempfile.TemporaryDirectory(prefix="rlhf-ddpo-") as scratch:
        workdir = Path(scratch)
        random.seed(p.seed)
        prompts = library["prompts"][: p.num_prompts]
        pipeline = library["pipeline"](library["tiny"](seed=p.seed), use_lora=p.use_lora)
        recorder = EpochRecorder(run, library["image_grid"], workdir)
        trainer = library["DDPOTrainer"](ddpo_config(p, workdir, library), library["rewards"][p.reward],
                                         lambda: (random.choice(prompts), {}), pipeline, image_samples_hook=recorder,
                                         tracker=run.tracker)
        trainer.train()
        with atomic_dir(ctx.out("model")) as out:
            trainer.save_pretrained(str(out))
    curve = [row["reward_mean"] for row in recorder.rows]
    metrics = {"reward_first": curve[0], "reward_last": curve[-1], "reward_gain": curve[-1] - curve[0],
               "epochs": len(curve)}
    get_logger().info("ddpo: reward_mean per epoch %s", [round(r, 4) for r in curve])
    return StageResult(metrics, recorder.rows)
