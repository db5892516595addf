"""Exact resume for ``PPOTrainer``: what ``save_state`` writes, what ``load_state`` restores, and the dataloader
position that goes with them.

A checkpoint is a directory (written atomically by ``rlhf_core.checkpointing``): policy + value head
(``model.safetensors``), optimizer and scheduler (``torch.save``, read back with ``weights_only=True``), the fp32
master weights under ``bf16_weights``, RNG states, and ``trainer_state.json`` (step, KL controller, running score
moments, dataloader position, config, and the caller's ``extra``).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from rlhf_core import checkpointing as ckpt

MASTER_WEIGHTS_FILE = "master_weights.pt"  # written only with PPOConfig(bf16_weights=True)

# Config fields that may differ on resume without making the run inexact.
_COSMETIC_FIELDS = {"exp_name", "log_with", "tracker_project_name", "tracker_kwargs", "project_kwargs"}


class EpochAwareLoader(ckpt.PositionTrackingLoader):
    """The trainer's dataloader: its position is checkpointed, and iterating it again starts a fresh epoch.

    As with a plain shuffled ``DataLoader`` in classic TRL, breaking out of a loop over it and looping again
    begins the next epoch (a new shuffle). The one exception is the first loop after ``load_state_dict``,
    which continues the saved epoch where it stopped (exact resume).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resume_pending = False

    def __iter__(self):
        if self.consumed and not self._resume_pending:
            self.epoch, self.consumed = self.epoch + 1, 0  # a new loop after a break: next epoch
        self._resume_pending = False
        yield from super().__iter__()

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        self._resume_pending = True


def track_data_position(loader, batch_size: int):
    """Wrap a prepared dataloader over a ``ResumableRandomSampler`` so its position can be checkpointed."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if isinstance(sampler, ckpt.ResumableRandomSampler):
        return EpochAwareLoader(loader, sampler, batch_size)
    return loader


def _jsonable_config(config) -> dict[str, Any]:
    return json.loads(json.dumps(config.to_dict(), default=str))


def trainer_state(trainer, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON part of a checkpoint (``trainer_state.json``)."""
    loader = trainer.dataloader
    return {
        "format": ckpt.CHECKPOINT_FORMAT, "kind": "ppo", "step": trainer.current_step,
        "kl_ctl": {"class": type(trainer.kl_ctl).__name__, **trainer.kl_ctl.state_dict()},
        "running": trainer.running.state_dict(), "nonfinite_in_a_row": trainer.guard.in_a_row,
        "accelerator_step": int(getattr(trainer.accelerator, "step", 0)),
        "data": loader.state_dict() if isinstance(loader, ckpt.PositionTrackingLoader) else None,
        "config": _jsonable_config(trainer.config), "extra": extra or {},
    }


def save_state(trainer, path: str, extra: dict[str, Any] | None = None) -> None:
    """Write everything ``trainer`` needs to continue exactly, atomically, into the directory ``path``."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = trainer_state(trainer, extra)
        with ckpt.atomic_directory(path) as tmp:
            ckpt.save_module_weights(accelerator.unwrap_model(trainer.model), tmp / "model.safetensors")
            ckpt.save_torch(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
            if trainer._master is not None:  # bf16_weights: the fp32 weights the bf16 ones are rounded from
                ckpt.save_torch(trainer._master.state_dict(), tmp / MASTER_WEIGHTS_FILE)
            if trainer.lr_scheduler is not None:
                ckpt.save_torch(trainer.lr_scheduler.state_dict(), tmp / "scheduler.pt")
            ckpt.save_torch(ckpt.capture_rng_state(), tmp / "rng_state.pt")
            ckpt.write_json(tmp / ckpt.STATE_FILE, state)
    accelerator.wait_for_everyone()


def _check_compatible(trainer, path, state: dict[str, Any]) -> dict[str, Any]:
    """Raise on a checkpoint this trainer cannot load; warn on config changes; return the KL controller state."""
    if state.get("kind") != "ppo" or state.get("format") != ckpt.CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a PPOTrainer checkpoint (kind={state.get('kind')!r}, format={state.get('format')!r})")
    kl_state = dict(state["kl_ctl"])
    if kl_state.pop("class") != type(trainer.kl_ctl).__name__:
        raise ValueError(f"{path}: checkpoint KL controller differs from this trainer's ({type(trainer.kl_ctl).__name__}); "
                         "build the trainer with the same adap_kl_ctrl")
    changed = sorted(k for k, v in _jsonable_config(trainer.config).items()
                     if k in state["config"] and k not in _COSMETIC_FIELDS and state["config"][k] != v)
    if changed:
        warnings.warn(f"resuming {path} with a different PPOConfig ({', '.join(changed)}): the run is not exact",
                      stacklevel=3)
    if (trainer.lr_scheduler is None) != (not (path / "scheduler.pt").exists()):
        raise ValueError(f"{path}: the checkpoint and this trainer disagree on having an lr_scheduler")
    if (trainer._master is None) != (not (path / MASTER_WEIGHTS_FILE).exists()):
        raise ValueError(f"{path}: the checkpoint and this trainer disagree on PPOConfig.bf16_weights "
                         "(fp32 master weights); build the trainer with the checkpoint's setting")
    return kl_state


def load_state(trainer, path: str) -> dict[str, Any]:
    """Restore a ``save_state`` checkpoint into ``trainer`` (built with the same arguments); returns ``extra``."""
    path = ckpt.checkpoint_dir(path)
    state = ckpt.read_json(path / ckpt.STATE_FILE)
    kl_state = _check_compatible(trainer, path, state)
    accelerator = trainer.accelerator
    ckpt.load_module_weights(accelerator.unwrap_model(trainer.model), path / "model.safetensors")
    if trainer._master is not None:
        trainer._master.load_state_dict(ckpt.load_torch(path / MASTER_WEIGHTS_FILE))
    trainer.optimizer.load_state_dict(ckpt.load_torch(path / "optimizer.pt"))
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(ckpt.load_torch(path / "scheduler.pt"))
    trainer.kl_ctl.load_state_dict(kl_state)
    trainer.running.load_state_dict(state["running"])
    trainer.current_step, trainer.guard.in_a_row = int(state["step"]), int(state["nonfinite_in_a_row"])
    if hasattr(accelerator, "step"):
        accelerator.step = int(state["accelerator_step"])
    if state["data"] is not None and isinstance(trainer.dataloader, ckpt.PositionTrackingLoader):
        trainer.dataloader.load_state_dict(state["data"])
    elif state["data"] is not None:
        warnings.warn(f"{path} holds a dataloader position but this trainer has no dataset", stacklevel=3)
    ckpt.restore_rng_state(ckpt.load_torch(path / "rng_state.pt"))
    return state["extra"]
