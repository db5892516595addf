"""DPOTrainer: Direct Preference Optimisation on prompt/chosen/rejected data, a ``transformers.Trainer`` subclass.

Rows are tokenised once (``tokenize_dpo_row``: prompt and responses tokenised separately, EOS after each
response, truncated by ``truncation_mode``). Each batch is stacked ``[chosen; rejected]`` (2B, T) for one
forward pass (``concatenated_forward``) and split with ``chunk(2)``; a response's log-prob is
``core.sequence_logprobs`` over its tokens, and the loss is ``losses.dpo_loss`` (any of TRL 0.11.4's loss types;
plus RPO's chosen NLL with ``rpo_alpha``). The reference is ``ref_model``, a frozen copy of the policy, the PEFT
policy with its adapter disabled, precomputed log-probs, or nothing (``reference_free``); with ``sync_ref_model``
(TR-DPO) it follows the policy (``ref_sync.py``). An encoder-decoder reads the prompt and scores each response as
its decoder's labels (``tokenize_dpo_row_encoder_decoder``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import warnings
from dataclasses import dataclass, field
from enum import Enum
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Unpack

import torch
from safetensors.torch import load_model as load_model_weights, save_model
from torch import nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from rlhf_core import checkpointing as ckpt
from rlhf_core.core import logprobs_from_logits, masked_mean, sequence_logprobs, shifted_token_logprobs
from rlhf_core.data_utils import is_conversational, maybe_apply_chat_template, maybe_extract_prompt
from rlhf_core.import_utils import is_wandb_available
from rlhf_core.kl_control import RunningMoments
from rlhf_core.losses import DPO_LOSS_TYPES, DPO_SMOOTHED_LOSS_TYPES, bco_batch_reward, dpo_loss, rpo_nll_loss
from rlhf_core.models.peft_support import is_peft_model
from rlhf_core.trainers.base import (
    RlhfTrainerMixin,
    StoredMetricsMixin,
    TrackingOptions,
    check_tracking,
    checked_init_kwargs,
    default_training_args,
    load_model,
    load_tokenizer_for,
    keyword_defaults,
    merge_config_fields,
    resolve_bf16,
    resolve_processing_class,
    wrap_peft,
    without_eval_strategy,
)
from rlhf_core.trainers.collators import IGNORE_INDEX, DPODataCollatorWithPadding, pad_to_length
from rlhf_core.trainers.experience import ModelBatch
from rlhf_core.trainers.forward import Reference, ResponseForward, decide_reference, reference_model, response_forward
from rlhf_core.trainers.forward import disable_dropout as disable_dropout_in_model
from rlhf_core.trainers.ref_sync import SyncRefModelCallback

logger = logging.getLogger(__name__)

DPO_TEXT_COLUMNS = ("prompt", "chosen", "rejected")
DPO_TOKEN_COLUMNS = (
    "prompt_input_ids", "prompt_attention_mask",
    "chosen_input_ids", "chosen_attention_mask", "chosen_labels",
    "rejected_input_ids", "rejected_attention_mask", "rejected_labels",
)
# an encoder-decoder's rows: the prompt for the encoder, each response as the decoder's labels
ENCODER_DECODER_TOKEN_COLUMNS = ("prompt_input_ids", "prompt_attention_mask", "chosen_labels", "rejected_labels")
REFERENCE_COLUMNS = ("reference_chosen_logps", "reference_rejected_logps")
# what a DPO checkpoint holds beyond transformers' files (``_save_extra_state``)
BCO_STATE_FILE, SYNCED_REFERENCE_FILE = "bco_running.json", "reference_model.safetensors"
TRUNCATION_MODES = ("keep_end", "keep_start")
DEFAULT_MAX_LENGTH, DEFAULT_MAX_PROMPT_LENGTH = 512, 128


# DPOTrainer keywords that DPOConfig (TRL 0.11) also carries (the keyword max_target_length is the field
# max_completion_length).
DPO_CONFIG_KEYWORDS = (
    "beta", "label_pad_token_id", "padding_value", "truncation_mode", "max_length", "max_prompt_length",
    "disable_dropout", "generate_during_eval", "loss_type", "label_smoothing", "reference_free",
    "precompute_ref_log_probs", "model_init_kwargs", "ref_model_init_kwargs", "max_completion_length",
    "is_encoder_decoder", "dataset_num_proc", "force_use_ref_model",
)
# An encoder-decoder's completion length when none is given (TRL 0.11.4's default, with a warning).
DEFAULT_MAX_COMPLETION_LENGTH = 128


class FDivergenceType(Enum):
    """The f-divergence regularising DPO (TRL 0.11 names; ``losses.f_divergence_logits`` gives each one's logit)."""

    REVERSE_KL = "reverse_kl"
    JS_DIVERGENCE = "js_divergence"
    ALPHA_DIVERGENCE = "alpha_divergence"


# DPOConfig fields rlhf_core does not implement, with the value that means "off"; another value is refused.
UNSUPPORTED_DPO_FIELDS = {"model_adapter_name": None, "ref_adapter_name": None}


@dataclass
class DPOConfig(TrainingArguments):
    """``TrainingArguments`` plus the DPO trainer's options (TRL 0.11 names and defaults)."""

    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; None: only where useful."})
    """bf16 mixed precision (autocast; fp32 weights). TRL 0.11: False; here None: True on a CUDA GPU with bf16
    support, fp32 elsewhere (``base.resolve_bf16``: a CPU run is unchanged)."""
    beta: float = field(default=0.1, metadata={"help": "Temperature of the implicit reward."})
    """Temperature of the implicit reward ``beta * (log pi - log pi_ref)``."""
    label_smoothing: float = field(default=0.0, metadata={"help": "Conservative-DPO label noise in [0, 0.5)."})
    """Assumed probability that a preference label is flipped (cDPO), in [0, 0.5)."""
    loss_type: str = field(default="sigmoid", metadata={"help": "DPO loss variant (TRL 0.11.4's names)."})
    """Loss variant, one of ``rlhf_core.losses.DPO_LOSS_TYPES`` (each a ``dpo_<type>_loss`` there, paper named):
    sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot, aot_pair, apo_zero, apo_down."""
    label_pad_token_id: int = field(default=IGNORE_INDEX, metadata={"help": "Label of prompt / pad tokens."})
    """Label of prompt and padding tokens (ignored by the loss)."""
    padding_value: int | None = field(default=None, metadata={"help": "Input-id padding (None: pad_token_id)."})
    """Input-id padding value; None uses the tokenizer's ``pad_token_id`` (0 when it has none)."""
    truncation_mode: str = field(default="keep_end", metadata={"help": "Prompt truncation: keep_end|keep_start."})
    """Which end of a too-long prompt is kept: ``keep_end`` or ``keep_start``."""
    max_length: int | None = field(default=None, metadata={"help": "Longest prompt + response (tokens)."})
    """Longest prompt + response, in tokens (None: 512)."""
    max_prompt_length: int | None = field(default=None, metadata={"help": "Longest prompt (tokens)."})
    """Longest prompt kept when a row is too long (None: min(128, max_length // 2))."""
    max_target_length: int | None = field(default=None, metadata={"help": "Deprecated: max_completion_length."})
    """Deprecated name of ``max_completion_length`` (copied there when that is None, with a FutureWarning)."""
    max_completion_length: int | None = field(default=None, metadata={"help": "Encoder-decoder target length."})
    """Longest completion (decoder labels) of an encoder-decoder model (None: 128); decoder-only models ignore
    it, as TRL 0.11.4 does (they cut responses to ``max_length - max_prompt_length``)."""
    is_encoder_decoder: bool | None = field(default=None, metadata={"help": "Encoder-decoder model (from config)."})
    """Whether the model is an encoder-decoder; as in TRL 0.11.4 the model's own ``config.is_encoder_decoder``
    decides whenever a model is given."""
    disable_dropout: bool = field(default=True, metadata={"help": "Turn dropout off in model and reference."})
    """Turn dropout off in the policy and the reference model."""
    generate_during_eval: bool = field(default=False, metadata={"help": "Log samples at evaluation."})
    """Generate and log policy / reference samples at each evaluation."""
    precompute_ref_log_probs: bool = field(default=False, metadata={"help": "Reference log-probs up front."})
    """Compute the reference log-probabilities of the whole dataset once, before training."""
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    """Processes for ``datasets.map`` when tokenising (None: in-process)."""
    model_init_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "from_pretrained kwargs."})
    """Keyword arguments of ``from_pretrained`` when the model is given as a name or path."""
    ref_model_init_kwargs: dict[str, Any] | None = field(default=None, metadata={"help": "Ref from_pretrained kwargs."})
    """Keyword arguments of ``from_pretrained`` when the reference model is given as a name or path."""
    model_adapter_name: str | None = field(default=None, metadata={"help": "PEFT policy adapter (unsupported)."})
    """Name of the policy's PEFT adapter (not supported: only None)."""
    ref_adapter_name: str | None = field(default=None, metadata={"help": "PEFT reference adapter (unsupported)."})
    """Name of a reference PEFT adapter (not supported: only None)."""
    reference_free: bool = field(default=False, metadata={"help": "Uniform reference (no reference model)."})
    """Ignore the reference model (a uniform reference, log-probs 0)."""
    force_use_ref_model: bool = field(default=False, metadata={"help": "Use ref_model beside a peft_config."})
    """Allow ``ref_model`` together with ``peft_config``: the reference is then that model, not the policy with
    its adapter disabled (without it the pair is refused, as in TRL 0.11.4)."""
    f_divergence_type: FDivergenceType | str = field(
        default=FDivergenceType.REVERSE_KL, metadata={"help": "f-divergence: reverse_kl|js_divergence|alpha_divergence."}
    )
    """The f-divergence of the DPO objective: ``reverse_kl`` (standard DPO), ``js_divergence`` or
    ``alpha_divergence`` ("Beyond Reverse KL", Wang et al. 2023); an enum member or its string value."""
    f_alpha_divergence_coef: float = field(default=1.0, metadata={"help": "Alpha of the alpha-divergence."})
    """Alpha of the alpha-divergence (non-zero; used only with ``f_divergence_type="alpha_divergence"``)."""
    sync_ref_model: bool = field(default=False, metadata={"help": "TR-DPO: the reference follows the policy."})
    """TR-DPO (Gorbatovski et al. 2024, arXiv 2404.09656): every ``ref_model_sync_steps`` optimizer steps the
    reference becomes ``alpha * policy + (1 - alpha) * reference`` (needs a separate reference model)."""
    ref_model_mixup_alpha: float = field(default=0.9, metadata={"help": "TR-DPO mixing weight alpha in [0, 1]."})
    """TR-DPO's alpha: the policy's weight in the mix (1: the reference becomes a copy of the policy)."""
    ref_model_sync_steps: int = field(default=64, metadata={"help": "TR-DPO sync period tau, in steps."})
    """TR-DPO's tau: optimizer steps between two reference updates (>= 1)."""
    rpo_alpha: float | None = field(default=None, metadata={"help": "RPO: weight of the chosen NLL (None: off)."})
    """RPO (Pang et al. 2024, arXiv 2404.19733 v3): the loss becomes DPO + ``rpo_alpha`` * the token-mean negative
    log-likelihood of the chosen responses; None turns it off (the paper uses 1.0)."""

    def __post_init__(self) -> None:
        resolve_bf16(self)
        if isinstance(self.f_divergence_type, str):
            self.f_divergence_type = FDivergenceType(self.f_divergence_type)
        for name, off in UNSUPPORTED_DPO_FIELDS.items():
            if getattr(self, name) not in (off, False if off is None else off):
                raise ValueError(f"DPOConfig.{name}={getattr(self, name)!r} is not supported by rlhf_core (use {off!r})")
        if self.loss_type == "kto_pair":
            raise ValueError("Support for kto_pair has been removed in DPOTrainer. Please use KTOTrainer.")
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"DPOConfig.loss_type must be one of {DPO_LOSS_TYPES}, got {self.loss_type!r}")
        check_dpo_extensions(self.rpo_alpha, self.sync_ref_model, self.ref_model_mixup_alpha, self.ref_model_sync_steps)
        if self.max_target_length is not None:
            warnings.warn("The `max_target_length` argument is deprecated in favor of `max_completion_length` and will "
                          "be removed in a future version.", FutureWarning, stacklevel=2)
            if self.max_completion_length is None:
                self.max_completion_length = self.max_target_length
        super().__post_init__()


