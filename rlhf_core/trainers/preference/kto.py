"""KTOTrainer: Kahneman-Tversky Optimisation on unpaired (prompt, completion, label) rows, TRL 1.16's API.

Data: rows with ``prompt``, ``completion`` and a bool ``label`` (True = desirable), plain text or conversational
(lists of ``{"role", "content"}`` messages, rendered with the tokenizer's chat template); paired rows
(``prompt``, ``chosen``, ``rejected``) are unpaired first, as TRL does. Each row is tokenised once
(:func:`prepare_kto_dataset`) and, for the ``kto`` loss, given a *KL completion*: the completion of the row
before it in its batch (the first row gets the last one), which with sequential sampling estimates the
policy's KL to the reference on the batch's prompts.

Step: the policy's summed completion log-prob (one forward pass, ``position_ids`` from the attention mask so any
padding gives each row's own result); the KL pairs' log-probs under policy and reference without gradients; the
reference log-probs (a frozen in-memory copy, the PEFT policy with its adapter off, or precomputed columns);
z0 = mean over processes of the batch KL estimate, clamped at 0 (``losses.kto_reference_point``); and
``losses.kto_loss``. Metrics follow TRL 1.16's names and are averaged over processes.
"""

from __future__ import annotations

import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Unpack

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Trainer, set_seed

from rlhf_core.core import position_ids_from_attention_mask, sequence_logprobs
from rlhf_core.losses import kto_kl_estimate, kto_loss, kto_reference_point, kto_stat_sums, kto_stats_from_sums
from rlhf_core.trainers import base
from rlhf_core.trainers.base import TrackingOptions, check_tracking
from rlhf_core.trainers.collators import pad_to_length
from rlhf_core.trainers.experience import ModelBatch
from rlhf_core.trainers.forward import ResponseForward, decide_reference, disable_dropout, dropout_off, reference_model, response_forward
from rlhf_core.trainers.preference.kto_config import KTOConfig
from rlhf_core.models.padding import ensure_pad_token

logger = logging.getLogger(__name__)

TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "KL_completion_ids", "label", "ref_logps", "ref_KL_logps")


# --------------------------------------------------------------------------------------------
# data (pure functions on rows)
# --------------------------------------------------------------------------------------------


def unpair_rows(batch: Mapping[str, list]) -> dict[str, list]:
    """A batch of paired rows -> its chosen rows (label True) followed by its rejected rows (label False).

    Other columns are repeated for both halves. ``{"prompt": [p], "chosen": [c], "rejected": [r]}`` ->
    ``{"prompt": [p, p], "completion": [c, r], "label": [True, False]}``.
    """
    n = len(batch["chosen"])
    out = {"completion": list(batch["chosen"]) + list(batch["rejected"]), "label": [True] * n + [False] * n}
    for key, values in batch.items():
        if key not in ("chosen", "rejected"):
            out[key] = list(values) + list(values)
    return out


