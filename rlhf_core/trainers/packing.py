"""Packed forward passes: the rows of a padded causal batch as one sequence without padding.

A padded (b, T) batch spends every layer's matmuls on padding columns (on the PPO benchmark's lengths about
a sixth of all tokens) and the LM head on every kept position. Packed, the real tokens of all rows are
concatenated into one (1, N) sequence whose position ids restart at 0 for each row; transformers then builds
a block-diagonal causal mask from those position ids (``masking_utils.find_packed_sequence_indices``), so no
token attends across rows, and ``logits_to_keep`` given as a tensor of positions computes the LM head only
where a response token is scored (M <= b x A rows). Each token sees exactly the keys and positions it sees in
the padded layout: the outputs are the same numbers up to float summation order (tests/test_packing.py
bounds the difference).

Used by ``forward.response_forward`` for decoder-only models whose forward takes ``logits_to_keep``
(``rlhf_core.models.unwrap.language_model``), where it pays (``packing_pays``) and the model's attention honours
packed position ids (``forward.packing_works``); encoder-decoders, prompt-learning adapters and batches from a
custom collator keep the padded path. This module only lays rows out; it runs no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf_core.trainers.experience import ModelBatch, to_device


@dataclass(kw_only=True)
class PackedRows:
    """A causal ``ModelBatch`` of b rows packed into one sequence of N real tokens."""

    input_ids: torch.Tensor
    """(1, N) the real tokens of every row, row after row."""
    position_ids: torch.Tensor
    """(1, N) each token's position inside its own row (0 at every row start)."""
    score_positions: torch.Tensor
    """(M,) packed position whose logits score a real response token (token at position + 1)."""
    slot_rows: torch.Tensor
    """(M,) the row of each scored token in the (b, A) layout."""
    slot_cols: torch.Tensor
    """(M,) its response slot a in the (b, A) layout."""
    segments: torch.Tensor
    """(N,) the row each packed token comes from."""


def can_pack(batch: ModelBatch) -> bool:
    """True for a decoder-only batch of ids, attention mask and position ids only (nothing else to pack)."""
    return batch.token_ids_key == "input_ids" and set(batch.model_inputs) == {"input_ids", "attention_mask",
                                                                              "position_ids"}


def packing_pays(batch: ModelBatch, config: Any) -> bool:
    """True when the packed forward needs fewer FLOPs than the padded one (``config``: the LM's config).

    Packing drops the padding columns from every layer and the unscored rows from the LM head, but the mask
    of one long sequence makes attention quadratic in all N tokens instead of per row: for many or long rows
    the padded layout is cheaper. Per-token FLOPs: 24 L H^2 (projections and MLP) + 4 L H x keys (attention);
    per LM-head row: 2 H V. Decided on the host layout (no device read).
    """
    layers, hidden, vocab = (getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, vocab)):
        return False
    layout = batch.layout()
    mask = layout.masks["attention_mask"]  # (b, T)
    rows, width = mask.shape
    tokens, scored = int(mask.sum()), int(batch.response_mask.numel())
    kept = rows * (width - int(layout.response_index.min()))  # the padded path's logits_to_keep rows
    padded = rows * width * (24 * layers * hidden ** 2 + 4 * layers * hidden * width) + kept * 2 * hidden * vocab
    packed = tokens * (24 * layers * hidden ** 2 + 4 * layers * hidden * tokens) + scored * 2 * hidden * vocab
    return packed < padded


def pack_rows(batch: ModelBatch) -> PackedRows:
    """Pack the real tokens of ``batch`` (each row's real tokens contiguous, padded on either side).

    Every index is computed on the host layout and copied to the device once: no device read.
    """
    layout = batch.layout()
    mask, index = layout.masks["attention_mask"], layout.response_index  # (b, T), (b, A)
    lengths = mask.sum(1)  # (b,) real tokens per row
    first = mask.argmax(1)  # (b,) column of the first real token
    # Slot a is a real response token when the token it scores (column index + 1) is inside the row: the
    # response is the tail of the row's real tokens, so a < (last real column) - (first scored column).
    response_len = first + lengths - 1 - index[:, 0]  # (b,)
    slots = np.arange(index.shape[1])[None, :] < response_len[:, None]  # (b, A)
    offsets = np.cumsum(lengths) - lengths  # (b,) packed position of each row's first real token
    slot_rows, slot_cols = slots.nonzero()  # (M,), (M,) row-major: row by row, slot by slot
    score_positions = offsets[slot_rows] + index[slot_rows, slot_cols] - first[slot_rows]  # (M,)
    device = batch.response_index.device
    real = to_device(np.flatnonzero(mask), device)  # (N,) flat (b x T) places of the real tokens, row-major
    return PackedRows(input_ids=batch.model_inputs["input_ids"].reshape(-1)[real][None, :],
                      position_ids=batch.model_inputs["position_ids"].reshape(-1)[real][None, :],
                      score_positions=to_device(score_positions, device), slot_rows=to_device(slot_rows, device),
                      slot_cols=to_device(slot_cols, device),
                      segments=to_device(np.repeat(np.arange(len(lengths)), lengths), device))


def unpack_slots(values: torch.Tensor, packed: PackedRows, shape: tuple[int, int]) -> torch.Tensor:
    """Per-scored-token ``values`` (M, ...) placed in the (b, A, ...) response layout, 0 on padding slots."""
    out = values.new_zeros((*shape, *values.shape[1:]))
    return out.index_put((packed.slot_rows, packed.slot_cols), values)  # out of place: differentiable
