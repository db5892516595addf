"""Data collators for SFT, reward and DPO training, and the packing ``ConstantLengthDataset``.

Shapes: ``B`` batch, ``T`` sequence. Labels equal to ``ignore_index`` (-100) carry no loss.
Preference collators stack nothing themselves: the trainers concatenate ``[chosen; rejected]``
along dim 0, so chosen and rejected are padded to one common length here.
"""

from __future__ import annotations

import copy

import logging
import math
import numbers
import random
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------
# input checks: malformed features get a ValueError naming the row and column, before any tensor op
# --------------------------------------------------------------------------------------------


def check_features(features: Any, what: str) -> None:
    """``features`` must be a non-empty sequence of mappings (one per example)."""
    if isinstance(features, (str, bytes, Mapping)) or not isinstance(features, Sequence):
        raise ValueError(f"{what} collator expects a list of feature dicts, got {type(features).__name__}")
    if len(features) == 0:
        raise ValueError(f"{what} collator got an empty batch (no features)")
    for i, feature in enumerate(features):
        if not isinstance(feature, Mapping):
            raise ValueError(f"{what} feature {i} must be a dict of columns, got {type(feature).__name__}")


def check_token_row(
    value: Any, where: str, allowed_negative: tuple[int, ...] = (), allow_empty: bool = True
) -> list[int]:
    """A list of non-negative integer token ids (``allowed_negative`` e.g. the label pad id)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{where} must be a 1-d sequence of token ids, got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValueError(f"{where} must be a list of token ids, got {type(value).__name__}")
    row = list(value)
    for token in row:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"{where} must hold integer token ids, got {token!r} ({type(token).__name__})")
        if token < 0 and token not in allowed_negative:
            raise ValueError(f"{where} holds a negative token id ({token})")
    if not row and not allow_empty:
        raise ValueError(f"{where} is empty: every sequence needs at least one token")
    return [int(t) for t in row]


def check_mask_row(value: Any, where: str, length: int) -> list[int]:
    """An attention mask of 0/1 values as long as its ids."""
    row = check_token_row(value, where)
    if len(row) != length:
        raise ValueError(f"{where} has {len(row)} entries but its input_ids have {length}")
    if any(v not in (0, 1) for v in row):
        raise ValueError(f"{where} must hold only 0 and 1")
    return row


def check_finite_number(value: Any, where: str) -> float:
    """A finite real number (no NaN, inf, strings or None)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def check_margin(value: Any, where: str) -> float:
    """A reward margin: a finite number, or a one-element list/tensor holding one (as TRL 0.11 datasets store it)."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != 1:
            raise ValueError(f"{where} must be one number (or a one-element list), got {len(value)} values")
        value = value[0]
    return check_finite_number(value, where)


def pad_to_length(
    rows: Sequence[Sequence[int]], value: int, length: int | None = None, side: str = "right"
) -> torch.Tensor:
    """Pad ragged integer rows into a (B, T) LongTensor, on the right or the left."""
    if side not in ("right", "left"):
        raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
    if value is None:
        # a tokenizer's pad_token_id when it has none; torch.full would fail with no word of the tokenizer
        raise ValueError("cannot pad: the tokenizer has no pad token; set one first, "
                         "e.g. tokenizer.pad_token = tokenizer.eos_token")
    width = max([len(r) for r in rows] + [length or 0])
    out = torch.full((len(rows), width), value, dtype=torch.long)  # (B, T)
    for i, row in enumerate(rows):
        if len(row):
            row_t = torch.as_tensor(list(row), dtype=torch.long)
            if side == "right":
                out[i, : len(row)] = row_t
            else:
                out[i, width - len(row):] = row_t
    return out


# --------------------------------------------------------------------------------------------
# SFT: packing and completion-only labels
# --------------------------------------------------------------------------------------------


class ConstantLengthDataset(IterableDataset):
    """Packs tokenised texts, separated by EOS, into blocks of exactly ``seq_length`` tokens.

    Texts are read ``num_of_sequences * seq_length * chars_per_token`` characters at a time, tokenised,
    joined with ``eos_token_id`` and cut into blocks. The tail of one buffer is carried into the next, so
    no text is lost between buffers; at the end of a finite pass only the last tail (< ``seq_length``
    tokens) is dropped. With ``infinite=True`` the dataset restarts and the tail continues into the next pass.
    Each item is ``{"input_ids": (T,), "labels": (T,)}``.
    """

    def __init__(
        self,
        tokenizer: Any,
        dataset: Any,
        dataset_text_field: str | None = None,
        formatting_func: Callable[[Mapping[str, Any]], str] | None = None,
        infinite: bool = False,
        seq_length: int = 1024,
        num_of_sequences: int = 1024,
        chars_per_token: float = 3.6,
        eos_token_id: int | None = None,
        shuffle: bool = False,
        append_concat_token: bool = True,
        add_special_tokens: bool = True,
    ) -> None:
        if dataset_text_field is None and formatting_func is None:
            raise ValueError("ConstantLengthDataset needs dataset_text_field or formatting_func")
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.seq_length = seq_length
        self.infinite = infinite
        self.num_of_sequences = num_of_sequences
        self.chars_per_token = chars_per_token
        self.max_buffer_size = max(1, int(seq_length * chars_per_token * num_of_sequences))
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        if self.eos_token_id is None and append_concat_token:
            raise ValueError("eos_token_id is None: give eos_token_id or a tokenizer with an EOS token")
        self.shuffle = shuffle
        self.append_concat_token = append_concat_token
        self.add_special_tokens = add_special_tokens
        self.formatting_func = formatting_func or (lambda example: example[dataset_text_field])

    def _texts(self) -> Iterator[str]:
        """Formatted texts, once or forever."""
        while True:
            for example in self.dataset:
                yield self.formatting_func(example)
            if not self.infinite:
                return
            logger.info("ConstantLengthDataset: dataset exhausted, restarting (infinite=True)")

    def _buffers(self) -> Iterator[list[str]]:
        """Groups of texts of about ``max_buffer_size`` characters."""
        buffer, size = [], 0
        for text in self._texts():
            buffer.append(text)
            size += len(text)
            if size >= self.max_buffer_size:
                yield buffer
                buffer, size = [], 0
        if buffer:
            yield buffer

    def _token_stream(self, texts: list[str]) -> list[int]:
        """Token ids of ``texts``, each followed by EOS."""
        ids = self.tokenizer(texts, add_special_tokens=self.add_special_tokens, truncation=False)["input_ids"]
        stream: list[int] = []
        for row in ids:
            stream.extend(row)
            if self.append_concat_token:
                stream.append(self.eos_token_id)
        return stream

    def __len__(self) -> int:
        """The number of source texts (as TRL 0.11 reports it), not the number of packed blocks."""
        return len(self.dataset)

    def fills_a_block(self) -> bool:
        """Whether one pass over the texts fills at least one block of ``seq_length`` tokens (reads only as far as
        the first block; ``infinite`` aside)."""
        one_pass = copy.copy(self)
        one_pass.infinite = False
        return next(iter(one_pass), None) is not None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        carry: list[int] = []
        for texts in self._buffers():
            stream = carry + self._token_stream(texts)
            n_full = len(stream) // self.seq_length
            blocks = [stream[i * self.seq_length:(i + 1) * self.seq_length] for i in range(n_full)]
            carry = stream[n_full * self.seq_length:]
            if self.shuffle:
                random.shuffle(blocks)
            for block in blocks:
                ids = torch.tensor(block, dtype=torch.long)  # (T,)
                yield {"input_ids": ids, "labels": ids.clone()}


def _find_subsequence(row: Sequence[int], pattern: Sequence[int], start: int = 0) -> int:
    """Index of the first occurrence of ``pattern`` in ``row`` at or after ``start``, else -1."""
    n = len(pattern)
    for i in range(start, len(row) - n + 1):
        if list(row[i:i + n]) == list(pattern):
            return i
    return -1


class DataCollatorForCompletionOnlyLM:
    """Pads causal-LM examples and puts the loss on the response only.

    Every label up to and including the last ``response_template`` occurrence before the response is set to
    ``ignore_index``; with ``instruction_template`` (multi-turn), each instruction segment is masked too.
    Templates are strings (tokenised without special tokens) or lists of token ids; pass ids when the
    template tokenises differently in context. Rows where the template is missing get no loss, with a warning.
    Rows are padded on the tokenizer's ``padding_side`` (right when it has none).
    """

    def __init__(
        self,
        response_template: str | Sequence[int],
        instruction_template: str | Sequence[int] | None = None,
        *,
        tokenizer: Any,
        mlm: bool = False,
        ignore_index: int = IGNORE_INDEX,
        pad_to_multiple_of: int | None = None,
    ) -> None:
        if mlm:
            raise ValueError("DataCollatorForCompletionOnlyLM is for causal LMs: mlm must be False")
        self.tokenizer = tokenizer
        self.ignore_index = ignore_index
        self.pad_to_multiple_of = pad_to_multiple_of
        self.response_token_ids = self._ids(response_template)
        self.instruction_token_ids = None if instruction_template is None else self._ids(instruction_template)

    def _ids(self, template: str | Sequence[int]) -> list[int]:
        """Token ids of a template given as text or ids."""
        if isinstance(template, str):
            ids = self.tokenizer(template, add_special_tokens=False)["input_ids"]
        else:
            ids = list(template)
        if not ids:
            raise ValueError("response_template/instruction_template tokenises to no tokens")
        return ids

    def _pad(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Pad ``input_ids`` (B, T) on the tokenizer's padding side and build the attention mask."""
        if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence) or not examples:
            raise ValueError("completion-only collator got an empty batch (no examples)")
        for i, e in enumerate(examples):
            if isinstance(e, Mapping) and "input_ids" not in e:
                raise ValueError(f"example {i} has no 'input_ids' column (columns: {sorted(map(str, e))})")
            ids = e["input_ids"] if isinstance(e, Mapping) else e
            check_token_row(ids, f"example {i} input_ids", allow_empty=False)
        rows = [list(e["input_ids"] if isinstance(e, Mapping) else e) for e in examples]
        width = max(len(r) for r in rows)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        if self.tokenizer.pad_token_id is None:
            # as TRL's (its tokenizer.pad refuses); torch.full(..., None) would fail with no word of the tokenizer
            raise ValueError("DataCollatorForCompletionOnlyLM: the tokenizer has no pad token to pad the batch "
                             "with; set one first, e.g. tokenizer.pad_token = tokenizer.eos_token")
        side = self._padding_side()
        input_ids = pad_to_length(rows, self.tokenizer.pad_token_id, width, side)  # (B, T)
        mask = pad_to_length([[1] * len(r) for r in rows], 0, width, side)  # (B, T)
        return {"input_ids": input_ids, "attention_mask": mask}

    def _padding_side(self) -> str:
        """The tokenizer's padding side ('right' when it names none), as TRL 0.11's collator pads."""
        return getattr(self.tokenizer, "padding_side", None) or "right"

    def _response_mask(self, row: Sequence[int]) -> list[int] | None:
        """1 where a token is part of a response, 0 elsewhere; None when no response template is found."""
        keep = [0] * len(row)
        starts = []
        pos = _find_subsequence(row, self.response_token_ids)
        while pos >= 0:
            starts.append(pos + len(self.response_token_ids))
            pos = _find_subsequence(row, self.response_token_ids, pos + 1)
        if not starts:
            return None
        if self.instruction_token_ids is None:
            starts = starts[:1]  # single turn: everything after the first template is the response
        for start in starts:
            end = len(row)
            if self.instruction_token_ids is not None:
                nxt = _find_subsequence(row, self.instruction_token_ids, start)
                end = nxt if nxt >= 0 else len(row)
            for i in range(start, end):
                keep[i] = 1
        return keep

    def __call__(self, examples: Sequence[Any]) -> dict[str, torch.Tensor]:
        batch = self._pad(examples)
        labels = batch["input_ids"].clone()  # (B, T)
        labels[batch["attention_mask"] == 0] = self.ignore_index
        for i, example in enumerate(examples):
            row = list(example["input_ids"] if isinstance(example, Mapping) else example)
            keep = self._response_mask(row)
            if keep is None:
                warnings.warn(
                    f"response_template {self.response_token_ids} not found in example {i}; it gets no loss",
                    stacklevel=2,
                )
                labels[i, :] = self.ignore_index
                continue
            start = labels.shape[1] - len(row) if self._padding_side() == "left" else 0  # first real token
            labels[i, start: start + len(row)][torch.tensor(keep) == 0] = self.ignore_index
        batch["labels"] = labels
        return batch