def is_conversational(value: Any) -> bool:
    """True for a list of ``{"role", "content"}`` messages."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _token_ids(encoded: Any) -> list[int]:
    """ids from a tokenizer or chat-template result (a list, or a mapping with ``input_ids``)."""
    if isinstance(encoded, Mapping) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    if encoded and isinstance(encoded[0], list):
        encoded = encoded[0]
    return list(encoded)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_kto_row(row: Mapping[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """One (prompt, completion) row -> ``prompt_ids`` and ``completion_ids``.

    The prompt and prompt + completion are tokenised whole (plain text, or the chat template with a generation
    prompt for the prompt alone); the completion is what follows their common prefix, so tokens that merge
    across the boundary are scored as completion. Plain completions get EOS appended (once) beforehand.
    """
    prompt, completion = row["prompt"], row["completion"]
    if is_conversational(prompt):
        prompt_ids = _token_ids(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True))
        full_ids = _token_ids(tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=True))
    else:
        eos = tokenizer.eos_token or ""
        if eos and not completion.endswith(eos):
            completion = completion + eos
        prompt_ids = _token_ids(tokenizer(prompt))
        full_ids = _token_ids(tokenizer(prompt + completion))
    cut = common_prefix_length(prompt_ids, full_ids)
    return {"prompt_ids": prompt_ids[:cut], "completion_ids": full_ids[cut:]}


def add_kl_completions(batch: Mapping[str, list]) -> dict[str, list]:
    """Each row's KL completion is the previous row's completion (the first row takes the last one).

    ``completion_ids`` [a, b, c] -> ``KL_completion_ids`` [c, a, b]: prompt i is scored with a completion
    written for another prompt, which is how KTO estimates KL(policy || reference) on the batch.
    """
    completions = list(batch["completion_ids"])
    return {"KL_completion_ids": completions[-1:] + completions[:-1]}


def _check_columns(dataset: Any, name: str) -> None:
    """The dataset has prompt + completion + label (or prompt + chosen + rejected), with a bool label."""
    columns = set(dataset.column_names)
    if "prompt" not in columns:
        raise ValueError(f"KTO {name} dataset needs a 'prompt' column; found {sorted(columns)}")
    missing = [c for c in ("completion", "label") if c not in columns]
    if missing:
        raise ValueError(
            f"KTO {name} dataset needs 'completion' and 'label' columns (or 'chosen' and 'rejected'); "
            f"missing {missing}, found {sorted(columns)}"
        )
    feature = getattr(dataset, "features", None) and dataset.features.get("label")
    if feature is not None and getattr(feature, "dtype", "bool") != "bool":
        raise ValueError(f"KTO {name} dataset: column 'label' must hold bools (True = desirable), got {feature.dtype}")


def prepare_kto_dataset(
    dataset: Any, tokenizer: Any, max_length: int | None, kl_batch_size: int | None, num_proc: int | None = None,
    name: str = "train",
) -> Any:
    """Text rows -> token rows: unpair, tokenise, drop rows whose prompt fills ``max_length``, add KL completions.

    ``kl_batch_size`` is the per-device train batch size (None: no KL completions, for ``apo_zero_unpaired``).
    Already-tokenised datasets (with ``prompt_ids``) pass through.
    """
    if dataset is None or "prompt_ids" in dataset.column_names:
        return dataset
    columns = set(dataset.column_names)
    if {"chosen", "rejected"} <= columns:
        dataset = dataset.map(unpair_rows, batched=True, remove_columns=["chosen", "rejected"], num_proc=num_proc)
    _check_columns(dataset, name)
    dataset = dataset.map(tokenize_kto_row, fn_kwargs={"tokenizer": tokenizer}, num_proc=num_proc)
    if max_length is not None:
        dataset = dataset.filter(lambda row: len(row["prompt_ids"]) < max_length, num_proc=num_proc)
    if kl_batch_size is not None:
        dataset = dataset.map(add_kl_completions, batched=True, batch_size=kl_batch_size, num_proc=num_proc)
    return dataset


def weight_advice(labels: Sequence[bool], desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL's rule of thumb: with unbalanced labels, ``w_d * n_d / (w_u * n_u)`` should be in [1, 4/3].

    Returns a warning text when neither weight is in its recommended range, else None.
    """
    n_d = max(sum(bool(x) for x in labels), 1)
    n_u = max(len(labels) - n_d, 1)
    if n_d == n_u:
        return None
    d_low, d_high = n_u * undesirable_weight / n_d, n_u * undesirable_weight / n_d * 1.33
    u_low, u_high = n_d * desirable_weight / n_u / 1.33, n_d * desirable_weight / n_u
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (
        f"{n_d} desirable and {n_u} undesirable rows: set EITHER desirable_weight in [{d_low:.2f}, {d_high:.2f}] "
        f"OR undesirable_weight in [{u_low:.2f}, {u_high:.2f}] (not both)"
    )


