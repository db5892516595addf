"""Training plumbing shared by the Trainer-based stages (sft, reward_model, dpo, kto, grpo, rloo): ``TrainingArguments``
from a params section, resumable checkpoints with a graceful stop agreed by every rank, a ``train_loss`` that a resume
does not change, the loss curve for plots, and the one training tail (:func:`train_and_save`).

Importing it imports transformers (the stop callback is a ``TrainerCallback``): the stage bodies import it inside
their body (the stage table imports every body), so a non-training stage (``python -m flows.stage prepare``) starts
without transformers.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf_core.checkpointing import GracefulStop, Preempted, latest_checkpoint
from transformers import TrainerCallback, TrainingArguments

from rlhf_core.trainers.base import GracefulStopCallback
from tasks.process.distributed import any_process, check_replicas_identical, is_main_process
from tasks.process.logs import get_logger, on_terminal, quiet_trainer_output
from tasks.spec.params import as_dict
from tasks.spec.paths import stage_checkpoint_dir
from tasks.spec.stage import StageContext
from tasks.store.outputs import atomic_dir, write_json
from tasks.store.stage_run import StageRun

SAVE_STEPS = 50
"""Trainer-based stages write a resumable checkpoint every this many optimizer steps (and on SIGTERM)."""


def training_arguments(output_dir: str | Path, section: Any, logging_steps: int = 10, config_class: type | None = None,
                       **overrides):
    """``TrainingArguments`` (or ``config_class``, a subclass such as ``SFTConfig``) for a stage: its section's
    Trainer fields, no reporters (metrics reach MLflow through rlhf_core's tracker, the stage run's). Hardware comes
    from the environment / accelerate config, never from params.yaml. No checkpoints unless ``overrides`` ask (see
    ``checkpointing_arguments``); any keyword overrides the defaults here."""
    names = ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "warmup_steps", "weight_decay", "seed")
    kwargs = {n: getattr(section, n) for n in names if hasattr(section, n)}
    kwargs.update(output_dir=str(output_dir), save_strategy="no", report_to=[], logging_steps=logging_steps,
                  disable_tqdm=not on_terminal(), dataloader_num_workers=0, dataloader_pin_memory=False)
    kwargs.update(overrides)
    return (config_class or TrainingArguments)(**kwargs)


def checkpointing_arguments(save_steps: int = SAVE_STEPS) -> dict[str, Any]:
    """``training_arguments`` overrides for a resumable stage: periodic checkpoints, only the latest kept."""
    return {"save_strategy": "steps", "save_steps": save_steps, "save_total_limit": 1}


class AllRanksStopCallback(GracefulStopCallback):
    """``GracefulStopCallback`` whose stop request is all-reduced at every step end: a signal that reached
    any rank stops every rank after the same step (a lone rank leaving would hang the others' DDP collectives).
    One small collective per optimizer step under a launcher; the plain callback in a single process."""

    def on_step_end(self, args, state, control, **kwargs):
        result = super().on_step_end(args, state, control, **kwargs)
        if any_process(self.stopped):
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True
        return result


LOSS_SUM_FILE = "rlhf_loss_sum.json"
"""In each checkpoint of a Trainer-based stage: the sum of the training loss over its optimizer steps so far."""


class LossSumCallback(TrainerCallback):
    """Writes the running sum of the training loss into each checkpoint (``LOSS_SUM_FILE``), so that a resumed stage
    reports the mean over all its steps, as a straight run does. transformers reports ``train_loss`` over the steps of
    one ``train()`` call (5.x: ``_finalize_training`` divides by the steps since the resume): a resumed stage wrote
    another ``train_loss``, and so another model card and hash, for bit-identical weights.

    Reads the Trainer's running sums (``_total_loss_scalar``, drained at each log, and ``_tr_loss``, the steps since):
    private fields, so a Trainer without them leaves the checkpoint without the file and the loss as transformers
    reports it. One host read per checkpoint."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.prior = 0.0
        """The sum over the steps before this ``train()`` call (those of the checkpoint it resumed from)."""

    def total(self, finished: bool = False) -> float | None:
        """The sum over every step so far (None when the Trainer does not keep its sums where 5.x does). Once
        ``train()`` has returned (``finished``) the last steps are in the drained sum already (and ``_tr_loss`` is
        left as it was, so adding it would count them twice)."""
        drained, pending = (getattr(self.trainer, name, None) for name in ("_total_loss_scalar", "_tr_loss"))
        if not isinstance(drained, float) or pending is None:
            return None
        return self.prior + drained + (0.0 if finished else float(pending))

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        total = self.total() if state.is_world_process_zero and folder.is_dir() else None
        if total is not None and math.isfinite(total):
            write_json(folder / LOSS_SUM_FILE, {"loss_sum": total, "global_step": state.global_step})
        return control


def saved_loss_sum(checkpoint: Path | None) -> float | None:
    """The loss sum a checkpoint holds (None: none saved, or not this checkpoint's step)."""
    file = checkpoint / LOSS_SUM_FILE if checkpoint is not None else None
    if file is None or not file.is_file():
        return None
    saved = json.loads(file.read_text())
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return float(saved["loss_sum"]) if saved.get("global_step") == state.get("global_step") else None


class Resumable:
    """What ``resumable_training`` yields: ``.dir`` (the trainer's ``output_dir``), ``.callback`` (add it to the
    trainer's callbacks), ``.train(trainer)`` and ``.done()``.

    ``checkpoints`` is the stage's checkpoint directory (``.checkpoints/<stage>-<hash>``); ``output_dir`` is the
    same on the main process and a private scratch directory on the other ranks of a launch.
    """

    def __init__(self, stage: str, run: StageRun, stop: GracefulStop, checkpoints: Path, output_dir: Path) -> None:
        self.stage, self.run, self.checkpoints = stage, run, checkpoints
        self.dir = output_dir
        self.callback = AllRanksStopCallback(stop)
        self.loss_sum = LossSumCallback()

    def train(self, trainer: Any) -> Any:
        """``trainer.train()`` from the latest complete checkpoint; ``Preempted`` if a signal stopped it early;
        under data parallelism, checks that every rank ended with the same weights."""
        log = get_logger()
        quiet_trainer_output(trainer, self.stage)  # one bar on a terminal, one short log line per progress window
        last = latest_checkpoint(self.checkpoints)
        prior = saved_loss_sum(last)
        if last is not None:
            log.info("%s: resuming from %s", self.stage, last)
            self.run.summary["resumed_from"] = last.name
            if prior is None:
                log.warning("%s: %s holds no loss sum: train_loss will be the mean over the resumed steps only",
                            self.stage, last.name)
        self.loss_sum.trainer, self.loss_sum.prior = trainer, prior or 0.0
        trainer.add_callback(self.loss_sum)
        result = trainer.train(resume_from_checkpoint=str(last) if last is not None else None)
        if prior is not None:
            result = self._whole_run_loss(trainer, result)
        if self.callback.stopped and trainer.state.global_step < trainer.state.max_steps:
            step = trainer.state.global_step
            log.warning("%s: stopped at step %d; checkpoint in %s; run the stage again to resume",
                        self.stage, step, self.checkpoints)
            raise Preempted(self.checkpoints, step, self.callback.stop.signal_name if self.callback.stop else None)
        check_replicas_identical(trainer.accelerator, trainer.model, self.stage)  # launched (DDP): all ranks agree
        return result

    def _whole_run_loss(self, trainer: Any, result: Any) -> Any:
        """``result`` with ``training_loss`` (and ``metrics["train_loss"]``) the mean over every optimizer step of
        the stage, the steps before the resume included: what a straight run reports."""
        total = self.loss_sum.total(finished=True)
        if total is None or not trainer.state.global_step:
            return result
        loss = total / trainer.state.global_step
        return result._replace(training_loss=loss, metrics={**result.metrics, "train_loss": loss})

    def done(self) -> None:
        """Delete the checkpoints once the stage's outputs are written (main process only)."""
        if is_main_process():
            shutil.rmtree(self.checkpoints, ignore_errors=True)


@contextlib.contextmanager
def resumable_training(stage: str, run: StageRun, params_section: Any) -> Iterator[Resumable]:
    """Resume and stop plumbing shared by the Trainer-based stages (sft, reward_model, dpo).

    Yields a ``Resumable``: ``.dir`` (the trainer's ``output_dir``: ``.checkpoints/<stage>-<hash of params and
    inputs>``), ``.callback`` (add to the trainer's callbacks) and ``.train(trainer)``, which resumes from the
    latest complete checkpoint, raises ``Preempted`` (exit status 75) when SIGTERM/SIGINT stopped it, and under
    data parallelism checks that every rank ended with the same weights. The
    caller deletes the directory (``.done()``, main process only) once its outputs are written.

    Under a launcher the stop request is agreed by all ranks (``AllRanksStopCallback``), every rank resumes from
    the checkpoint in ``.checkpoints/``, and only rank 0 writes there: the other ranks' ``output_dir`` is a private
    scratch directory outside the project (deleted at the end), so transformers' per-rank ``rng_state_<rank>.pth``
    of ranks > 0 is not kept and a resumed multi-process run is not bit-exact on those ranks (their RNG streams
    restart from the seed; rank 0's, the weights, the optimizer, the scheduler and the data position are exact).
    """
    checkpoints = stage_checkpoint_dir(run.root, stage, resume_key(run, params_section))
    with contextlib.ExitStack() as stack:
        stop = stack.enter_context(GracefulStop())
        if is_main_process():
            output_dir = checkpoints
        else:  # transformers would write this rank's RNG state into rank 0's checkpoint
            output_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"rlhf-{stage}-rank-")))
        yield Resumable(stage, run, stop, checkpoints, output_dir)


