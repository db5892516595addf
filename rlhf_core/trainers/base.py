"""The base of the `transformers.Trainer` subclasses (SFT, reward, DPO): `RlhfTrainerMixin` and its glue.

- the spec's ``tokenizer=`` argument, which transformers 5 calls ``processing_class``;
- loading a model given as a name or path, and wrapping it with PEFT;
- forwarding every ``Trainer.log`` call to an rlhf_core tracker (``log_with``), without double logging;
- a model card (``README.md``) beside every safetensors checkpoint.
- reliability: checkpoints written atomically (``rlhf_core.checkpointing``) with transformers' own contents
  but no pickled ``training_args.bin`` (JSON instead); ``save_state``/``load_state`` for exact resume; a
  guard that skips optimizer steps with non-finite gradients; a callback that saves and stops on SIGTERM.

Trainers never import MLflow here: the tracker object from ``rlhf_core.tracking`` does.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, TypedDict

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from rlhf_core import checkpointing as ckpt
from rlhf_core.cpu_allocator import keep_freed_cpu_memory
from rlhf_core.model_card import write_model_card
from rlhf_core.models.peft_support import is_peft_model
from rlhf_core.tracking import Tracker, make_tracker
from rlhf_core.models.padding import ensure_pad_token

logger = logging.getLogger(__name__)

# Trainer arguments whose value goes to the tracker's params and the model card.
ARGS_FOR_CARD = (
    "learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs",
    "max_steps", "lr_scheduler_type", "warmup_steps", "weight_decay", "seed",
)

# Trainer arguments that describe where and how this process ran, not what was trained: left out of the
# ``training_args.json`` saved beside the weights, so the same training saved from another directory, terminal
# or launcher rank gives the same bytes (a DVC-tracked model directory keeps its hash).
RUN_ENVIRONMENT_ARGS = ("output_dir", "logging_dir", "resume_from_checkpoint", "disable_tqdm", "local_rank")
# transformers 4 options a config accepts and maps onto today's (map_warmup_ratio): what they set is in the mapped
# field, so they are left out of ``training_args.json`` too (its bytes stay those of a config without them)
LEGACY_ARGS = ("warmup_ratio",)


def portable_training_args(args: TrainingArguments) -> dict[str, Any]:
    """``args.to_dict()`` without ``RUN_ENVIRONMENT_ARGS`` (scratch paths, progress display, process index) and the
    mapped ``LEGACY_ARGS``."""
    dropped = RUN_ENVIRONMENT_ARGS + LEGACY_ARGS
    return {key: value for key, value in args.to_dict().items() if key not in dropped}


def map_warmup_ratio(args: TrainingArguments) -> None:
    """transformers 4's ``warmup_ratio`` (gone from transformers 5, where a ``warmup_steps`` below 1 is that share):
    copied into ``warmup_steps`` with a FutureWarning; call it before ``TrainingArguments.__post_init__``."""
    ratio = getattr(args, "warmup_ratio", None)
    if ratio is None:
        return
    name = type(args).__name__
    if not 0 <= ratio < 1:
        raise ValueError(f"{name}.warmup_ratio={ratio}: a share of the training steps, in [0, 1)")
    if args.warmup_steps:
        raise ValueError(f"{name}: warmup_ratio={ratio} and warmup_steps={args.warmup_steps} are one option in "
                         "transformers 5 (warmup_steps below 1 is a share); set warmup_steps only")
    warnings.warn(f"{name}.warmup_ratio is transformers 4's option; mapped to warmup_steps={ratio} (transformers 5 "
                  "reads a warmup_steps below 1 as the share of steps): write warmup_steps", FutureWarning,
                  stacklevel=4)
    args.warmup_steps = ratio


def resolve_bf16(args: TrainingArguments) -> None:
    """``bf16=None`` (the default of every config here) becomes True on a CUDA GPU with bf16 support, unless
    ``fp16`` or ``use_cpu`` is set, and False elsewhere; call it before ``TrainingArguments.__post_init__``.

    bf16 here is accelerate's autocast: the weights stay fp32 (the optimizer's master copies), the matmuls run in
    bf16. On a CPU bf16 autocast is slow and changes results, so a CPU run stays fp32 and unchanged.
    """
    if args.bf16 is None:
        args.bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()
                         and not args.fp16 and not args.use_cpu)


def resolve_processing_class(tokenizer: Any = None, processing_class: Any = None) -> Any:
    """Accept the spec's ``tokenizer=`` as transformers 5's ``processing_class=`` (not both, unless equal)."""
    if tokenizer is not None and processing_class is not None and tokenizer is not processing_class:
        raise ValueError("pass either tokenizer= (spec name) or processing_class= (transformers 5 name), not both")
    return processing_class if processing_class is not None else tokenizer


def default_training_args(
    args: TrainingArguments | None, trainer_name: str, config_class: type = TrainingArguments
) -> TrainingArguments:
    """The user's arguments, or small defaults of ``config_class`` that report nowhere (``output_dir=tmp_<trainer>``)."""
    if args is not None:
        return args
    return config_class(output_dir=f"tmp_{trainer_name}", report_to=[])