@dataclass
class DataCollatorForUnpairedPreference:
    """Token rows -> right-padded (B, T) ``input_ids``, ``attention_mask``, ``completion_mask`` (and ``KL_*``).

    Each sequence is prompt + completion cut to ``max_length`` on the right; ``label`` becomes a bool tensor (B,),
    ``ref_logps``/``ref_KL_logps`` float tensors (B,) when present.
    """

    pad_token_id: int
    max_length: int | None = None
    pad_to_multiple_of: int | None = None

    def __call__(self, rows: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not rows:
            raise ValueError("DataCollatorForUnpairedPreference got an empty batch")
        out: dict[str, torch.Tensor] = {}
        for prefix, key in (("", "completion_ids"), ("KL_", "KL_completion_ids")):
            if key in rows[0]:
                out.update(self._pad(rows, key, prefix))
        out["label"] = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)  # (B,)
        for key in ("ref_logps", "ref_KL_logps"):
            if key in rows[0]:
                out[key] = torch.tensor([float(row[key]) for row in rows], dtype=torch.float32)  # (B,)
        return out

    def _pad(self, rows: list[Mapping[str, Any]], key: str, prefix: str) -> dict[str, torch.Tensor]:
        ids, marks = [], []
        for row in rows:
            seq = list(row["prompt_ids"]) + list(row[key])
            mark = [0] * len(row["prompt_ids"]) + [1] * len(row[key])
            if self.max_length is not None:
                seq, mark = seq[: self.max_length], mark[: self.max_length]
            ids.append(seq)
            marks.append(mark)
        width = max(len(seq) for seq in ids)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return {
            f"{prefix}input_ids": pad_to_length(ids, self.pad_token_id, width),  # (B, T)
            f"{prefix}attention_mask": pad_to_length([[1] * len(s) for s in ids], 0, width),  # (B, T)
            f"{prefix}completion_mask": pad_to_length(marks, 0, width),  # (B, T)
        }


# --------------------------------------------------------------------------------------------
# log-probs
# --------------------------------------------------------------------------------------------


def completion_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
                     ) -> ModelBatch:
    """The shared forward's ``ModelBatch`` of KTO rows: every next-token position scored, the mask keeping the real
    completion tokens. ``position_ids`` come from the attention mask, so left, right or no padding give every row
    the log-prob it has alone. input_ids, attention_mask, completion_mask: (B, T) -> slots (B, T-1)."""
    index = torch.arange(input_ids.shape[1] - 1, device=input_ids.device).expand(input_ids.shape[0], -1)  # (B, T-1)
    model_inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                    "position_ids": position_ids_from_attention_mask(attention_mask)}
    scored = completion_mask[:, 1:] * attention_mask[:, 1:]  # (B, T-1): token t+1 is a real completion token
    return ModelBatch(model_inputs=model_inputs, response_index=index, response_tokens=input_ids[:, 1:],
                      response_mask=scored, token_ids_key="input_ids")


def completion_logps(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor,
    **options: bool,
) -> tuple[torch.Tensor, ResponseForward, torch.Tensor]:
    """Summed log-prob of each row's completion tokens (B,), the shared forward's per-token outputs (B, T-1)
    (``forward.response_forward`` on every position; ``options``: its ``entropy``, ``logit_mean``), and the
    (B, T-1) mask of the scored tokens."""
    batch = completion_batch(input_ids, attention_mask, completion_mask)
    forward = response_forward(model, batch, positions="all", **options)
    return sequence_logprobs(forward.logprobs, batch.response_mask), forward, batch.response_mask


# --------------------------------------------------------------------------------------------
# trainer
# --------------------------------------------------------------------------------------------


