"""THE response forward, and what every trainer's forward passes share: the reference model and dropout off.

``response_forward(model, batch)`` is the one forward pass PPO, GRPO, RLOO, DPO and KTO run over a ``ModelBatch``
(the policy with gradients; the old policy and the reference without): for every response slot (B, A) the
log-probability of its token, and when asked the entropy there, the mean logit, the value-head prediction and the
slot's logits. It

- runs the LM head only on the positions it needs (``positions``), or on the rows packed into one sequence without
  padding where that costs fewer FLOPs (``packing``);
- keeps the logits in the model's dtype (bf16 on a GPU): the value-head wrapper's and accelerate's fp32 copies of
  the whole (B, K, V) are skipped, and log-softmax, gather and entropy run in fp32 over chunks of rows
  (``core.token_logprobs``), so fp32 (B, K, V) logits never exist, in the forward or the backward;
- decides every shape (trimmed columns, packing, kept positions) on the batch's host layout, so a forward inside a
  loop over mini-batches never waits for the device.

``reference_model`` is the one place that knows the two kinds of reference: a PEFT policy is its own reference with
the adapter disabled (no second copy in memory), anything else has a separate frozen model, run under the
accelerator's autocast like the policy (not in fp32 beside a bf16 policy). ``dropout_off`` runs a block in eval mode
and puts the previous mode back.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch
from accelerate.utils.operations import ConvertOutputsToFp32

from rlhf_core.core import rowwise_logit_stats, token_logprobs
from rlhf_core.models.peft_support import is_peft_model
from rlhf_core.models.reference import create_reference_model
from rlhf_core.models.sliding_window import window_binds
from rlhf_core.models.unwrap import language_model
from rlhf_core.trainers.experience import ModelBatch
from rlhf_core.trainers.packing import can_pack, pack_rows, packing_pays, unpack_slots

LOGIT_POSITIONS = ("span", "suffix", "all")
"""Where the LM head runs (``response_forward(positions=...)``):

- ``span``: from the first to the last position that scores a slot (the fewest; GRPO and RLOO);
- ``suffix``: from the first scoring position to the end of the rows (PPO);
- ``all``: every position, never packed (DPO and KTO).

All three give the same log-probs. Their backward sums the LM head's weight gradient over a different set of rows
(the extra ones contribute zeros), which changes the grouping of the float sum: each trainer keeps the rows it has
always used, so its CPU results stay byte-identical to the releases before this forward was shared."""


@dataclass(kw_only=True)
class ResponseForward:
    """What ``response_forward`` gives for B rows of A response slots; padding slots hold any finite value."""

    logprobs: torch.Tensor
    """(B, A) fp32 log-probability of each slot's token; differentiable when the forward ran with gradients."""
    values: torch.Tensor | None = None
    """(B, A) fp32 value-head prediction at each slot's scoring position, 0 on padding; None without a value head."""
    entropy: torch.Tensor | None = None
    """(B, A) fp32 entropy of the distribution at each slot (detached), when asked."""
    logit_mean: torch.Tensor | None = None
    """(B, A) fp32 mean logit over the vocabulary at each slot (detached), when asked (DPO's and KTO's metrics)."""
    logits: torch.Tensor | None = None
    """(B, A, V) the logits at each slot in the model's dtype, when asked (classic APIs, PPO's full KL)."""


def response_forward(model: Any, batch: ModelBatch, *, positions: str = "span", entropy: bool = False,
                     logit_mean: bool = False, logits: bool = False) -> ResponseForward:
    """Run ``model`` over ``batch`` and score every response slot (see the module docstring).

    ``model``: a causal or encoder-decoder LM, a value-head wrapper of one, possibly PEFT, DDP- or accelerate-
    wrapped. Gradients flow when called with grad enabled. Dropout is whatever mode the caller set.
    """
    if positions not in LOGIT_POSITIONS:
        raise ValueError(f"positions must be one of {LOGIT_POSITIONS}, got {positions!r}")
    lm = language_model(model)
    with native_dtype_outputs(model), checkpointing_in_eval(model):
        if positions != "all" and lm is not None and should_pack(model, lm, batch):
            scored = _packed(model, lm, batch)
        else:
            scored = _padded(model, lm, batch, positions if lm is not None else "all")
    stats = rowwise_logit_stats(scored.logits, scored.rows, entropy=entropy, mean=logit_mean) \
        if entropy or logit_mean else {}
    return ResponseForward(
        logprobs=scored.place(token_logprobs(scored.logits, scored.rows, scored.tokens)),
        values=scored.values,
        entropy=scored.place(stats["entropy"]) if entropy else None,
        logit_mean=scored.place(stats["mean"]) if logit_mean else None,
        logits=scored.place(scored.logits.index_select(0, scored.rows)) if logits else None,
    )