def keyword_defaults(function: Callable, names: Sequence[str]) -> dict[str, Any]:
    """Default value of each named keyword parameter of ``function``."""
    parameters = inspect.signature(function).parameters
    return {name: parameters[name].default for name in names}


def merge_config_fields(
    args: Any, config_class: type, keywords: Mapping[str, Any], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The value of each trainer option, from a keyword or from a TRL 0.11 config (``SFTConfig``, ``DPOConfig``...).

    A keyword left at its default takes the field of the same name when ``args`` is a ``config_class``; a
    keyword given explicitly wins (as in TRL 0.11) and a warning names both values when the config disagrees.
    """
    merged = dict(keywords)
    if not isinstance(args, config_class):
        return merged
    for name, value in keywords.items():
        if not hasattr(args, name):
            continue
        from_config = getattr(args, name)
        if value == defaults[name]:
            merged[name] = from_config
        elif from_config != value and from_config != defaults[name]:
            warnings.warn(
                f"{name}={value!r} passed to the trainer overrides {config_class.__name__}.{name}={from_config!r}",
                UserWarning, stacklevel=3,
            )
    return merged


def checked_init_kwargs(
    init_kwargs: Mapping[str, Any] | None, config_name: str, field_name: str = "model_init_kwargs"
) -> dict[str, Any] | None:
    """``init_kwargs`` with its ``torch_dtype`` as a ``torch.dtype`` (a dtype name such as "float16" is
    converted, "auto" passes); any other value is a ``ValueError`` worded as TRL 0.11's, naming the field."""
    if init_kwargs is None or init_kwargs.get("torch_dtype") is None:
        return None if init_kwargs is None else dict(init_kwargs)
    dtype = init_kwargs["torch_dtype"]
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        dtype = getattr(torch, dtype)  # "float16" -> torch.float16
    if dtype != "auto" and not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"Invalid `torch_dtype` passed to the {config_name}. Expected a string with either `torch.dtype` or "
            f"'auto', but got {dtype}. ({config_name}.{field_name}['torch_dtype'])"
        )
    return {**init_kwargs, "torch_dtype": dtype}


def load_model(model: Any, auto_class: type, init_kwargs: Mapping[str, Any] | None = None) -> Any:
    """A model given as a name or local path is loaded with ``auto_class.from_pretrained``; modules pass through."""
    if isinstance(model, (str, Path)):
        return auto_class.from_pretrained(str(model), **dict(init_kwargs or {}))
    if init_kwargs:
        raise ValueError("model_init_kwargs only apply when model is a name or path, not an instantiated model")
    return model


class TrackingOptions(TypedDict, total=False):
    """The keyword arguments the Trainer-based trainers take beyond TRL's (``**tracking``): where their logs go."""

    log_with: str | Tracker | None
    """``"mlflow"``, ``"tensorboard"``, ``"memory"``, ``"wandb"`` or a ready ``Tracker``; None: ``report_to`` only."""
    tracker_project_name: str
    """The tracker's project / experiment name (default ``"trl"``)."""
    tracker_kwargs: Mapping[str, Any] | None
    """Keyword arguments for the tracker named by ``log_with``."""
    tracker: Tracker | None
    """A ready tracker (the pipeline's stage run passes its own)."""