@dataclass
class Trained:
    """What :func:`train_and_save` leaves: the trainer, ``train()``'s result, the metrics its model card holds, and
    ``finish`` (the ``StageResult``'s: it removes the resumable state once the wrapper has written every output)."""

    trainer: Any
    result: Any
    card_metrics: dict[str, Any]
    finish: Callable[[], None]


def train_and_save(ctx: StageContext, build: Callable[[Resumable], Any], card: tuple[str, str],
                   card_metrics: Callable[[Any, Any], dict[str, Any]], tokenizer: Any = None) -> Trained:
    """The training tail of every Trainer-based stage (sft, reward_model, dpo, kto, grpo, rloo), in one place: the
    trainer ``build(ck)`` makes (``ck.callback`` among its callbacks, ``ck.dir`` its ``output_dir``) trains resumably
    (SIGTERM -> ``Preempted``, exit 75), then ``models/<stage>`` gets the model, the tokenizer (``tokenizer``, else the
    trainer's ``processing_class``) and the model card (``card``: trainer name and base; ``card_metrics(trainer,
    result)``), atomically. The resumable state stays until the stage's outputs are recorded: ``finish``."""
    with resumable_training(ctx.stage.name, ctx.run, ctx.section) as ck, atomic_dir(ctx.out("model")) as out:
        trainer = build(ck)
        result = ck.train(trainer)
        metrics = card_metrics(trainer, result)
        trainer.save_model(str(out))
        (tokenizer or trainer.processing_class).save_pretrained(str(out))
        ctx.run.write_model_card(out, card[0], card[1], as_dict(ctx.section), metrics)
    return Trained(trainer, result, metrics, finish=ck.done)


def resume_key(run: StageRun, params_section: Any) -> dict[str, Any]:
    """What a stage's resumable state is keyed by: its section, the params it reads elsewhere (``run.reads``: a
    changed ``evaluate.seed`` must not resume ppo's sample windows scored with the old one) and its inputs' hashes."""
    key = {"params": as_dict(params_section), "inputs": run.input_hashes}
    if run.reads:  # only then: the keys (and so the state directories) of the other stages stay as they were
        key["reads"] = dict(run.reads)
    return key


def loss_curve(log_history: list[dict], keys: Iterable[str] = ("loss",)) -> list[dict]:
    """Rows ``{step, <key>...}`` from a Trainer's ``state.log_history`` (for plots/<stage>.csv)."""
    keys = tuple(keys)
    return [{"step": e["step"], **{k: e[k] for k in keys if k in e}} for e in log_history if "step" in e and keys[0] in e]


__all__ = ["AllRanksStopCallback", "Resumable", "SAVE_STEPS", "Trained", "checkpointing_arguments", "loss_curve",
           "resumable_training", "resume_key", "train_and_save", "training_arguments"]