def check_dpo_extensions(
    rpo_alpha: float | None, sync_ref_model: bool, ref_model_mixup_alpha: float, ref_model_sync_steps: int
) -> None:
    """Refuse an RPO weight that is not a finite number >= 0, and TR-DPO settings out of range (when it is on)."""
    if rpo_alpha is not None and not (isinstance(rpo_alpha, (int, float)) and 0 <= rpo_alpha < math.inf):
        raise ValueError(f"DPOConfig.rpo_alpha must be None or a finite number >= 0, got {rpo_alpha!r}")
    if sync_ref_model:
        if not 0.0 <= ref_model_mixup_alpha <= 1.0:
            raise ValueError(f"DPOConfig.ref_model_mixup_alpha must be in [0, 1], got {ref_model_mixup_alpha!r}")
        if isinstance(ref_model_sync_steps, bool) or not isinstance(ref_model_sync_steps, int) or ref_model_sync_steps < 1:
            raise ValueError(f"DPOConfig.ref_model_sync_steps must be an integer >= 1, got {ref_model_sync_steps!r}")


# --------------------------------------------------------------------------------------------
# tokenisation and batching (pure)
# --------------------------------------------------------------------------------------------


def truncate_prompt_and_responses(
    prompt: list[int],
    chosen: list[int],
    rejected: list[int],
    max_length: int,
    max_prompt_length: int,
    truncation_mode: str,
) -> tuple[list[int], list[int], list[int]]:
    """Fit ``prompt + response`` into ``max_length``: first cut the prompt to ``max_prompt_length``
    (``keep_end`` keeps its last tokens, ``keep_start`` its first), then cut the responses' ends."""
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}")
    longer = max(len(chosen), len(rejected))
    if len(prompt) + longer > max_length:
        prompt = prompt[:max_prompt_length] if truncation_mode == "keep_start" else prompt[-max_prompt_length:]
    if len(prompt) + longer > max_length:
        keep = max_length - len(prompt)
        chosen, rejected = chosen[:keep], rejected[:keep]
    return prompt, chosen, rejected