# --------------------------------------------------------------------------------------------
# preference data
# --------------------------------------------------------------------------------------------


class RewardDataCollatorWithPadding:
    """Pads reward pairs: ``input_ids_chosen``/``attention_mask_chosen`` and the rejected pair, (B, T) each.

    Chosen and rejected are padded to one common length (so the trainer can stack them), on the
    tokenizer's padding side. An optional ``margin`` column (a number or a one-element list per pair)
    becomes a float tensor (B,).
    """

    REQUIRED = ("input_ids_chosen", "attention_mask_chosen", "input_ids_rejected", "attention_mask_rejected")

    def __init__(
        self,
        tokenizer: Any,
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        return_tensors: str = "pt",
    ) -> None:
        if return_tensors != "pt":
            raise ValueError(f"only return_tensors='pt' is supported, got {return_tensors!r}")
        self.tokenizer = tokenizer
        self.padding = padding
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        self._check(features)
        chosen = [list(f["input_ids_chosen"]) for f in features]
        rejected = [list(f["input_ids_rejected"]) for f in features]
        width = max(len(r) for r in chosen + rejected)
        if self.padding == "max_length" and self.max_length:
            width = max(width, self.max_length)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        side = getattr(self.tokenizer, "padding_side", "right")
        pad_id = self.tokenizer.pad_token_id
        masks = {name: [list(f[f"attention_mask_{name}"]) for f in features] for name in ("chosen", "rejected")}
        batch = {
            "input_ids_chosen": pad_to_length(chosen, pad_id, width, side),  # (B, T)
            "attention_mask_chosen": pad_to_length(masks["chosen"], 0, width, side),
            "input_ids_rejected": pad_to_length(rejected, pad_id, width, side),  # (B, T)
            "attention_mask_rejected": pad_to_length(masks["rejected"], 0, width, side),
            "return_loss": True,
        }
        if "margin" in features[0]:
            margins = [check_margin(f["margin"], f"reward feature {i} margin") for i, f in enumerate(features)]
            batch["margin"] = torch.tensor(margins, dtype=torch.float)  # (B,)
        return batch


    def _check(self, features: Any) -> None:
        """Every feature has the four columns, integer ids, 0/1 masks of matching length, a finite margin."""
        check_features(features, "reward")
        has_margin = "margin" in features[0]
        for i, feature in enumerate(features):
            missing = [k for k in self.REQUIRED if k not in feature]
            if missing:
                raise ValueError(f"reward feature {i} is missing the columns {missing}; expected {list(self.REQUIRED)}")
            for name in ("chosen", "rejected"):
                ids = check_token_row(feature[f"input_ids_{name}"], f"reward feature {i} input_ids_{name}",
                                      allow_empty=False)
                check_mask_row(feature[f"attention_mask_{name}"], f"reward feature {i} attention_mask_{name}", len(ids))
            if has_margin:
                if "margin" not in feature:
                    raise ValueError(f"reward feature {i} has no 'margin' column but feature 0 has one")
                check_margin(feature["margin"], f"reward feature {i} margin")