def check_tracking(trainer: str, tracking: Mapping[str, Any]) -> dict[str, Any]:
    """``tracking`` as given, after refusing a key that is no ``TrackingOptions`` (before anything is loaded)."""
    unknown = sorted(set(tracking) - set(TrackingOptions.__annotations__))
    if unknown:
        raise TypeError(f"{trainer}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}")
    return dict(tracking)


def load_tokenizer_for(model: Any, tokenizer: Any) -> Any:
    """The given tokenizer, or the one saved beside the model (given as a name/path, or loaded from one:
    ``config._name_or_path``, as TRL 0.11 does); pad = EOS if missing."""
    if tokenizer is not None:
        return tokenizer
    source = model if isinstance(model, (str, Path)) else getattr(getattr(model, "config", None), "_name_or_path", "")
    if not source:  # a model built from a config: nothing to load a tokenizer from
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    ensure_pad_token(tokenizer)
    return tokenizer


def wrap_peft(model: Any, peft_config: Any) -> Any:
    """Wrap ``model`` with ``peft_config`` (LoRA etc.); no-op without a config."""
    if peft_config is None:
        return model
    if is_peft_model(model):
        raise ValueError("model is already a PeftModel; pass peft_config=None or the un-wrapped base model")
    try:
        from peft import PeftConfig, get_peft_model
    except ImportError as error:  # pragma: no cover - peft is a declared dependency
        raise ImportError("peft_config needs the `peft` package") from error
    if not isinstance(peft_config, PeftConfig):
        raise ValueError(f"peft_config must be a peft.PeftConfig, got {type(peft_config).__name__}")
    return get_peft_model(model, peft_config)


def without_eval_strategy(args: TrainingArguments, eval_dataset: Any) -> tuple[TrainingArguments, IntervalStrategy | None]:
    """``(args, None)``, or, when ``args`` asks for evaluations but there is no ``eval_dataset``, a shallow copy of
    ``args`` with evaluation off and the strategy that was asked for (the user's ``args`` is left as it is).

    TRL 0.11's transformers (4.45) accepted that pair and failed only when an evaluation came due (never, when the
    run ends first); transformers 5 refuses it at construction and also evaluates at the end of a ``steps`` run.
    ``RlhfTrainerMixin.train`` refuses the run before its first step when TRL 0.11 would have evaluated in it.
    """
    strategy = IntervalStrategy(args.eval_strategy)
    if eval_dataset is not None or strategy == IntervalStrategy.NO:
        return args, None
    args = copy.copy(args)
    args.eval_strategy = IntervalStrategy.NO
    return args, strategy