@dataclass(kw_only=True)
class _Scored:
    """One forward's LM-head rows and which of them score the response slots."""

    logits: torch.Tensor
    """(N, V) the rows the LM head computed, in the model's dtype."""
    rows: torch.Tensor
    """(S,) the row scoring each slot (S = B x A padded; M real slots packed)."""
    tokens: torch.Tensor
    """(S,) the token each of those slots scores."""
    place: Callable[[torch.Tensor], torch.Tensor]
    """Puts per-slot values (S, ...) in the (B, A, ...) layout."""
    values: torch.Tensor | None
    """(B, A) fp32 value-head predictions, zeroed on padding; None without a value head."""


def _padded(model: Any, lm: Any, batch: ModelBatch, positions: str) -> _Scored:
    """The padded rows through the model, the LM head on ``positions`` only (``all`` for a model that cannot;
    ``lm``: ``language_model(model)``, None for such a model)."""
    layout = batch.layout()
    tokens = batch.model_inputs[batch.token_ids_key]  # (B, T)
    index = layout.response_index  # (B, A) on the host
    first, last = (int(index.min()), int(index.max())) if index.size else (0, 0)
    kwargs: dict[str, Any] = {}
    if positions == "span":  # positions first..last; logits (B, last - first + 1, V)
        kwargs["logits_to_keep"] = torch.arange(first, last + 1, device=tokens.device)
    elif positions == "suffix":  # positions first..T-1; logits (B, T - first, V)
        kwargs["logits_to_keep"] = tokens.shape[1] - first
    inputs = _with_explicit_mask(batch.model_inputs, lm)
    model_logits, values = _outputs(model(**inputs, **kwargs, **_call_options(model, lm)))
    width = model_logits.shape[1]
    # the position of the first kept logit: ``first`` for a span, else T - K (0 when every position was kept)
    offset = first if positions == "span" else tokens.shape[1] - width
    shape = tuple(batch.response_index.shape)  # (B, A)
    rows = (torch.arange(shape[0], device=tokens.device)[:, None] * width + batch.response_index - offset).reshape(-1)
    if values is not None:
        values = torch.gather(values[:, :-1].float(), 1, batch.response_index) * batch.response_mask  # (B, A)
    return _Scored(logits=model_logits.reshape(-1, model_logits.shape[-1]), rows=rows,
                   tokens=batch.response_tokens.reshape(-1), place=lambda v: v.reshape(*shape, *v.shape[1:]),
                   values=values)


def _packed(model: Any, lm: Any, batch: ModelBatch) -> _Scored:
    """The real tokens of every row as one sequence (``packing``); the LM head only where a slot is scored."""
    packed = pack_rows(batch)
    # without a mask transformers builds the block-diagonal one from the restarting position ids
    mask = packed_mask(packed.segments) if own_masks(lm, packed.input_ids) else None
    model_logits, values = _outputs(model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                          attention_mask=mask, logits_to_keep=packed.score_positions,
                                          **_call_options(model, lm)))
    shape = tuple(batch.response_index.shape)  # (B, A)
    if values is not None:
        values = unpack_slots(values[0, packed.score_positions].float(), packed, shape) * batch.response_mask
    rows = torch.arange(packed.score_positions.shape[0], device=packed.score_positions.device)  # (M,)
    return _Scored(logits=model_logits[0], rows=rows, tokens=batch.response_tokens[packed.slot_rows, packed.slot_cols],
                   place=lambda v: unpack_slots(v, packed, shape), values=values)


# ---- attention masks built here (on a GPU): transformers' own mask preparation reads the device on the host

def explicit_masks(lm: Any, device: torch.device) -> bool:
    """Pass the attention mask as a 4-d boolean tensor built on the device, not transformers' 2-d one.

    From a 2-d mask (or none, for packed rows) transformers decides on the host whether attention may skip the
    mask (``masking_utils``: is every row unpadded? are the position ids packed?): a device read per forward, which
    on a GPU waits for all the work queued before it. A 4-d mask is used as given. Done for CUDA devices and the
    ``sdpa`` attention (transformers' default there; flash-attention kernels take no 4-d mask). On the CPU
    transformers' own path runs, so the CPU results stay byte-identical (tests/test_forward.py checks the two
    agree).
    """
    return device.type == "cuda" and lm is not None and getattr(lm.config, "_attn_implementation", None) == "sdpa"


