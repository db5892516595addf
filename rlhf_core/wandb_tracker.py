"""``log_with="wandb"``: a tracker on Weights & Biases, imported lazily (``pip install wandb``; not in the lock).

Offline by default where no network is expected: unless ``WANDB_MODE`` is set, the run is ``offline`` when
``HF_HUB_OFFLINE``/``WANDB_OFFLINE`` is set or no ``WANDB_API_KEY`` is configured (``wandb sync`` uploads it
later); nothing here waits on a server.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlhf_core.tracking import Tracker, image_array, public_params, scalar_metrics


def wandb_mode() -> str:
    """``WANDB_MODE`` if set; else ``offline`` when no network or no credentials are expected, else ``online``."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    offline = any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_HUB_OFFLINE", "WANDB_OFFLINE"))
    return "offline" if offline or not os.environ.get("WANDB_API_KEY") else "online"


class WandbTracker(Tracker):
    """Logs scalars, tables and params to a wandb run in project ``project_name``."""

    name = "wandb"

    def __init__(self, project_name: str = "trl", logging_dir: str | None = None, **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("log_with='wandb' needs the wandb package (pip install wandb); it is not part of "
                              "requirements.lock") from err
        self._wandb = wandb
        init_kwargs.setdefault("mode", wandb_mode())
        if logging_dir is not None:
            init_kwargs.setdefault("dir", logging_dir)
        self._run = wandb.init(project=project_name, **init_kwargs)

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        self._run.log(scalar_metrics(metrics), step=step)

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int | None = None) -> None:
        self._run.log({name: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._run.log({name: self._wandb.Image(image_array(v)) for name, v in values.items()}, step=step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._run.config.update(public_params(params), allow_val_change=True)

    def finish(self) -> None:
        self._run.finish()