def tokenize_dpo_row(
    feature: Mapping[str, str],
    tokenizer: Any,
    max_length: int,
    max_prompt_length: int,
    truncation_mode: str = "keep_end",
    label_pad_token_id: int = IGNORE_INDEX,
) -> dict[str, list[int]]:
    """One prompt/chosen/rejected row -> prompt ids, and prompt+response ids, mask and labels per response.

    Labels equal the ids on response tokens and ``label_pad_token_id`` on prompt tokens.
    """
    for column in DPO_TEXT_COLUMNS:
        if not isinstance(feature.get(column), str):
            raise ValueError(f"DPO rows need a str {column!r} column, got {type(feature.get(column)).__name__}")
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    prompt, chosen, rejected = truncate_prompt_and_responses(
        encode(feature["prompt"]), encode(feature["chosen"]) + eos, encode(feature["rejected"]) + eos,
        max_length, max_prompt_length, truncation_mode,
    )
    row = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        row[f"{name}_input_ids"] = prompt + response
        row[f"{name}_attention_mask"] = [1] * (len(prompt) + len(response))
        row[f"{name}_labels"] = [label_pad_token_id] * len(prompt) + response
    return row


def tokenize_dpo_row_encoder_decoder(
    feature: Mapping[str, str], tokenizer: Any, max_prompt_length: int, max_completion_length: int
) -> dict[str, list[int]]:
    """One prompt/chosen/rejected row for an encoder-decoder, as TRL 0.11.4: the prompt is the encoder's input
    (``prompt_input_ids``/``prompt_attention_mask``), each response the decoder's labels (``chosen_labels``,
    ``rejected_labels``); each is tokenised on its own with the tokenizer's special tokens (T5: a closing EOS)
    and truncated by the tokenizer to ``max_prompt_length`` / ``max_completion_length``."""
    for column in DPO_TEXT_COLUMNS:
        if not isinstance(feature.get(column), str):
            raise ValueError(f"DPO rows need a str {column!r} column, got {type(feature.get(column)).__name__}")
    def encode(text: str, length: int) -> dict[str, list[int]]:
        return tokenizer(text, truncation=True, max_length=length, add_special_tokens=True)

    prompt = encode(feature["prompt"], max_prompt_length)
    return {
        "prompt_input_ids": list(prompt["input_ids"]), "prompt_attention_mask": list(prompt["attention_mask"]),
        "chosen_labels": list(encode(feature["chosen"], max_completion_length)["input_ids"]),
        "rejected_labels": list(encode(feature["rejected"], max_completion_length)["input_ids"]),
    }


def _tokenize_without_specials(text: str, images: Any, processor: Callable | None, tokenizer: Any) -> dict[str, Any]:
    """Token ids (lists) of one text without special tokens, through a processor (first row) or a tokenizer."""
    if processor is None:
        return dict(tokenizer(text, add_special_tokens=False))
    accepts_flag = "add_special_tokens" in inspect.signature(processor).parameters
    encoded = processor(text=text, images=images, **({"add_special_tokens": False} if accepts_flag else {}))
    row = {key: value[0] for key, value in encoded.items()}
    for key in ("input_ids", "attention_mask"):
        if not isinstance(row[key], list):
            row[key] = row[key].tolist()
    return row


def _build_tokenized_answer(
    prompt: str, answer: str, images: Any = None, processor: Callable | None = None, tokenizer: Any = None
) -> dict[str, Any]:
    """TRL 0.11 helper: ``prompt + answer`` tokenised once, split into prompt and answer ids.

    The answer's ids are those of the joint encoding after the prompt's own token count; when the prompt's
    last token merges with the answer's first (it differs in the joint encoding), the split moves one token
    left so ``prompt_input_ids + input_ids`` is always the joint encoding. Image features of a processor
    come back as ``prompt_pixel_values`` / ``prompt_pixel_attention_mask``.
    """
    full = _tokenize_without_specials(prompt + answer, images, processor, tokenizer)
    prompt_ids = _tokenize_without_specials(prompt, images, processor, tokenizer)["input_ids"]
    split = len(prompt_ids)
    if prompt_ids != full["input_ids"][:split]:
        split -= 1
    result = {
        "prompt_input_ids": full["input_ids"][:split], "prompt_attention_mask": full["attention_mask"][:split],
        "input_ids": full["input_ids"][split:], "attention_mask": full["attention_mask"][split:],
    }
    for key in ("pixel_values", "pixel_attention_mask"):
        if key in full:
            result[f"prompt_{key}"] = full[key]
    return result


def _truncate_tokens(chosen_tokens: list[dict], rejected_tokens: list[dict], prompt_tokens: list[dict], args: Any) -> None:
    """TRL 0.11 helper, in place: per row, cut too-long prompts to ``args.max_prompt_length`` (from the end
    ``truncation_mode`` names), then too-long responses to ``args.max_length - args.max_prompt_length``."""
    if args.truncation_mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {args.truncation_mode!r}")
    keep_prompt = (
        slice(None, args.max_prompt_length) if args.truncation_mode == "keep_start" else slice(-args.max_prompt_length, None)
    )
    keep_response = slice(None, args.max_length - args.max_prompt_length)
    for chosen, rejected, prompt in zip(chosen_tokens, rejected_tokens, prompt_tokens):
        longer = max(len(chosen["input_ids"]), len(rejected["input_ids"]))
        for tokens in (chosen, rejected, prompt):
            if len(tokens["prompt_input_ids"]) + longer > args.max_length:
                for key in ("prompt_input_ids", "prompt_attention_mask"):
                    tokens[key] = tokens[key][keep_prompt]
        for tokens in (chosen, rejected):
            if len(tokens["prompt_input_ids"]) + longer > args.max_length:
                for key in ("input_ids", "attention_mask"):
                    tokens[key] = tokens[key][keep_response]