# TRL 0.11.4's words when ids must be padded and the tokenizer has no pad token
NO_PAD_TOKEN_MESSAGE = (
    "Padding is enabled, but the tokenizer is not configured with a padding token. Explicitly set "
    "`tokenizer.pad_token` (e.g. `tokenizer.pad_token = tokenizer.eos_token`) before calling the trainer."
)


class DPODataCollatorWithPadding:
    """Pads tokenised DPO rows (see ``DPOTrainer.tokenize_row``).

    ``*_input_ids`` are padded with ``pad_token_id``, ``*_attention_mask`` with 0 and ``*_labels`` with
    ``label_pad_token_id``; prompts are padded on the left (ready for generation), responses on the right.
    With ``is_encoder_decoder`` (rows of ``prompt_input_ids``/``prompt_attention_mask`` for the encoder and
    ``chosen_labels``/``rejected_labels`` for the decoder) everything is padded on the right, as TRL 0.11.4.
    Text columns (``prompt``, ``chosen``, ``rejected``) pass through as lists; precomputed
    ``reference_*_logps`` become float tensors (B,).
    """

    def __init__(self, pad_token_id: int = 0, label_pad_token_id: int = IGNORE_INDEX, is_encoder_decoder: bool = False):
        self.pad_token_id = pad_token_id
        self.label_pad_token_id = label_pad_token_id
        self.is_encoder_decoder = bool(is_encoder_decoder)

    def _pad_value(self, key: str) -> int:
        """Padding value for one column."""
        if key.endswith("_labels"):
            return self.label_pad_token_id
        if key.endswith("_attention_mask"):
            return 0
        if self.pad_token_id is None:
            raise ValueError(NO_PAD_TOKEN_MESSAGE)
        return self.pad_token_id

    def _check(self, features: Any) -> None:
        """Same columns in every feature; integer ids/labels, 0/1 masks matching their ids, finite log-probs."""
        check_features(features, "DPO")
        columns = set(features[0])
        for i, feature in enumerate(features):
            if set(feature) != columns:
                raise ValueError(f"DPO feature {i} has columns {sorted(feature)}, feature 0 has {sorted(columns)}")
            for key, value in feature.items():
                where = f"DPO feature {i} column {key!r}"
                if key.endswith(("_input_ids", "_labels")):
                    allowed = (self.label_pad_token_id,) if key.endswith("_labels") else ()
                    check_token_row(value, where, allowed_negative=allowed)
                elif key.endswith("_attention_mask"):
                    ids_key = key[: -len("_attention_mask")] + "_input_ids"
                    length = len(check_token_row(feature[ids_key], f"DPO feature {i} column {ids_key!r}")) \
                        if ids_key in feature else len(check_token_row(value, where))
                    check_mask_row(value, where, length)
                elif key.endswith("_logps"):
                    check_finite_number(value, where)

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        self._check(features)
        batch: dict[str, Any] = {}
        for key in features[0]:
            values = [f[key] for f in features]
            if key.endswith(("_input_ids", "_attention_mask", "_labels")):
                side = "left" if key.startswith("prompt") and not self.is_encoder_decoder else "right"
                batch[key] = pad_to_length([list(v) for v in values], self._pad_value(key), side=side)  # (B, T)
            elif key.endswith("_logps"):
                batch[key] = torch.tensor(values, dtype=torch.float)  # (B,)
            else:
                batch[key] = values
        return batch