def own_masks(lm: Any, input_ids: torch.Tensor) -> bool:
    """Build the 4-d mask here for this forward over ``input_ids`` (B, T): ``explicit_masks``, and no attention
    window of ``lm`` shorter than T. The masks built here are plain causal; a sliding-window (or chunked) layer
    over a longer sequence sees fewer keys, which only the model's own mask code knows (its layers may differ),
    so such a forward takes transformers' path (``models.sliding_window``)."""
    return explicit_masks(lm, input_ids.device) and not window_binds(lm.config, input_ids.shape[-1])


def padded_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: query t sees key s <= t of its own row when s is a real token, and itself (a left-padding
    query has no real key before it: with none at all its softmax would be NaN, which the backward would spread)."""
    width = attention_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()  # (T, T)
    eye = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return ((causal[None] & attention_mask.bool()[:, None, :]) | eye[None])[:, None]  # (B, 1, T, T)


def packed_mask(segments: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, N) bool for packed rows: token i sees token j <= i of its own row (``segments`` (N,): row ids)."""
    width = segments.shape[0]
    causal = torch.ones(width, width, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, None] == segments[None, :]))[None, None]


def _with_explicit_mask(inputs: dict[str, torch.Tensor], lm: Any) -> dict[str, torch.Tensor]:
    """``inputs`` with the 4-d mask (``explicit_masks``) in place of the 2-d one, when that applies (a causal LM:
    ``lm`` is not None)."""
    mask = inputs.get("attention_mask")
    if lm is None or mask is None or mask.dim() != 2 or not own_masks(lm, mask):
        return inputs
    return {**inputs, "attention_mask": padded_mask(mask)}


def _call_options(model: Any, lm: Any) -> dict[str, Any]:
    """More keyword arguments of a scoring forward: no KV cache for a transformers causal LM (``lm``; nothing is
    decoded after it: less memory), and the value-head wrapper's logits left in the model's dtype (they are
    upcast chunk by chunk). A model of another kind gets its inputs only."""
    options: dict[str, Any] = {} if lm is None else {"use_cache": False}
    if _takes_upcast_logits(type(getattr(model, "module", model))):
        options["upcast_logits"] = False
    return options


@functools.cache
def _takes_upcast_logits(model_class: type) -> bool:
    """Whether the class's forward takes ``upcast_logits`` (the value-head wrappers' do)."""
    return "upcast_logits" in inspect.signature(model_class.forward).parameters


def _outputs(output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logits, values or None) of a transformers model's output or of the value-head wrapper's tuple."""
    if hasattr(output, "logits"):
        return output.logits, None
    return output[0], output[2]


@contextlib.contextmanager
def native_dtype_outputs(model: Any) -> Iterator[None]:
    """For the block, a model prepared by accelerate for mixed precision returns its outputs in the dtype it
    computed them in.

    accelerate wraps such a model's forward in autocast and then in a conversion of every bf16/fp16 output to
    fp32 (``convert_outputs_to_fp32``): the whole (B, T, V) logits copied to fp32, which the chunked log-softmax
    exists to avoid. The autocast stays; only the conversion is skipped. Any other model is left as it is.
    """
    inner = getattr(model, "module", model)  # DDP calls the inner module's forward
    forward = inner.__dict__.get("forward")
    converter = getattr(getattr(forward, "__func__", forward), "__wrapped__", None)
    if not isinstance(converter, ConvertOutputsToFp32):
        yield
        return
    autocast_forward = converter.model_forward
    inner.forward = MethodType(autocast_forward, inner) if isinstance(forward, MethodType) else autocast_forward
    try:
        yield
    finally:
        inner.forward = forward


@contextlib.contextmanager
def checkpointing_in_eval(model: Any) -> Iterator[None]:
    """With gradients on, the layers whose activation checkpointing is enabled (``gradient_checkpointing_enable``)
    checkpoint even when the model runs in eval mode (dropout off).

    transformers checkpoints a layer only while ``layer.training``, and PPO, GRPO and RLOO run their gradient
    forwards in eval mode (no dropout, as classic TRL): there ``gradient_checkpointing=True`` would silently keep
    every activation. For the block the train flag is set on those layers alone (their dropout and attention
    submodules keep theirs, so no dropout appears); the recomputation gives the same numbers. Without
    checkpointing enabled, or without gradients, nothing changes.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True
              and not m.training and callable(getattr(m, "_gradient_checkpointing_func", None))] \
        if torch.is_grad_enabled() else []
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer in layers:
            layer.training = False