def concatenate_pairs(
    batch: Mapping[str, Any], padding_value: int, label_pad_token_id: int, is_encoder_decoder: bool = False
) -> dict[str, torch.Tensor]:
    """Stack chosen over rejected, padded on the right to one length: (2B, T) ids, mask and labels.

    For an encoder-decoder only the labels (decoder targets, (2B, L)) are stacked; the encoder's input is the
    prompt, repeated: ids and mask (2B, P), as TRL 0.11.4's ``concatenated_inputs``.
    """
    out = {}
    fields = (("labels", label_pad_token_id),) if is_encoder_decoder else (
        ("input_ids", padding_value), ("attention_mask", 0), ("labels", label_pad_token_id))
    for field, value in fields:
        chosen, rejected = batch[f"chosen_{field}"], batch[f"rejected_{field}"]  # (B, Tc), (B, Tr)
        width = max(chosen.shape[1], rejected.shape[1])
        rows = [pad_right(t, width, value) for t in (chosen, rejected)]
        out[f"concatenated_{field}"] = torch.cat(rows, dim=0)  # (2B, T)
    if is_encoder_decoder:
        out["concatenated_input_ids"] = batch["prompt_input_ids"].repeat(2, 1)  # (2B, P)
        out["concatenated_attention_mask"] = batch["prompt_attention_mask"].repeat(2, 1)  # (2B, P)
    return out


def pad_right(tensor: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """Pad (B, T) on the right to (B, width) with ``value``."""
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[1]), value=value)


