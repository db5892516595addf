"""Stage ``ddpo``: DDPO fine-tuning of a tiny Stable-Diffusion-shaped pipeline on a JPEG reward (offline).

Image diffusion, separate from the text pipeline: it reads no other stage's outputs (the pipeline is built
from configs, randomly initialised) and is off unless ``ddpo.enabled`` is true: disabled, the stage (run by the
pipeline flow like every stage, so DVC records it) writes placeholder outputs in a blink (``tasks/policy.py``);
enabled, ``python -m flows.stage ddpo`` or ``dvc repro ddpo`` also runs it on its own. Hyper-parameters come from
``params.yaml:ddpo`` (``DDPOConfig`` keys + ``DDPOStageParams``). Writes ``models/ddpo`` (the trained
pipeline, or its LoRA weights), ``metrics/ddpo.json`` and ``plots/ddpo.csv`` (reward per epoch); MLflow gets
the params, the step metrics and one sample grid per epoch through the stage run.

The one place the pipeline names DDPO's library modules (``rlhf_core.ddpo.pipeline``,
``rlhf_core.ddpo.rewards``): ``_library`` below.
"""

from __future__ import annotations

import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.distributed import require_single_process
from tasks.logs import get_logger
from tasks.outputs import atomic_dir, write_csv, write_json
from tasks.params import DDPOParams, load_stage
from tasks.stage_run import StageRun, stage_run

FIXED = {"mixed_precision": "no"}
"""DDPOConfig values that are not parameters: hardware (precision) is chosen outside params.yaml."""


def _library() -> dict[str, Any]:
    """DDPO's library pieces (imported lazily: diffusers is an optional extra)."""
    from rlhf_core import DDPOConfig, DDPOTrainer, DefaultDDPOStableDiffusionPipeline
    from rlhf_core.ddpo.pipeline import ANIMAL_PROMPTS, tiny_stable_diffusion_pipeline
    from rlhf_core.ddpo.rewards import image_grid, jpeg_compressibility, jpeg_incompressibility

    return {"DDPOConfig": DDPOConfig, "DDPOTrainer": DDPOTrainer, "pipeline": DefaultDDPOStableDiffusionPipeline,
            "tiny": tiny_stable_diffusion_pipeline, "prompts": ANIMAL_PROMPTS, "image_grid": image_grid,
            "rewards": {"compressibility": jpeg_compressibility, "incompressibility": jpeg_incompressibility}}


class EpochRecorder:
    """``image_samples_hook``: one row per epoch (reward mean/std over all samples) and a sample grid to MLflow."""

    def __init__(self, run: StageRun, image_grid: Any, workdir: Path) -> None:
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


@task(name="ddpo", cache_policy=NO_CACHE)  # training: no retries
def ddpo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/ddpo``; returns the metrics written to metrics/ddpo.json."""
    from tasks.policy import disabled_placeholder

    if (skipped := disabled_placeholder(root, "ddpo", ("epoch", "step", "reward_mean", "reward_std"))) is not None:
        return skipped  # ddpo.enabled: false
    require_single_process("ddpo")
    root, params, p, io = load_stage(root, "ddpo")
    paths = params.paths
    library = _library()
    log = get_logger()
    with stage_run("ddpo", root, p, io["deps"], parent_run_id) as run, \
            tempfile.TemporaryDirectory(prefix="rlhf-ddpo-") as scratch:
        workdir = Path(scratch)
        random.seed(p.seed)
        prompts = library["prompts"][: p.num_prompts]
        pipeline = library["pipeline"](library["tiny"](seed=p.seed), use_lora=p.use_lora)
        recorder = EpochRecorder(run, library["image_grid"], workdir)
        trainer = library["DDPOTrainer"](ddpo_config(p, workdir, library), library["rewards"][p.reward],
                                         lambda: (random.choice(prompts), {}), pipeline, image_samples_hook=recorder,
                                         tracker=run.tracker)
        trainer.train()
        with atomic_dir(root / paths.models / "ddpo") as out:
            trainer.save_pretrained(str(out))
        curve = [row["reward_mean"] for row in recorder.rows]
        metrics = {"reward_first": curve[0], "reward_last": curve[-1], "reward_gain": curve[-1] - curve[0],
                   "epochs": len(curve)}
        write_json(root / paths.metrics / "ddpo.json", metrics)
        write_csv(root / paths.plots / "ddpo.csv", recorder.rows)
        run.log_metrics({f"final_{k}": v for k, v in metrics.items()})
        run.summary.update(metrics)
        log.info("ddpo: reward_mean per epoch %s", [round(r, 4) for r in curve])
    return metrics