# ---- packing: whether this forward packs its rows

def should_pack(model: Any, lm: Any, batch: ModelBatch) -> bool:
    """Pack this forward: a packable batch, fewer FLOPs than padded (``packing_pays``), and a model whose
    attention honours packed position ids (``packing_works``). ``lm``: ``language_model(model)``."""
    return can_pack(batch) and packing_pays(batch, lm.config) and packing_works(model, lm)


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
        second = ids[0, 5:]
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=device)
        with dropout_off(model):
            packed = _outputs(model(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False))[0]
            alone = _outputs(model(input_ids=second[None, :], use_cache=False))[0]  # (1, 3, V)
        packed, alone = packed[0].float(), alone[0].float()
        tolerance = 1e-3 * max(1.0, float(alone.abs().max()))
        _PACKING_WORKS[key] = bool((packed[5:] - alone).abs().max() <= tolerance)
    return _PACKING_WORKS[key]


# ---- the reference model and dropout

@dataclass(frozen=True)
class Reference:
    """Which reference a trainer runs, decided once in its constructor (:func:`decide_reference`)."""

    model: torch.nn.Module | None
    """A separate reference model (the user's, or a frozen copy of the policy); None when the reference is the
    policy with its adapter off, or there is none."""
    adapter_off: bool
    """The reference is the PEFT policy with its adapter disabled (no second model in memory)."""


def decide_reference(policy: torch.nn.Module, ref_model: torch.nn.Module | None = None, *, needed: bool = True,
                     num_shared_layers: int | None = None) -> Reference:
    """The reference decision of every trainer (PPO, GRPO/RLOO, DPO, KTO), in one place: the ``ref_model`` given;
    else, for a PEFT policy, the policy with its adapter off; else, when one is ``needed`` (not: GRPO/RLOO with
    ``beta == 0``, DPO's ``reference_free``, KTO's precomputed log-probs), a frozen copy of the policy
    (``create_reference_model``, sharing its first ``num_shared_layers``); else none."""
    if ref_model is not None:
        return Reference(ref_model, False)
    if is_peft_model(getattr(policy, "pretrained_model", policy)):  # a value-head wrapper's transformer, or the policy
        return Reference(None, True)
    if not needed:
        return Reference(None, False)
    return Reference(create_reference_model(policy, num_shared_layers=num_shared_layers), False)


@contextlib.contextmanager
def reference_model(accelerator: Any, policy: torch.nn.Module, ref_model: torch.nn.Module | None,
                    adapter_off: bool) -> Iterator[torch.nn.Module]:
    """Yield the model to run as the reference inside the block.

    ``adapter_off``: the reference is ``policy`` (a PEFT model, possibly wrapped by ``accelerator``) with its
    adapter disabled until the block ends; ``policy`` is yielded. Otherwise ``ref_model``, a separate model, is
    yielded as it is, and the block runs under ``accelerator``'s autocast: accelerate wraps only the prepared
    policy's forward in it, so without this a bf16 run would compute the reference in fp32.
    """
    if not adapter_off:
        with accelerator.autocast():
            yield ref_model
        return
    with accelerator.unwrap_model(policy).disable_adapter():
        yield policy


# ---- dropout off, the three forms the trainers need, in one place
def disable_dropout(model: torch.nn.Module | None) -> None:
    """Set every dropout probability in ``model`` to 0, for good (DPO's and KTO's ``disable_dropout``, as TRL: the
    model stays in train mode, its log-probs are deterministic)."""
    if model is None:
        return
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def eval_mode(*models: torch.nn.Module | None) -> None:
    """Every module of each model in eval mode (no dropout) until something turns it back: once per PPO step
    (classic TRL semantics: no dropout in PPO forward passes). ``eval()`` walks every module (~0.25 ms on a 2-layer
    GPT-2): the step's forwards only re-check the top-level flag."""
    for model in models:
        if model is not None:
            model.eval()


@contextlib.contextmanager
def dropout_off(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """``model.eval()`` for the block when ``enabled`` (no dropout; gradients still flow), then the previous
    mode back (also when the block raises)."""
    was_training = model.training
    if enabled:
        model.eval()
    try:
        yield
    finally:
        model.train(was_training)