def response_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, label_pad_token_id: int = IGNORE_INDEX, is_encoder_decoder: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each labelled token and the mask of those tokens: logits (B, T, V), labels (B, T) ->
    (B, T-1) each for a causal LM (position t scores token t+1), (B, T) each for an encoder-decoder's decoder
    (its logits are already aligned with its labels)."""
    safe_ids = labels.masked_fill(labels == label_pad_token_id, 0)  # (B, T): any valid id under the mask
    if is_encoder_decoder:
        return logprobs_from_logits(logits, safe_ids), labels != label_pad_token_id  # (B, T), (B, T)
    return shifted_token_logprobs(logits, safe_ids), labels[:, 1:] != label_pad_token_id  # (B, T-1), (B, T-1)


def response_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, label_pad_token_id: int = IGNORE_INDEX, average: bool = False,
    is_encoder_decoder: bool = False,
) -> torch.Tensor:
    """Summed (or mean) log-prob of the labelled tokens: logits (B, T, V), labels (B, T) -> (B,)."""
    token_logps, response_mask = response_token_logprobs(logits, labels, label_pad_token_id, is_encoder_decoder)
    return sequence_logprobs(token_logps, response_mask, average=average)  # (B,)


def pair_batch(inputs: Mapping[str, torch.Tensor], label_pad_token_id: int = IGNORE_INDEX,
               is_encoder_decoder: bool = False) -> ModelBatch:
    """``concatenate_pairs``'s output as the shared forward's ``ModelBatch``: every labelled token scored.

    Causal LM: slot t (t < T-1) is the token at t + 1, scored at position t (2B, T-1). Encoder-decoder: slot t
    is label t, scored at decoder position t (2B, L); the model gets the labels and shifts them itself. The mask
    is 1 where the label is not ``label_pad_token_id`` (prompt and padding are not scored).
    """
    labels = inputs["concatenated_labels"]  # (2B, T)
    model_inputs = {"input_ids": inputs["concatenated_input_ids"],
                    "attention_mask": inputs["concatenated_attention_mask"]}
    if is_encoder_decoder:
        model_inputs["labels"] = labels
    scored = labels if is_encoder_decoder else labels[:, 1:]  # (2B, T') the label each scoring position predicts
    index = torch.arange(scored.shape[1], device=labels.device).expand(scored.shape[0], -1)  # (2B, T')
    return ModelBatch(model_inputs=model_inputs, response_index=index,
                      response_tokens=scored.masked_fill(scored == label_pad_token_id, 0),  # any valid id there
                      response_mask=(scored != label_pad_token_id).float(),
                      token_ids_key="labels" if is_encoder_decoder else "input_ids")


# --------------------------------------------------------------------------------------------
# trainer
# --------------------------------------------------------------------------------------------


class DPOTrainer(StoredMetricsMixin, RlhfTrainerMixin, Trainer):
    """Direct Preference Optimisation with the classic TRL arguments (``tokenizer=`` accepted)."""

    trainer_name = "dpo"
    _tag_names = ["trl", "dpo"]

    def __init__(
        self,
        model: Any = None,
        ref_model: Any = None,
        beta: float = 0.1,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        label_pad_token_id: int = IGNORE_INDEX,
        padding_value: int = 0,
        truncation_mode: str = "keep_end",
        train_dataset: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        model_init: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        max_length: int | None = None,
        max_prompt_length: int | None = None,
        peft_config: Any = None,
        disable_dropout: bool = True,
        generate_during_eval: bool = False,
        compute_metrics: Callable | None = None,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reference_free: bool = False,
        precompute_ref_log_probs: bool = False,
        model_init_kwargs: Mapping[str, Any] | None = None,
        ref_model_init_kwargs: Mapping[str, Any] | None = None,
        max_target_length: int | None = None,
        is_encoder_decoder: bool | None = None,
        dataset_num_proc: int | None = None,
        force_use_ref_model: bool = False,
        processing_class: Any = None,
        **tracking: Unpack[TrackingOptions],
    ) -> None:
        tracking = check_tracking(type(self).__name__, tracking)
        args = default_training_args(args, self.trainer_name, DPOConfig)
        keywords = dict(
            beta=beta, label_pad_token_id=label_pad_token_id, padding_value=padding_value,
            truncation_mode=truncation_mode, max_length=max_length, max_prompt_length=max_prompt_length,
            disable_dropout=disable_dropout, generate_during_eval=generate_during_eval, loss_type=loss_type,
            label_smoothing=label_smoothing, reference_free=reference_free,
            precompute_ref_log_probs=precompute_ref_log_probs, model_init_kwargs=model_init_kwargs,
            ref_model_init_kwargs=ref_model_init_kwargs, max_completion_length=max_target_length,
            is_encoder_decoder=is_encoder_decoder, dataset_num_proc=dataset_num_proc,
            force_use_ref_model=force_use_ref_model,
        )
        defaults = keyword_defaults(DPOTrainer.__init__, [k for k in DPO_CONFIG_KEYWORDS if k != "max_completion_length"])
        o = merge_config_fields(args, DPOConfig, keywords, {**defaults, "max_completion_length": None})
        # none given: the one saved beside a model given by name/path (TRL 1.x's DPOTrainer("Qwen/...") does this)
        tokenizer = load_tokenizer_for(model, resolve_processing_class(tokenizer, processing_class))
        if tokenizer is None:
            raise ValueError("DPOTrainer needs tokenizer= (or processing_class=), or a model name/path to load one "
                             "from, to tokenise prompt/chosen/rejected")
        self._check_options(o["beta"], o["loss_type"], o["label_smoothing"], o["truncation_mode"])
        self._check_sample_logging(o["generate_during_eval"], tracking.get("log_with"), tracking.get("tracker"))
        self.rpo_alpha, self.sync_ref_model, mixup_alpha, sync_steps = self._extensions_of(args)
        model, reference = self._policy_and_reference(model, ref_model, model_init, peft_config, o)
        ref_model, self.use_peft_reference = reference.model, reference.adapter_off
        self.is_encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        self._check_reference_sync(ref_model, model, o["precompute_ref_log_probs"])
        if o["disable_dropout"]:
            disable_dropout_in_model(model)
            disable_dropout_in_model(ref_model)
        self.ref_model = ref_model
        self.beta, self.loss_type, self.label_smoothing = o["beta"], o["loss_type"], o["label_smoothing"]
        self.f_divergence_type, self.f_divergence_params = self._f_divergence_of(args)
        self.reference_free, self.generate_during_eval = o["reference_free"], o["generate_during_eval"]
        self.label_pad_token_id, self.truncation_mode = o["label_pad_token_id"], o["truncation_mode"]
        # The spec's keyword default is 0; DPOConfig's None means the tokenizer's pad token (as in TRL 0.11). Without
        # one the default collator refuses the first batch in TRL 0.11.4's words (a custom collator pads as it likes).
        pad_id = o["padding_value"] if o["padding_value"] is not None else tokenizer.pad_token_id
        self.padding_value = pad_id if pad_id is not None else 0
        self._set_lengths(o["max_length"], o["max_prompt_length"], o["max_completion_length"])
        self._row_tokenizer, self.dataset_num_proc = tokenizer, o["dataset_num_proc"]
        train_dataset = self._tokenize_dataset(train_dataset)
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: self._tokenize_dataset(v) for k, v in eval_dataset.items()}
        else:
            eval_dataset = self._tokenize_dataset(eval_dataset)
        if data_collator is None:
            data_collator = DPODataCollatorWithPadding(pad_id, self.label_pad_token_id, self.is_encoder_decoder)
        args, self._eval_strategy_without_data = without_eval_strategy(args, eval_dataset)  # TRL 0.11 accepts it
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=tokenizer,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.model_accepts_loss_kwargs = False  # the DPO loss is a per-pair mean
        self._stored_metrics: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        # BCO's shift: the running mean of every batch-mean implicit reward so far (TRL 0.11.4's ``running``)
        self.running = RunningMoments(self.accelerator) if self.loss_type == "bco_pair" else None
        if self.ref_model is not None:
            self.ref_model.to(self.args.device)
        if self.sync_ref_model:
            self.add_callback(SyncRefModelCallback(self.ref_model, mixup_alpha, sync_steps, self.accelerator))
        self.precompute_ref_log_probs = o["precompute_ref_log_probs"]
        if self.precompute_ref_log_probs:
            self._precompute_all_reference_logps()
        self._tag_model()
        self._setup_tracking(**tracking)

    # ---- setup ---------------------------------------------------------------------------

    @staticmethod
    def _extensions_of(args: TrainingArguments) -> tuple[float | None, bool, float, int]:
        """``(rpo_alpha, sync_ref_model, ref_model_mixup_alpha, ref_model_sync_steps)`` of a ``DPOConfig``
        (checked), or RPO and TR-DPO off for plain ``TrainingArguments``."""
        values = (getattr(args, "rpo_alpha", None), bool(getattr(args, "sync_ref_model", False)),
                  getattr(args, "ref_model_mixup_alpha", 0.9), getattr(args, "ref_model_sync_steps", 64))
        check_dpo_extensions(*values)  # again: the fields may have been changed after the config was built
        return values

    def _policy_and_reference(
        self, model: Any, ref_model: Any, model_init: Callable | None, peft_config: Any, o: Mapping[str, Any]
    ) -> tuple[nn.Module, Reference]:
        """The policy (loaded, PEFT-wrapped) and the reference model: the one given, a frozen copy of the policy,
        or None (the PEFT policy with its adapter disabled, or ``reference_free``).

        As TRL 0.11.4: a policy that is already a ``PeftModel`` is merged into its base before ``peft_config``
        wraps it afresh, and ``ref_model`` together with ``peft_config`` needs ``force_use_ref_model``.
        """
        model_init_kwargs = checked_init_kwargs(o["model_init_kwargs"], "DPOConfig")
        ref_model_init_kwargs = checked_init_kwargs(o["ref_model_init_kwargs"], "DPOConfig", "ref_model_init_kwargs")
        if model is None and model_init is not None:
            model = model_init()  # the policy is built once: the reference model and tokenised data depend on it
        if model is None:
            raise ValueError("DPOTrainer needs model= (a causal LM, a name or a path) or model_init= (a callable)")
        model = load_model(model, AutoModelForCausalLM, model_init_kwargs)
        ref_model = load_model(ref_model, AutoModelForCausalLM, ref_model_init_kwargs)
        if ref_model is not None and ref_model is model:
            raise ValueError("ref_model is model: pass a separate reference model, or ref_model=None for a frozen copy")
        if peft_config is not None and ref_model is not None and not o["force_use_ref_model"]:
            raise ValueError(
                "You passed both a ref_model and a peft_config. For training PEFT adapters with DPO there is no need "
                "to pass a reference model. Please pass `ref_model=None` in case you want to train PEFT adapters, or "
                "pass a ref_model with `force_use_ref_model=True` in DPOTrainer's init if you want to use a different "
                "ref_model."
            )
        if peft_config is not None and is_peft_model(model):
            model = model.merge_and_unload()  # its adapter becomes part of the base that peft_config adapts
        model = wrap_peft(model, peft_config)
        return model, decide_reference(model, ref_model, needed=not o["reference_free"])

    def _check_reference_sync(self, ref_model: nn.Module | None, model: nn.Module, precompute_ref_log_probs: bool) -> None:
        """TR-DPO needs a reference model of its own to move (TRL 0.11.4's refusals, plus one for a PEFT policy)."""
        if not self.sync_ref_model:
            return
        if precompute_ref_log_probs:
            raise ValueError("You cannot use `precompute_ref_log_probs=True` with TR-DPO method. Please set "
                             "`precompute_ref_log_probs=False`.")
        if ref_model is None:
            raise ValueError("You currently cannot use `ref_model=None` with TR-DPO method. Please provide `ref_model`."
                             " (rlhf_core: a PEFT policy's reference is its disabled adapter, and reference_free has "
                             "none: neither can follow the policy.)")
        if is_peft_model(model):
            raise ValueError("sync_ref_model=True with a PEFT policy is not supported by rlhf_core: the reference would "
                             "have to follow the merged adapter weights, and TRL 0.11.4 pairs the adapter's parameters "
                             "with the reference's by position (mixing LoRA matrices into unrelated weights)")

    def _set_lengths(self, max_length: int | None, max_prompt_length: int | None, max_completion_length: int | None) -> None:
        """Token budgets: prompt + response (decoder-only), prompt and completion (encoder-decoder)."""
        self.max_length = max_length or DEFAULT_MAX_LENGTH
        self.max_prompt_length = max_prompt_length or min(DEFAULT_MAX_PROMPT_LENGTH, self.max_length // 2)
        self.max_completion_length = max_completion_length
        if self.is_encoder_decoder:
            self.max_prompt_length = max_prompt_length or DEFAULT_MAX_PROMPT_LENGTH
            self.max_completion_length = max_completion_length or DEFAULT_MAX_COMPLETION_LENGTH
        elif self.max_prompt_length >= self.max_length:
            raise ValueError(f"max_prompt_length ({self.max_prompt_length}) must be < max_length ({self.max_length})")

    @staticmethod
    def _check_sample_logging(generate_during_eval: bool, log_with: Any, tracker: Any) -> None:
        """``generate_during_eval`` logs a samples table: to the rlhf_core tracker given (``log_with=`` or
        ``tracker=``), else to Weights and Biases as in TRL 0.11, which must then be installed."""
        if generate_during_eval and log_with is None and tracker is None and not is_wandb_available():
            raise ValueError(
                "`generate_during_eval=True` requires Weights and Biases to be installed. Please install `wandb` "
                "to resolve. (Or pass log_with= / tracker= an rlhf_core tracker to receive the samples table.)"
            )

    @staticmethod
    def _f_divergence_of(args: TrainingArguments) -> tuple[str, dict[str, float]]:
        """The f-divergence type (its string value) and ``{"alpha_divergence_coef": alpha}`` (TRL 0.11's
        attributes) from a ``DPOConfig``; reverse KL for plain ``TrainingArguments``."""
        kind = FDivergenceType(getattr(args, "f_divergence_type", FDivergenceType.REVERSE_KL)).value
        alpha = float(getattr(args, "f_alpha_divergence_coef", 1.0))
        if kind == FDivergenceType.ALPHA_DIVERGENCE.value and alpha == 0:
            raise ValueError("DPOConfig.f_alpha_divergence_coef must be non-zero with f_divergence_type='alpha_divergence'")
        return kind, {"alpha_divergence_coef": alpha}

    @staticmethod
    def _check_options(beta: float, loss_type: str, label_smoothing: float, truncation_mode: str) -> None:
        """Reject unknown loss types, truncation modes and out-of-range beta / label smoothing early."""
        if loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {DPO_LOSS_TYPES}, got {loss_type!r}")
        if truncation_mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation_mode must be one of {TRUNCATION_MODES}, got {truncation_mode!r}")
        if beta <= 0:
            raise ValueError(f"beta must be > 0, got {beta}")
        if not 0.0 <= label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
        if label_smoothing > 0 and loss_type not in DPO_SMOOTHED_LOSS_TYPES:
            warnings.warn("You are using a loss type that does not support label smoothing. Ignoring label_smoothing "
                          f"parameter. (loss_type={loss_type!r})", UserWarning, stacklevel=3)

    def tokenize_row(self, feature: Mapping[str, str]) -> dict[str, list[int]]:
        """Tokenise one prompt/chosen/rejected row with this trainer's lengths and truncation mode."""
        if self.is_encoder_decoder:
            return tokenize_dpo_row_encoder_decoder(
                feature, self._row_tokenizer, self.max_prompt_length, self.max_completion_length
            )
        return tokenize_dpo_row(
            feature, self._row_tokenizer, self.max_length, self.max_prompt_length, self.truncation_mode,
            self.label_pad_token_id,
        )

    def _tokenize_dataset(self, dataset: Any) -> Any:
        """Tokenise a text dataset (already tokenised or non-HF datasets pass through)."""
        if dataset is None or not hasattr(dataset, "column_names"):
            return dataset
        columns = set(dataset.column_names)
        if set(ENCODER_DECODER_TOKEN_COLUMNS if self.is_encoder_decoder else DPO_TOKEN_COLUMNS) <= columns:
            return dataset
        dataset = self._render_conversations(dataset)
        columns = set(dataset.column_names)
        missing = [c for c in DPO_TEXT_COLUMNS if c not in columns]
        if missing:
            raise ValueError(f"DPO dataset is missing the columns {missing}; found {sorted(columns)}")
        return dataset.map(self.tokenize_row, num_proc=self.dataset_num_proc)

    def _render_conversations(self, dataset: Any) -> Any:
        """As TRL 0.11.4's DPOTrainer before tokenising: an implicit prompt made explicit (``maybe_extract_prompt``)
        and conversational rows rendered with the tokenizer's chat template (``maybe_apply_chat_template``). Rows
        with a string ``prompt`` and string ``chosen`` are not mapped at all (their dataset stays as it was)."""
        columns = set(dataset.column_names)
        first = next(iter(dataset), None) if {"chosen", "rejected"} <= columns else None  # streamed data too
        if first is None:
            return dataset
        chat = is_conversational({"chosen": first["chosen"]}) or is_conversational({"prompt": first.get("prompt")})
        if "prompt" in columns and not chat:
            return dataset
        dataset = dataset.map(maybe_extract_prompt, num_proc=self.dataset_num_proc)
        return dataset.map(maybe_apply_chat_template, fn_kwargs={"tokenizer": self._row_tokenizer},
                           num_proc=self.dataset_num_proc)

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the DPO columns (the model's forward signature does not name them)."""
        if self._signature_columns is None:
            self._signature_columns = [*DPO_TOKEN_COLUMNS, *REFERENCE_COLUMNS, *DPO_TEXT_COLUMNS]

    # ---- forward passes -------------------------------------------------------------------

    def concatenated_inputs(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """``[chosen; rejected]`` ids, attention mask and labels, each (2B, T) (encoder-decoder: the prompt twice
        as ids and mask (2B, P), the responses as labels (2B, L))."""
        return concatenate_pairs(batch, self.padding_value, self.label_pad_token_id, self.is_encoder_decoder)

    def concatenated_forward(
        self, model: nn.Module, batch: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward pass over chosen and rejected: their log-probs (B,) each, logits (B, T', V) each and the
        chosen responses' token-mean negative log-likelihood () (RPO's term), as TRL 0.11.4's five outputs.

        The logits are those of the positions that score a token, in the model's dtype: T' = T - 1 for a causal
        LM (TRL 0.11.4 also returns the last position, which scores nothing), T' = L for an encoder-decoder,
        which reads the prompt and gets the responses as ``labels`` (it shifts them into its decoder inputs
        itself; its logits are aligned with the labels, without the causal shift). Training computes no logits
        copy: ``get_batch_loss_metrics`` uses the shared forward directly.
        """
        forward, mask = self._pair_forward(model, batch, logits=True)
        chosen_logps, rejected_logps, nll_loss = self._pair_logps(forward, mask)
        chosen_logits, rejected_logits = forward.logits.chunk(2)
        return chosen_logps, rejected_logps, chosen_logits, rejected_logits, nll_loss

    def _pair_forward(self, model: nn.Module, batch: Mapping[str, Any], **options: bool
                      ) -> tuple[ResponseForward, torch.Tensor]:
        """The shared response forward (``forward.response_forward``, every position: ``positions="all"``) over
        ``[chosen; rejected]``: per-token outputs (2B, T') and the mask of the labelled tokens (2B, T')."""
        pairs = pair_batch(self.concatenated_inputs(batch), self.label_pad_token_id, self.is_encoder_decoder)
        return response_forward(model, pairs, positions="all", **options), pairs.response_mask

    def _pair_logps(self, forward: ResponseForward, mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Chosen and rejected log-probs (B,) each (token means for ``ipo``) and RPO's chosen NLL ()."""
        logps = sequence_logprobs(forward.logprobs, mask, average=self.loss_type == "ipo")  # (2B,)
        chosen_logps, rejected_logps = logps.chunk(2)
        return chosen_logps, rejected_logps, rpo_nll_loss(forward.logprobs.chunk(2)[0], mask.chunk(2)[0])

    def _reference(self) -> contextlib.AbstractContextManager:
        """Context yielding the reference: the PEFT policy with its adapter disabled, else ``ref_model``."""
        return reference_model(self.accelerator, self.model, self.ref_model, adapter_off=self.use_peft_reference)

    def compute_reference_log_probs(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference log-probs (B,), (B,) of chosen and rejected, without gradients."""
        if self.ref_model is None and not self.use_peft_reference:
            raise ValueError("no reference model: reference_free=True was set without ref_model")
        with torch.no_grad(), self._reference() as reference:
            chosen, rejected, _ = self._pair_logps(*self._pair_forward(reference, batch))
        return chosen, rejected

    def _precompute_all_reference_logps(self) -> None:
        """Add ``reference_chosen_logps``/``reference_rejected_logps`` columns to the train and eval datasets."""
        self.train_dataset = self._with_reference_logps(self.train_dataset)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._with_reference_logps(v) for k, v in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._with_reference_logps(self.eval_dataset)

    def _with_reference_logps(self, dataset: Any) -> Any:
        """``dataset`` with one reference log-prob per row and response (computed once, in order)."""
        if dataset is None or set(REFERENCE_COLUMNS) <= set(dataset.column_names):
            return dataset
        loader = DataLoader(
            dataset, batch_size=self.args.per_device_eval_batch_size, shuffle=False, collate_fn=self.data_collator
        )
        chosen, rejected = [], []
        for batch in loader:
            ref_chosen, ref_rejected = self.compute_reference_log_probs(self._prepare_inputs(batch))
            chosen.append(ref_chosen.float().cpu())
            rejected.append(ref_rejected.float().cpu())
        dataset = dataset.add_column(REFERENCE_COLUMNS[0], torch.cat(chosen).tolist())
        return dataset.add_column(REFERENCE_COLUMNS[1], torch.cat(rejected).tolist())

    # ---- loss and metrics ----------------------------------------------------------------

    def dpo_loss(
        self,
        policy_chosen_logps: torch.Tensor,
        policy_rejected_logps: torch.Tensor,
        reference_chosen_logps: torch.Tensor,
        reference_rejected_logps: torch.Tensor,
        reference_free: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(losses, chosen_rewards, rejected_rewards), each (B,), with this trainer's beta, loss type and
        f-divergence.

        ``bco_pair`` first folds this batch's mean implicit reward into the running mean (every call, in training
        and evaluation alike, as TRL 0.11.4) and shifts the rewards by the updated mean.
        """
        reference_free = reference_free or self.reference_free
        delta = None
        if self.loss_type == "bco_pair":
            ref_chosen, ref_rejected = (0, 0) if reference_free else (reference_chosen_logps, reference_rejected_logps)
            self.running.update(bco_batch_reward(
                policy_chosen_logps - ref_chosen, policy_rejected_logps - ref_rejected, self.beta
            ))
            delta = self.running.mean
        return dpo_loss(
            policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps,
            beta=self.beta, loss_type=self.loss_type, label_smoothing=self.label_smoothing,
            reference_free=reference_free, f_divergence_type=self.f_divergence_type,
            f_alpha_divergence_coef=self.f_divergence_params["alpha_divergence_coef"], bco_delta=delta,
        )

    def _reference_logps_for(self, batch: Mapping[str, Any], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Precomputed, zero (reference-free) or freshly computed reference log-probs (B,), (B,)."""
        if all(key in batch for key in REFERENCE_COLUMNS):
            return batch[REFERENCE_COLUMNS[0]].to(like), batch[REFERENCE_COLUMNS[1]].to(like)
        if self.reference_free:
            return torch.zeros_like(like), torch.zeros_like(like)
        return self.compute_reference_log_probs(batch)

    def get_batch_loss_metrics(
        self, model: nn.Module, batch: Mapping[str, Any], train_eval: str = "train"
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean DPO loss over the batch (plus ``rpo_alpha`` times the chosen NLL with RPO) and its metrics (prefixed
        ``eval_`` in evaluation; ``nll_loss`` with RPO)."""
        forward, mask = self._pair_forward(model, batch, logit_mean=True)
        chosen_logps, rejected_logps, nll_loss = self._pair_logps(forward, mask)
        ref_chosen, ref_rejected = self._reference_logps_for(batch, chosen_logps)
        losses, chosen_rewards, rejected_rewards = self.dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected)
        if self.rpo_alpha is not None:
            losses = losses + self.rpo_alpha * nll_loss  # RPO (arXiv 2404.19733 v3): DPO + alpha * NLL(chosen)
        prefix = "eval_" if train_eval == "eval" else ""
        logit_means, masks = forward.logit_mean.chunk(2), mask.chunk(2)  # (B, T') each: chosen, rejected
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": chosen_logps.detach().mean(),
            "logps/rejected": rejected_logps.detach().mean(),
            "logits/chosen": masked_mean(logit_means[0], masks[0]),  # the mean logit over the response tokens
            "logits/rejected": masked_mean(logit_means[1], masks[1]),
        }
        if self.rpo_alpha is not None:
            metrics["nll_loss"] = nll_loss.detach()
        self._last_rewards = torch.stack([chosen_rewards, rejected_rewards], dim=1)  # (B, 2)
        values = torch.stack([v.detach().float() for v in metrics.values()])  # (8,) or (9,)
        if self.accelerator.num_processes > 1:
            # each rank holds its own shard of the batch: average over ranks so every rank stores (and rank 0
            # logs) the metrics of the whole batch, as the Trainer does for the loss. Every rank runs this
            # method once per train/eval step, so the collective cannot hang.
            values = self.accelerator.reduce(values, reduction="mean")
        return losses.mean(), {prefix + k: float(v) for k, v in zip(metrics, values.cpu())}

    # classic TRL 0.7 name of the same method
    get_batch_metrics = get_batch_loss_metrics

    def _prediction_outputs(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``prediction_step``'s per-pair implicit rewards (B, 2) [chosen, rejected] and dummy labels (B,)."""
        rewards = self._last_rewards.detach()  # (B, 2)
        return rewards, torch.zeros(rewards.shape[0], device=rewards.device)

    # ---- sampling ------------------------------------------------------------------------

    def get_batch_samples(self, *args: Any, **kwargs: Any) -> Any:
        """Spec form ``get_batch_samples(model, batch)``: generate from policy and reference.

        transformers 5's Trainer uses the same name for ``(epoch_iterator, num_batches, device)``;
        that form is passed through to it.
        """
        if (args and isinstance(args[0], nn.Module)) or "model" in kwargs or "batch" in kwargs:
            return self.generate_from_model_and_ref(*args, **kwargs)
        return super().get_batch_samples(*args, **kwargs)

    def generate_from_model_and_ref(self, model: nn.Module, batch: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """Decoded prompt + sample (up to ``max_length`` tokens) from the policy and from the reference."""
        tokenizer = self.processing_class
        gen_kwargs = dict(
            input_ids=batch["prompt_input_ids"], attention_mask=batch["prompt_attention_mask"],
            max_length=self.max_length, do_sample=True, pad_token_id=tokenizer.pad_token_id,
        )
        policy = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            policy_out = policy.generate(**gen_kwargs)  # (B, T')
            if self.ref_model is None and not self.use_peft_reference:
                raise ValueError("no reference model to sample from (reference_free=True without ref_model)")
            with self._reference() as reference:
                reference_out = self.accelerator.unwrap_model(reference).generate(**gen_kwargs)
        decode = lambda out: tokenizer.batch_decode(out, skip_special_tokens=True)  # noqa: E731
        return decode(policy_out), decode(reference_out)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        """Usual evaluation; with ``generate_during_eval`` also a table of policy/reference samples for one batch."""
        if self.generate_during_eval:
            batch = self._prepare_inputs(next(iter(self.get_eval_dataloader(eval_dataset))))
            policy, reference = self.generate_from_model_and_ref(self.model, batch)
            rows = [[p, pol, ref] for p, pol, ref in zip(batch.get("prompt", [""] * len(policy)), policy, reference)]
            self.tracker.log_table("game_log", ["Prompt", "Policy", "Ref Model"], rows, step=self.state.global_step)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ---- resume: BCO's running mean and TR-DPO's moving reference ---------------------------

    def _save_extra_state(self, directory: Path) -> None:
        """Training state of DPO beyond the policy: BCO's running mean, the reference that TR-DPO moved."""
        if self.running is not None:
            ckpt.write_json(directory / BCO_STATE_FILE, self.running.state_dict())
        if self.sync_ref_model:
            save_model(self.accelerator.unwrap_model(self.ref_model), str(directory / SYNCED_REFERENCE_FILE))

    def _load_extra_state(self, directory: Path) -> None:
        """Restore ``_save_extra_state``'s files; a checkpoint without them (written by transformers itself, in a
        multi-process run) leaves the running mean or the reference as built, with a warning."""
        for wanted, name in ((self.running is not None, BCO_STATE_FILE), (self.sync_ref_model, SYNCED_REFERENCE_FILE)):
            if wanted and not (directory / name).is_file():
                warnings.warn(f"{directory} has no {name}: resuming with the state this trainer was built with",
                              UserWarning, stacklevel=3)
            elif wanted and name == BCO_STATE_FILE:
                self.running.load_state_dict(ckpt.read_json(directory / name))
            elif wanted:
                load_model_weights(self.accelerator.unwrap_model(self.ref_model), str(directory / name))

    def card_hyperparameters(self) -> dict[str, Any]:
        """Trainer arguments plus DPO's own."""
        extra = {
            "beta": self.beta, "loss_type": self.loss_type, "label_smoothing": self.label_smoothing,
            "reference_free": self.reference_free, "f_divergence_type": self.f_divergence_type,
            "max_length": self.max_length,
            "max_prompt_length": self.max_prompt_length, "truncation_mode": self.truncation_mode,
        }
        if self.rpo_alpha is not None:  # only when on: a plain DPO run's card stays as it was
            extra["rpo_alpha"] = self.rpo_alpha
        if self.sync_ref_model:
            extra.update(ref_model_mixup_alpha=self.args.ref_model_mixup_alpha,
                         ref_model_sync_steps=self.args.ref_model_sync_steps)
        return {**super().card_hyperparameters(), **extra}
