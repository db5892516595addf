"""Packed forward passes: the rows of a padded causal batch as one sequence without padding.

A padded (b, T) batch spends every layer's matmuls on padding columns (on the PPO benchmark's lengths about
a sixth of all tokens) and the LM head on every kept position. Packed, the real tokens of all rows are
concatenated into one (1, N) sequence whose position ids restart at 0 for each row; transformers then builds
a block-diagonal causal mask from those position ids (``masking_utils.find_packed_sequence_indices``), so no
token attends across rows, and ``logits_to_keep`` given as a tensor of positions computes the LM head only
where a response token is scored (M <= b x A rows). Each token sees exactly the keys and positions it sees in
the padded layout: the outputs are the same numbers up to float summation order (tests/test_packing.py
bounds the difference).

Used for decoder-only models whose forward takes ``logits_to_keep`` (``rlhf_core.models.unwrap.language_model``);
encoder-decoders, prompt-learning adapters and batches from a custom collator keep the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.models.unwrap import language_model
from rlhf_core.trainers.experience import ModelBatch
from rlhf_core.trainers.forward import dropout_off

def should_pack(model: Any, batch: ModelBatch) -> bool:
    """Pack this forward: a packable batch, a model that takes ``logits_to_keep`` and honours packed position
    ids (``packing_works``), and fewer FLOPs than padded (``packing_pays``)."""
    lm = language_model(model)
    return lm is not None and can_pack(batch) and packing_pays(batch, lm.config) and packing_works(model, lm)


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


def can_pack(batch: ModelBatch) -> bool:
    """True for a decoder-only batch of ids, attention mask and position ids only (nothing else to pack)."""
    return batch.token_ids_key == "input_ids" and set(batch.model_inputs) == {"input_ids", "attention_mask",
                                                                              "position_ids"}


def packing_pays(batch: ModelBatch, config: Any) -> bool:
    """True when the packed forward needs fewer FLOPs than the padded one (``config``: the LM's config).

    Packing drops the padding columns from every layer and the unscored rows from the LM head, but the mask
    of one long sequence makes attention quadratic in all N tokens instead of per row: for many or long rows
    the padded layout is cheaper. Per-token FLOPs: 24 L H^2 (projections and MLP) + 4 L H x keys (attention);
    per LM-head row: 2 H V.
    """
    layers, hidden, vocab = (getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, hidden, vocab)):
        return False
    mask = batch.model_inputs["attention_mask"]  # (b, T)
    rows, width = mask.shape
    tokens, scored = int(mask.sum()), int(batch.response_mask.numel())
    kept = rows * (width - int(batch.response_index.min()))  # the padded path's logits_to_keep rows
    padded = rows * width * (24 * layers * hidden ** 2 + 4 * layers * hidden * width) + kept * 2 * hidden * vocab
    packed = tokens * (24 * layers * hidden ** 2 + 4 * layers * hidden * tokens) + scored * 2 * hidden * vocab
    return packed < padded


_PACKING_WORKS: dict[tuple, bool] = {}


@torch.no_grad()
def packing_works(model: Any, lm: Any) -> bool:
    """Whether ``lm``'s attention honours packed position ids (checked once per model class and attention).

    transformers builds the block-diagonal mask from position ids that restart at 0 only in some code paths
    (no attention mask, no cache); a model whose attention ignores them would silently let tokens see the
    previous row. A two-row probe through ``model`` compares the packed logits with the rows run alone.
    """
    key = (type(lm), getattr(lm.config, "_attn_implementation", None))
    if key not in _PACKING_WORKS:
        device = next(lm.parameters()).device
        # ordinary tokens only: a pad id at an edge of the probe would make transformers warn that padding is
        # not masked (the probe has no padding)
        special = {getattr(lm.config, k, None) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        ordinary = [i for i in range(min(int(lm.config.vocab_size), 64)) if i not in special][:8]
        ids = torch.tensor([(ordinary * 8)[:8]], device=device)  # (1, 8)
        first, second = ids[0, :5], ids[0, 5:]
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=device)
        with dropout_off(model):
            packed = _logits(model(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False))[0]
            alone = _logits(model(input_ids=second[None, :], use_cache=False))[0]  # (3, V)
        tolerance = 1e-3 * max(1.0, float(alone.abs().max()))
        _PACKING_WORKS[key] = bool((packed[5:] - alone).abs().max() <= tolerance)
    return _PACKING_WORKS[key]


def pack_rows(batch: ModelBatch) -> PackedRows:
    """Pack the real tokens of ``batch`` (each row's real tokens contiguous, padded on either side)."""
    mask = batch.model_inputs["attention_mask"].bool()  # (b, T)
    lengths = mask.sum(1)  # (b,) real tokens per row
    first = mask.int().argmax(1)  # (b,) column of the first real token
    index = batch.response_index  # (b, A) shifted column scoring response slot a
    # Slot a is a real response token when the token it scores (column index + 1) is inside the row: the
    # response is the tail of the row's real tokens, so a < (last real column) - (first scored column).
    response_len = first + lengths - 1 - index[:, 0]  # (b,)
    slots = torch.arange(index.shape[1], device=index.device)[None, :] < response_len[:, None]  # (b, A)
    offsets = torch.cumsum(lengths, 0) - lengths  # (b,) packed position of each row's first real token
    slot_rows, slot_cols = slots.nonzero(as_tuple=True)  # (M,), (M,) row-major: row by row, slot by slot
    score_positions = offsets[slot_rows] + index[slot_rows, slot_cols] - first[slot_rows]  # (M,)
    return PackedRows(input_ids=batch.model_inputs["input_ids"][mask][None, :],
                      position_ids=batch.model_inputs["position_ids"][mask][None, :],
                      score_positions=score_positions, slot_rows=slot_rows, slot_cols=slot_cols)


def _logits(output: Any) -> torch.Tensor:
    """The logits of a causal LM's output (a ModelOutput) or of the value-head wrapper's tuple, in fp32."""
    return (output.logits if hasattr(output, "logits") else output[0]).float()


def unpack_slots(values: torch.Tensor, packed: PackedRows, shape: tuple[int, int]) -> torch.Tensor:
    """Per-scored-token ``values`` (M, ...) placed in the (b, A, ...) response layout, 0 on padding slots."""
    out = values.new_zeros((*shape, *values.shape[1:]))
    return out.index_put((packed.slot_rows, packed.slot_cols), values)  # out of place: differentiable