def base_model_name(model: Any) -> str | None:
    """The name or path the model was loaded from, if it has one."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    return name or None


class TrackerCallback(TrainerCallback):
    """Sends everything ``Trainer.log`` reports (train and eval) to an rlhf_core ``Tracker``."""

    def __init__(self, tracker: Tracker, params: Mapping[str, Any] | None = None) -> None:
        self.tracker = tracker
        self.params = dict(params or {})
        self._params_logged = False

    def on_train_begin(self, args, state, control, **kwargs):
        """Log the run's parameters once."""
        if state.is_world_process_zero and not self._params_logged and self.params:
            self.tracker.log_params(self.params)
            self._params_logged = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Forward the scalar logs at the current global step."""
        if state.is_world_process_zero and logs:
            self.tracker.log(dict(logs), step=state.global_step)


class NonFiniteGuardCallback(TrainerCallback):
    """Skip an optimizer step whose gradients hold NaN/inf: weights and optimizer state stay unchanged.

    Runs just before ``optimizer.step`` (after clipping): the gradients are dropped (set to ``None``, which
    the optimizer skips), the skip is counted (logged as ``skipped_updates``), and ``max_in_a_row`` skips
    in a row stop the run with a ``RuntimeError``. The learning-rate schedule still advances one step.
    """

    def __init__(self, max_in_a_row: int = 10) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_nonfinite_updates must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.skipped = 0
        self.in_a_row = 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None] if model is not None else []
        if not grads:
            return
        finite = torch.stack([torch.isfinite(g).all() for g in grads]).all()
        if bool(finite):
            self.in_a_row = 0
            return
        for param in model.parameters():
            param.grad = None
        self.skipped += 1
        self.in_a_row += 1
        warnings.warn(f"optimizer step {state.global_step + 1} skipped: non-finite gradients", stacklevel=2)
        if self.in_a_row >= self.max_in_a_row:
            raise RuntimeError(
                f"{self.in_a_row} optimizer steps in a row had non-finite gradients; stopping. Check the data, the "
                "learning rate and the model's numerics (trainer.nonfinite_guard.max_in_a_row sets this limit)."
            )

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.skipped, self.in_a_row = int(state["skipped"]), int(state["in_a_row"])


class GracefulStopCallback(TrainerCallback):
    """On SIGTERM/SIGINT (a ``GracefulStop`` request), save a checkpoint at the next step boundary and stop.

    The checkpoint is the regular one in ``output_dir/checkpoint-<step>`` (atomic); ``stopped`` tells the
    caller to raise ``rlhf_core.checkpointing.Preempted`` (its entry point maps it to an exit status). Resume with
    ``train(resume_from_checkpoint=True)``.
    """

    def __init__(self, stop: ckpt.GracefulStop | None = None) -> None:
        self.stop = stop
        self.stopped = False

    def on_step_end(self, args, state, control, **kwargs):
        requested = self.stop.requested if self.stop is not None else ckpt.stop_requested()
        if requested:
            control.should_save = True
            control.should_training_stop = True
            self.stopped = True



class StoredMetricsMixin:
    """For Trainers whose loss also yields batch metrics (DPO, KTO): ``compute_loss`` stores them with
    ``store_metrics`` and the next ``log`` call adds their means (train or eval) to what it logs.

    The subclass provides ``get_batch_loss_metrics(model, inputs, train_eval) -> (loss, metrics)`` and sets
    ``self._stored_metrics = defaultdict(lambda: defaultdict(list))``; it comes before ``Trainer`` in the bases.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss; its metrics are stored and averaged into the next ``log`` call."""
        loss, metrics = self.get_batch_loss_metrics(model, inputs, train_eval="train")
        self.store_metrics(metrics, train_eval="train")
        return (loss, metrics) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Eval loss, then (unless only the loss is asked for) the batch's implicit rewards and labels as the
        subclass's ``_prediction_outputs(inputs)`` gives them; the metrics are stored like training's."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, metrics = self.get_batch_loss_metrics(model, inputs, train_eval="eval")
        self.store_metrics(metrics, train_eval="eval")
        if prediction_loss_only:
            return loss.detach(), None, None
        return (loss.detach(), *self._prediction_outputs(inputs))

    def store_metrics(self, metrics: Mapping[str, float], train_eval: str = "train") -> None:
        """Keep per-step metrics until the next ``log``."""
        for key, value in metrics.items():
            self._stored_metrics[train_eval][key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the mean of the stored metrics (train or eval) to ``logs``, then log as usual."""
        train_eval = "eval" if any(key.startswith("eval_") for key in logs) else "train"
        for key, values in self._stored_metrics.pop(train_eval, {}).items():
            logs[key] = sum(values) / len(values)
        super().log(logs, start_time)