class KTOTrainer(base.StoredMetricsMixin, base.RlhfTrainerMixin, Trainer):
    """KTO with TRL 1.16.0's constructor; ``log_with``/``tracker_*`` (keyword-only) add an rlhf_core tracker."""

    trainer_name = "kto"

    @staticmethod
    def _processing_class(processing_class: Any, tokenizer: Any) -> Any:
        """``processing_class``, or TRL 0.11's ``tokenizer=`` (with a FutureWarning); both given is an error."""
        if tokenizer is None:
            return processing_class
        if processing_class is not None and processing_class is not tokenizer:
            raise ValueError("KTOTrainer: tokenizer= (TRL 0.11's name) and processing_class= name two tokenizers; "
                             "pass processing_class= only")
        warnings.warn("KTOTrainer(tokenizer=...) is TRL 0.11's name; TRL 1.x names it processing_class=",
                      FutureWarning, stacklevel=3)
        return tokenizer

    def __init__(self, model: Any, ref_model: nn.Module | None = None, args: KTOConfig | None = None,
                 data_collator: Callable | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                 processing_class: Any = None, compute_metrics: Callable | None = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), quantization_config: Any = None, peft_config: Any = None,
                 tokenizer: Any = None, **tracking: Unpack[TrackingOptions]) -> None:
        """TRL 1.16.0's positional order; ``tokenizer``: TRL 0.11's name of ``processing_class`` (its kto.py passes
        it); ``tracking``: ``TrackingOptions``."""
        tracking = check_tracking(type(self).__name__, tracking)
        processing_class = self._processing_class(processing_class, tokenizer)
        args = self._resolve_args(model, args)
        if train_dataset is None:
            raise ValueError("KTOTrainer needs train_dataset= (rows with prompt, completion, label)")
        set_seed(args.seed)  # before any adapter is initialised
        tokenizer = base.load_tokenizer_for(model, processing_class)
        model = self._load_model(model, args, quantization_config)
        if isinstance(ref_model, (str, Path)):  # beyond TRL 1.16 (objects only): a name or path is loaded too
            ref_model = self._load_model(ref_model, args, quantization_config)
        if ref_model is not None and ref_model is model:
            raise ValueError("ref_model is model: pass a separate reference model, or ref_model=None for a frozen copy")
        if tokenizer is None:
            raise ValueError("KTOTrainer needs processing_class= (a tokenizer) when model is not a name or path")
        ensure_pad_token(tokenizer)
        model = base.wrap_peft(model, peft_config)
        self.beta, self.loss_type = args.beta, args.loss_type
        self.desirable_weight, self.undesirable_weight = args.desirable_weight, args.undesirable_weight
        self.calculate_KL = args.loss_type != "apo_zero_unpaired"
        self.precompute_ref_logps = args.precompute_ref_log_probs
        self._tokenizer = tokenizer
        train_dataset = self._prepare(train_dataset, args, "train")
        self._warn_about_weights(train_dataset)
        eval_dataset = self._prepare_eval(eval_dataset, args)
        if data_collator is None:
            data_collator = DataCollatorForUnpairedPreference(
                tokenizer.pad_token_id, args.max_length, args.pad_to_multiple_of
            )
        reference = decide_reference(model, ref_model, needed=not self.precompute_ref_logps)
        self.use_peft_reference, ref_model = reference.adapter_off, reference.model
        if args.disable_dropout:
            disable_dropout(model)
            disable_dropout(ref_model)
        self.ref_model = ref_model
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer, compute_metrics=compute_metrics,
            callbacks=callbacks, optimizers=optimizers,
        )
        self.model_accepts_loss_kwargs = False  # the KTO loss is a per-row mean
        self._stored_metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        if self.ref_model is not None:
            self.ref_model.to(self.args.device)
        if self.precompute_ref_logps:
            self._precompute_all_reference_logps()
        self._setup_tracking(**tracking)

    # ---- setup ---------------------------------------------------------------------------

    @staticmethod
    def _resolve_args(model: Any, args: Any) -> KTOConfig:
        """The given KTOConfig, or TRL's default (``output_dir=<model name>-KTO``, reporting nowhere)."""
        if args is None:
            name = str(model) if isinstance(model, (str, Path)) else (base.base_model_name(model) or "model")
            return KTOConfig(output_dir=f"{Path(name).name}-KTO", report_to="none")
        if not isinstance(args, KTOConfig):
            raise TypeError(
                f"KTOTrainer args must be a KTOConfig (it holds beta, loss_type, ...), got {type(args).__name__}"
            )
        return args

    @staticmethod
    def _load_model(model: Any, args: KTOConfig, quantization_config: Any) -> nn.Module:
        """A name/path is loaded with ``args.model_init_kwargs``; an instance passes through (kwargs ignored)."""
        if model is None:
            raise ValueError("KTOTrainer needs model= (a causal LM, a name or a path)")
        if not isinstance(model, (str, Path)):
            if quantization_config is not None:
                raise ValueError("quantization_config only applies when model is a name or path, not an instance")
            if args.model_init_kwargs:
                logger.warning("KTOConfig.model_init_kwargs is ignored: model is already instantiated")
            return model
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
        if quantization_config is not None:
            if "quantization_config" in kwargs:
                raise ValueError("quantization_config given both to KTOTrainer and in KTOConfig.model_init_kwargs")
            kwargs["quantization_config"] = quantization_config
        return base.load_model(model, AutoModelForCausalLM, kwargs)

    def _prepare(self, dataset: Any, args: KTOConfig, name: str) -> Any:
        """Tokenise one text dataset with this trainer's lengths (see :func:`prepare_kto_dataset`)."""
        kl_batch_size = args.per_device_train_batch_size if self.calculate_KL else None
        return prepare_kto_dataset(
            dataset, self._tokenizer, args.max_length, kl_batch_size, args.dataset_num_proc, name
        )

    def _prepare_eval(self, eval_dataset: Any, args: KTOConfig) -> Any:
        if isinstance(eval_dataset, dict):
            return {key: self._prepare(value, args, key) for key, value in eval_dataset.items()}
        return self._prepare(eval_dataset, args, "eval")

    def _warn_about_weights(self, dataset: Any) -> None:
        if hasattr(dataset, "column_names") and "label" in dataset.column_names:
            advice = weight_advice(dataset["label"], self.desirable_weight, self.undesirable_weight)
            if advice:
                logger.warning("KTO loss weights look unbalanced: %s", advice)

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the KTO token columns (the model's forward signature does not name them)."""
        if self._signature_columns is None:
            self._signature_columns = list(TOKEN_COLUMNS)

    # ---- reference -----------------------------------------------------------------------

    def compute_ref_log_probs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Reference log-probs of the completions (B,) and of the KL completions (B,) (None without a KL term)."""
        reference = self.ref_model
        if reference is None:
            if not self.use_peft_reference and self.state.global_step > 0:
                raise ValueError(
                    "no reference model: precompute_ref_log_probs=True without ref_model keeps none after training "
                    "starts; pass eval datasets at construction, give ref_model=, or set precompute_ref_log_probs=False"
                )
            reference = self.model  # the PEFT policy with its adapter off, or the policy before its first step
        # in eval mode whatever ``disable_dropout`` says: reference log-probs are deterministic
        with (torch.no_grad(),
              reference_model(self.accelerator, self.model, reference, adapter_off=self.use_peft_reference) as reference,
              dropout_off(reference)):
            logps = completion_logps(
                reference, batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
            )[0]
            kl_logps = self._kl_logps(reference, batch)
        return logps, kl_logps

    def _kl_logps(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """Log-probs (B,) of the mismatched KL completions under ``model``, without gradients."""
        if not self.calculate_KL:
            return None
        with torch.no_grad():
            logps = completion_logps(
                model, batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"]
            )[0]
        return logps

    def _precompute_all_reference_logps(self) -> None:
        """Add ``ref_logps`` (and ``ref_KL_logps``) columns to the train and eval datasets."""
        size = self.args.precompute_ref_batch_size
        train_size = size or self.args.per_device_train_batch_size
        self.train_dataset = self._with_reference_logps(self.train_dataset, train_size)
        eval_size = size or self.args.per_device_eval_batch_size
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._with_reference_logps(v, eval_size) for k, v in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_reference_logps(self.eval_dataset, eval_size)

    def _with_reference_logps(self, dataset: Any, batch_size: int) -> Any:
        """``dataset`` with one reference log-prob per row (computed in order, on every process alike)."""
        if dataset is None or "ref_logps" in dataset.column_names:
            return dataset
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=self.data_collator)
        logps, kl_logps = [], []
        for batch in loader:
            ref, ref_kl = self.compute_ref_log_probs(self._prepare_inputs(batch))
            logps.append(ref.float().cpu())
            if ref_kl is not None:
                kl_logps.append(ref_kl.float().cpu())
        dataset = dataset.add_column("ref_logps", torch.cat(logps).tolist())
        if kl_logps:
            dataset = dataset.add_column("ref_KL_logps", torch.cat(kl_logps).tolist())
        return dataset

    def _reference_for(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Precomputed or freshly computed reference log-probs (B,) and KL log-probs (B,) or None."""
        if "ref_logps" in batch:
            return batch["ref_logps"], batch.get("ref_KL_logps")
        return self.compute_ref_log_probs(batch)

    # ---- loss and metrics ----------------------------------------------------------------

    def kl_reference_point(
        self, policy_kl_logps: torch.Tensor | None, ref_kl_logps: torch.Tensor | None
    ) -> torch.Tensor:
        """z0: the batch KL estimate averaged over processes, clamped at 0 (0 for ``apo_zero_unpaired``)."""
        if policy_kl_logps is None or ref_kl_logps is None:
            return torch.zeros((), device=self.args.device)
        local = kto_kl_estimate(policy_kl_logps, ref_kl_logps.to(policy_kl_logps)).reshape(1)  # (1,)
        return kto_reference_point(self.accelerator.gather(local))  # gather -> (P,)

    def get_batch_loss_metrics(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], train_eval: str = "train"
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean KTO loss over the batch's rows and its metrics (prefixed ``eval_`` in evaluation)."""
        labels = batch["label"].bool()  # (B,)
        logps, forward, scored = completion_logps(model, batch["input_ids"], batch["attention_mask"],
                                                  batch["completion_mask"], entropy=True, logit_mean=True)
        ref_logps, ref_kl_logps = self._reference_for(batch)  # (B,), (B,) or None
        kl = self.kl_reference_point(self._kl_logps(model, batch), ref_kl_logps)
        ref_logps = ref_logps.to(logps)
        losses, rewards = kto_loss(
            logps, ref_logps, labels, kl, self.beta, self.desirable_weight, self.undesirable_weight, self.loss_type
        )
        metrics = self._metrics(labels, logps, forward, scored, rewards, kl)
        prefix = "eval_" if train_eval == "eval" else ""
        self._last_rewards = rewards
        return losses.mean(), {prefix + key: value for key, value in metrics.items()}

    def _metrics(self, labels, logps, forward: ResponseForward, scored, rewards, kl) -> dict[str, float]:
        """TRL 1.16's KTO metrics, each averaged over the rows (or tokens) of every process. ``forward``: the policy's
        per-token outputs (B, T-1) with entropy and mean logit; ``scored``: their (B, T-1) mask."""
        scored = scored.float()
        mean_logits = forward.logit_mean  # (B, T-1)
        chosen_tokens, rejected_tokens = scored * labels[:, None], scored * ~labels[:, None]  # (B, T-1) each
        sums = torch.cat([
            kto_stat_sums(rewards, logps, labels),  # (6,)
            torch.stack([(mean_logits * chosen_tokens).sum(), chosen_tokens.sum(),
                         (mean_logits * rejected_tokens).sum(), rejected_tokens.sum(),
                         (forward.entropy * scored).sum(), scored.sum()]),  # (6,)
        ])
        if self.accelerator.num_processes > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")  # every rank runs this once per step
        stats = {"kl": kl.detach().float(), **kto_stats_from_sums(sums[:6])}
        if sums[7] > 0:
            stats["logits/chosen"] = sums[6] / sums[7]
        if sums[9] > 0:
            stats["logits/rejected"] = sums[8] / sums[9]
        if sums[11] > 0:
            stats["entropy"] = sums[10] / sums[11]
        return {key: float(value) for key, value in stats.items()}

    def _prediction_outputs(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``prediction_step``'s per-row implicit rewards (B,) and labels (B,) as floats."""
        return self._last_rewards.detach(), inputs["label"].float()

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """Usual evaluation; a text dataset given here is tokenised (and given reference log-probs) first."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepare_eval(eval_dataset, self.args)
            if self.precompute_ref_logps:
                size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
                if isinstance(eval_dataset, dict):
                    eval_dataset = {k: self._with_reference_logps(v, size) for k, v in eval_dataset.items()}
                else:
                    eval_dataset = self._with_reference_logps(eval_dataset, size)
            if isinstance(eval_dataset, dict):
                metrics: dict[str, float] = {}
                for key, dataset in eval_dataset.items():
                    metrics.update(super().evaluate(dataset, ignore_keys, f"{metric_key_prefix}_{key}"))
                return metrics
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def card_hyperparameters(self) -> dict[str, Any]:
        """Trainer arguments plus KTO's own."""
        extra = {
            "beta": self.beta, "loss_type": self.loss_type, "desirable_weight": self.desirable_weight,
            "undesirable_weight": self.undesirable_weight, "max_length": self.args.max_length,
            "precompute_ref_log_probs": self.precompute_ref_logps,
        }
        return {**super().card_hyperparameters(), **extra}


__all__ = [
    "DataCollatorForUnpairedPreference", "KTOTrainer", "add_kl_completions", "completion_batch", "completion_logps",
    "prepare_kto_dataset", "tokenize_kto_row", "unpair_rows", "weight_advice",
]