class RlhfTrainerMixin:
    """Shared behaviour of rlhf_core's Trainer subclasses: tracker wiring and model cards on save.

    Subclasses set ``trainer_name`` and may extend ``card_hyperparameters``.
    """

    trainer_name = "trainer"
    _tag_names: list[str] = ["trl"]
    """Hub tags added to the model (``model.add_model_tags``), TRL 0.11's names: ``trl`` plus the trainer's."""
    max_nonfinite_updates = 10
    """Optimizer steps in a row with non-finite gradients before the run stops (``NonFiniteGuardCallback``)."""

    def _tag_model(self) -> None:
        """Add ``_tag_names`` to the model's hub tags (written into its model card by transformers)."""
        model = getattr(self, "model", None)
        if hasattr(model, "add_model_tags"):
            model.add_model_tags(self._tag_names)

    def _setup_tracking(
        self, log_with: str | Tracker | None = None, tracker_project_name: str = "trl",
        tracker_kwargs: Mapping[str, Any] | None = None, tracker: Tracker | None = None,
    ) -> None:
        """Build the tracker named by ``log_with`` (or take ``tracker``, a ready one) and hook it into the callbacks
        (the ``TrackingOptions`` a trainer was given).

        If transformers' own integration for the same backend is also on (``report_to=["mlflow"]``),
        it is removed so every metric is logged once.
        """
        self.nonfinite_guard = NonFiniteGuardCallback(self.max_nonfinite_updates)
        self.add_callback(self.nonfinite_guard)
        tracker_kwargs = dict(tracker_kwargs or {})
        if log_with == "mlflow":  # an outage spools beside the run's outputs (see rlhf_core.tracking)
            tracker_kwargs.setdefault("spool_dir", str(Path(self.args.output_dir) / "tracking-spool"))
        if tracker is None:
            self.tracker = make_tracker(log_with, project_name=tracker_project_name, **tracker_kwargs)
            if log_with is None:
                return
        else:
            self.tracker = tracker
        backend = self.tracker.name
        if backend in (self.args.report_to or []):
            logger.warning("log_with=%r and report_to=%r: logging through rlhf_core's tracker only", backend, backend)
            for callback in list(self.callback_handler.callbacks):
                if type(callback).__name__.lower().startswith(backend):
                    self.remove_callback(callback)
        self.add_callback(TrackerCallback(self.tracker, params=self.card_hyperparameters()))

    def card_hyperparameters(self) -> dict[str, Any]:
        """Hyper-parameters for the model card and the tracker's params."""
        values = {name: getattr(self.args, name) for name in ARGS_FOR_CARD if hasattr(self.args, name)}
        return {name: value.value if isinstance(value, Enum) else value for name, value in values.items()}

    def card_metrics(self) -> dict[str, float]:
        """The most recent value of every scalar metric logged so far."""
        latest: dict[str, float] = {}
        for entry in getattr(self.state, "log_history", []):
            for key, value in entry.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    latest[key] = value
        return latest

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save weights (safetensors, via ``save_pretrained``) and write the model card beside them."""
        super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        model = self.accelerator.unwrap_model(self.model)
        write_model_card(
            output_dir,
            model_name=Path(output_dir).name,
            trainer_name=type(self).__name__,
            base_model=base_model_name(model.get_base_model() if is_peft_model(model) else model),
            hyperparameters=self.card_hyperparameters(),
            metrics=self.card_metrics(),
        )
        # transformers pickles the arguments (training_args.bin); keep them as JSON instead: no pickle on disk,
        # and no machine-specific paths (``portable_training_args``).
        Path(output_dir, "training_args.bin").unlink(missing_ok=True)
        Path(output_dir, "training_args.json").write_text(json.dumps(portable_training_args(self.args), indent=2))

    # ---- reliability: skipped-update count, atomic checkpoints, exact resume -----------------------

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Add ``skipped_updates`` (non-finite steps skipped so far) to training logs."""
        guard = getattr(self, "nonfinite_guard", None)
        if guard is not None and "loss" in logs:
            logs["skipped_updates"] = float(guard.skipped)
        super().log(logs, *args, **kwargs)

    def save_state(self, path: str | Path) -> None:
        """Write a resumable checkpoint (transformers' own contents) atomically into the directory ``path``.

        Weights (safetensors), model card, tokenizer, ``optimizer.pt``/``scheduler.pt``/``rng_state.pth``
        (read back with ``weights_only=True``), ``trainer_state.json``, ``training_args.json`` and the
        non-finite guard's counters. Single process only (a distributed run uses transformers' saving).
        """
        from transformers.trainer import TRAINER_STATE_NAME

        if not self.args.should_save:
            return
        with ckpt.atomic_directory(path) as tmp:
            self.save_model(str(tmp), _internal_call=True)
            if not self.args.save_only_model:
                self._save_optimizer_and_scheduler(str(tmp))
                self._save_scaler(str(tmp))
                self._save_rng_state(str(tmp))
            self.state.save_to_json(str(tmp / TRAINER_STATE_NAME))
            guard = getattr(self, "nonfinite_guard", None)
            ckpt.write_json(tmp / "rlhf_state.json", {"nonfinite_guard": guard.state_dict() if guard else None})
            self._save_extra_state(tmp)

    def _save_extra_state(self, directory: Path) -> None:
        """A subclass's training state beyond what transformers saves (written inside the atomic checkpoint)."""

    def _load_extra_state(self, directory: Path) -> None:
        """Read back what ``_save_extra_state`` wrote, when resuming from ``directory``."""

    def load_state(self, path: str | Path) -> None:
        """Resume from a ``save_state`` checkpoint on the next ``train()`` (built with the same arguments)."""
        path = ckpt.checkpoint_dir(path)
        if not (path / "trainer_state.json").is_file():
            raise ValueError(f"{path} is not a trainer checkpoint (no trainer_state.json)")
        self._resume_checkpoint = str(path)

    def _refuse_due_evaluation(self) -> None:
        """With an evaluation strategy but no ``eval_dataset`` (``without_eval_strategy``): refuse, before the first
        step, a run in which TRL 0.11 (transformers 4.45's schedule) would evaluate and stop with
        "Trainer: evaluation requires an eval_dataset."; a run that ends first trains without evaluating, as there."""
        strategy = getattr(self, "_eval_strategy_without_data", None)
        if strategy is None:
            return
        args = self.args
        per_epoch = max(len(self.get_train_dataloader()) // args.gradient_accumulation_steps, 1)
        total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
        if strategy == IntervalStrategy.STEPS:
            every = args.eval_steps or args.logging_steps
            every = math.ceil(total * every) if every < 1 else int(every)
            due = next((step for step in range(every, total + 1, every) if step >= args.eval_delay), None)
        else:  # epoch: at the end of each epoch (the last one possibly cut short by max_steps), from eval_delay on
            first = max(1, math.ceil(args.eval_delay))
            due = min(first * per_epoch, total) if first <= math.ceil(total / per_epoch) else None
        if due is not None:
            raise ValueError(
                f"eval_strategy={strategy.value!r} evaluates at step {due} of this run's {total}, but no eval_dataset "
                "was given (TRL 0.11 would stop there: \"Trainer: evaluation requires an eval_dataset.\"). Pass an "
                "eval_dataset, or set eval_strategy='no'."
            )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from ``load_state``'s checkpoint when no other is given."""
        self._refuse_due_evaluation()
        if resume_from_checkpoint is None:
            resume_from_checkpoint = getattr(self, "_resume_checkpoint", None)
        if isinstance(resume_from_checkpoint, (str, Path)):
            resume_from_checkpoint = str(ckpt.checkpoint_dir(resume_from_checkpoint))
            extra = Path(resume_from_checkpoint, "rlhf_state.json")
            guard = getattr(self, "nonfinite_guard", None)
            if extra.is_file() and guard is not None and ckpt.read_json(extra).get("nonfinite_guard"):
                guard.load_state_dict(ckpt.read_json(extra)["nonfinite_guard"])
            self._load_extra_state(Path(resume_from_checkpoint))
        if self.args.device.type == "cpu":
            keep_freed_cpu_memory()  # speed: fewer page faults for the step's large temporaries (exact)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """transformers' periodic checkpoint, written atomically through ``save_state`` (single process)."""
        if self.args.world_size > 1:
            return super()._save_checkpoint(model, trial)
        from transformers.trainer import PREFIX_CHECKPOINT_DIR
        from transformers.trainer_utils import rotate_checkpoints

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        best_step = getattr(self.state, "best_global_step", None)
        if best_step:
            best_dir = Path(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best_dir.exists() or best_step == self.state.global_step:
                self.state.best_model_checkpoint = str(best_dir)
        self.save_state(Path(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=False)


__all__ = [
    "GracefulStopCallback", "NonFiniteGuardCallback", "RlhfTrainerMixin", "TrackerCallback", "base_model_name",
    "default_training_args", "keyword_defaults", "merge_config_fields",
    "load_model", "load_tokenizer_for", "portable_training_args", "resolve_bf16",
    "resolve_processing_class",
    "without_eval_strategy", "wrap_peft",
]
