"""The sampling loop of every trainer: a static KV cache and a token step that never reads a value on the host.

For a decoder-only LM with plain settings (greedy or sampling with temperature / top-k / top-p / min-p, a repetition
penalty, suppressed tokens, a minimum length, EOS and pad ids, ``max_new_tokens``: what released instruct models'
``generation_config`` files set, Qwen2-Instruct's ``repetition_penalty=1.1`` included) this loop makes the model calls ``generate`` makes (the same
inputs and position ids; a 4-d attention mask that allows exactly the keys ``generate``'s mask allows), applies the
logits processors ``generate`` applies, in its order, and samples as ``torch.multinomial(probs, 1)`` does: an
exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` per token (token i with probability p_i exactly), drawn from
the same generator in the same order. Greedy tokens are ``generate``'s; sampled tokens are ``generate``'s for the
same seed wherever the two computations' last-bit rounding does not decide a race (tests/test_decode.py).

How it is laid out, for the GPU:

- The KV cache is transformers' ``StaticCache``, allocated once for ``prompt width + max_new_tokens`` slots
  (rounded up to ``CACHE_BUCKET`` when the state is kept for a CUDA graph) and written in place: no per-token
  concatenation. Every other tensor the loop touches lives in one ``DecodeState``, also written in place.
- With a graph backend, a token step attends to the cache's first ``visible`` slots only: the slots written so far
  rounded up to ``KV_SEGMENT``, one captured graph per such length. A step then reads at most ``KV_SEGMENT - 1``
  slots of K/V it does not need, not the whole bucketed cache (for 12-token prompts and 128 new tokens: 1.2x the
  K/V bytes the steps need on average, where the whole 192-slot cache read 2.5x).
- ``token_step`` (model forward of the last token, processors, sampling, bookkeeping) reads its step counter, cache
  slot and finished flags from tensors, so it has the same shape and the same kernels at every token: a CUDA graph
  captured once replays it (``StepRunner`` with ``rlhf_core.trainers.cuda_graphs``). On the CPU it runs eagerly,
  the same function, which is what the tests cover.
- Whether every row has finished is read back to the host only every ``eos_check_every`` tokens (CUDA: 8; the CPU,
  where a read costs nothing: every token, so a call draws exactly the random numbers ``generate`` draws).

Any other setting, or a model that does not fit (encoder-decoder, prompt-learning adapter, an attention window
shorter than prompt + new tokens, non-SDPA/eager attention, no ``StaticCache`` support), goes to ``generate``; the
reason is counted in ``DECODE_STATS["fallbacks"]`` (``decode_plan`` names it).
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from rlhf_core.models.sliding_window import attention_window, window_binds

# Generation settings the loop implements exactly; any other non-default field sends the call to `generate`.
_SUPPORTED = {"do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "min_length", "min_new_tokens",
              "suppress_tokens", "pad_token_id", "eos_token_id", "bos_token_id", "use_cache",
              "transformers_version", "_from_model_config", "decoder_start_token_id"}
# Output options that change nothing while they are off (model configs often spell them out as False).
_OFF_OPTIONS = {"output_attentions", "output_hidden_states", "output_scores", "output_logits",
                "return_dict_in_generate"}
# Settings at the value for which generate adds no processor (TRL 1.16's GRPO passes repetition_penalty=1.0).
_NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "num_beams": 1, "num_beam_groups": 1,
            "num_return_sequences": 1, "length_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}
# Attention implementations that take a custom additive 4-d mask (flash-attention kernels take none).
_MASKABLE_ATTENTION = {"sdpa", "eager"}

# Cache slots are rounded up to a multiple of this when a state is kept for a captured step, so prompts of
# slightly different widths reuse one CUDA graph (the extra slots are masked out: they cost attention FLOPs only).
CACHE_BUCKET = 64
# A captured token step attends to the written cache slots rounded up to a multiple of this (one graph per length).
KV_SEGMENT = 32
# ``RLHF_CORE_COMPILE_DECODE=1``: kept token steps run through torch.compile with this backend (fewer, fused kernels
# inside the captured graph); tests count compilations with a stand-in, and run inductor itself (test_inductor.py).
DECODE_COMPILE_BACKEND: Any = "inductor"
# Inductor draws random numbers with its own generator unless told to fall back to torch's: the compiled step then
# samples other tokens than the eager one (and than ``generate``) for the same seed (measured on the CPU: 40-token
# calls diverged at once). With ``fallback_random`` the exponential race reads torch's generator as eagerly.
_INDUCTOR_OPTIONS = {"fallback_random": True}
# Token steps between two host reads of "has every row finished?" on an accelerator (on the CPU: every step).
EOS_CHECK_EVERY_ACCELERATOR = 8


@dataclass(frozen=True, kw_only=True)
class DecodeSettings:
    """What the loop needs from the merged generation config (plain values: hashable, the key of a captured step)."""

    max_new_tokens: int
    do_sample: bool
    eos_ids: tuple[int, ...]
    pad_id: int | None
    suppress_ids: tuple[int, ...] = ()
    eos_blocked_steps: int = 0
    """EOS is masked for this many new tokens: ``min_new_tokens``, or ``min_length`` minus the padded prompt width."""
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    """generate's ``RepetitionPenaltyLogitsProcessor``: the logit of every token already in the row (real prompt
    tokens and generated ones) divided by it where positive, multiplied where negative."""

    def step_key(self) -> tuple:
        """Everything a captured token step bakes in (the rest is read from tensors at every replay)."""
        return (self.do_sample, self.eos_ids, self.pad_id, self.suppress_ids, self.eos_blocked_steps > 0,
                self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)


def decode_settings(model: Any, prompt_len: int, kwargs: dict[str, Any]) -> DecodeSettings | None:
    """The loop's settings for ``model.generate(**kwargs)``, or None when ``generate`` must run it."""
    plan = decode_plan(model, prompt_len, kwargs)
    return plan if isinstance(plan, DecodeSettings) else None


def decode_plan(model: Any, prompt_len: int, kwargs: dict[str, Any]) -> DecodeSettings | str:
    """``decode_settings``, or instead of None the reason ``generate`` must run the call (one short phrase: the
    key of ``DECODE_STATS["fallbacks"]``)."""
    from transformers import GenerationConfig

    reason = static_cache_misfit(model)
    if reason:
        return reason
    merged = GenerationConfig(**model.generation_config.to_dict())
    unknown = merged.update(**kwargs)
    active = {k for k, v in merged.to_diff_dict().items()
              if not (k in _OFF_OPTIONS and not v) and not (k in _NEUTRAL and v == _NEUTRAL[k])}
    if unknown:
        return "unknown generation kwargs: " + ",".join(sorted(unknown))
    if not active <= _SUPPORTED:
        return "generation settings: " + ",".join(sorted(active - _SUPPORTED))
    if not merged.use_cache:
        return "use_cache=False"
    if merged.max_new_tokens is None or merged.max_new_tokens < 1:
        return "no max_new_tokens"
    if window_binds(model.config, prompt_len + int(merged.max_new_tokens)):
        return f"attention window {attention_window(model.config)} < prompt + new tokens"
    eos = merged.eos_token_id
    eos_ids = () if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos))
    pad = merged.pad_token_id if merged.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    blocked = 0
    if eos_ids and merged.min_length is not None and merged.min_length > 0:
        blocked = merged.min_length - prompt_len  # generate's MinLength counts the padded prompt
    if eos_ids and merged.min_new_tokens is not None and merged.min_new_tokens > 0:
        blocked = max(blocked, merged.min_new_tokens)
    sample = bool(merged.do_sample)
    if merged.top_k is None:  # generate's global default (``_get_default_generation_params``) where nothing set one
        merged.top_k = 50
    return DecodeSettings(
        max_new_tokens=int(merged.max_new_tokens), do_sample=sample, eos_ids=eos_ids, pad_id=pad,
        suppress_ids=tuple(merged.suppress_tokens or ()), eos_blocked_steps=max(0, blocked),
        temperature=merged.temperature if sample and merged.temperature not in (None, 1.0) else None,
        top_k=merged.top_k if sample and merged.top_k not in (None, 0) else None,
        top_p=merged.top_p if sample and merged.top_p is not None and merged.top_p < 1.0 else None,
        min_p=merged.min_p if sample and merged.min_p is not None else None,
        repetition_penalty=float(merged.repetition_penalty) if merged.repetition_penalty not in (None, 1.0) else None)


def static_cache_fits(model: Any) -> bool:
    """A decoder-only transformers LM that runs on a ``StaticCache`` with a custom 4-d mask (full attention)."""
    return not static_cache_misfit(model)


def static_cache_misfit(model: Any) -> str:
    """Why ``model`` cannot run the static decode (a short phrase), or "" when it can.

    A Mistral-style config (no ``layer_types``, ``sliding_window`` set) fits here: its window is compared with the
    call's length in ``decode_plan`` (Mistral-7B's 4096 binds no RLHF prompt + response)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generation_config"):
        return "not a transformers LM"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "prompt-learning adapter"  # virtual tokens: generate handles them
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's transformer
    if not getattr(base, "_can_compile_fullgraph", False):  # transformers' flag for static-cache models
        return "no static cache support"
    text = config.get_text_config(decoder=True)
    attention = getattr(text, "_attn_implementation", None)
    if attention not in _MASKABLE_ATTENTION:
        return f"attention {attention} takes no 4-d mask"
    if not all(kind == "full_attention" for kind in (getattr(text, "layer_types", None) or ["full_attention"])):
        return "layer types " + ",".join(sorted(set(text.layer_types) - {"full_attention"}))
    return ""


def warpers(settings: DecodeSettings) -> list[Callable]:
    """``generate``'s sampling warpers for these settings, in its order (transformers' own classes)."""
    from transformers.generation import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    out: list[Callable] = []
    if settings.temperature is not None:
        out.append(TemperatureLogitsWarper(settings.temperature))
    if settings.top_k is not None:
        out.append(TopKLogitsWarper(top_k=settings.top_k, min_tokens_to_keep=1))
    if settings.top_p is not None:
        out.append(TopPLogitsWarper(top_p=settings.top_p, min_tokens_to_keep=1))
    if settings.min_p is not None:
        out.append(MinPLogitsWarper(min_p=settings.min_p, min_tokens_to_keep=1))
    return out


def sample_exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (b, V), token i with probability p_i: argmax of p_i / E_i, E_i ~ Exp(1)."""
    return probs.div(torch.empty_like(probs).exponential_(1.0)).argmax(dim=-1)  # (b,)


class DecodeState:
    """Every tensor the token step reads or writes, allocated once: a captured step replays on these addresses,
    so a new call refills them in place (``start``).

    ``b`` rows, ``L`` cache slots (prompt width ``T`` + new tokens, maybe rounded up), ``V`` vocabulary.
    """

    def __init__(self, model: Any, batch: int, cache_len: int, settings: DecodeSettings, device: torch.device,
                 mask_dtype: torch.dtype):
        text = model.config.get_text_config(decoder=True)
        self.settings, self.mask_dtype = settings, mask_dtype
        self.visible: int | None = None  # the cache slots a step attends to (None: all; ``set_visible``)
        self.warpers = warpers(settings)
        self.cache = static_cache(text.num_hidden_layers, cache_len)
        long = {"dtype": torch.long, "device": device}
        self.tokens = torch.zeros(batch, 1, **long)  # (b, 1) the last sampled token: the next step's input
        self.positions = torch.zeros(batch, 1, **long)  # (b, 1) its position id
        self.slot = torch.zeros((), **long)  # the cache slot the next step's token is written to
        self.slots = torch.arange(cache_len, device=device)  # (L,)
        self.key_ok = torch.ones(batch, cache_len, dtype=torch.bool, device=device)  # (b, L) False at left padding
        self.step = torch.zeros((), **long)  # tokens generated so far
        self.unfinished = torch.ones(batch, dtype=torch.bool, device=device)  # (b,)
        self.lengths = torch.zeros(batch, **long)  # (b,) tokens up to and including the first EOS
        self.out = torch.zeros(batch, cache_len, **long)  # (b, L) generated tokens (pad once a row finished)
        self.logprobs = torch.zeros(batch, cache_len, dtype=torch.float32, device=device)  # (b, L)
        self.eos = torch.tensor(settings.eos_ids, **long)  # (E,)
        self.eos_blocked = torch.zeros((), **long)
        ids = torch.arange(text.vocab_size, device=device)
        self.is_eos = torch.isin(ids, self.eos)  # (V,)
        self.suppressed = torch.isin(ids, torch.tensor(settings.suppress_ids, **long))  # (V,)
        # (b, V + 1) the tokens already in each row (the repetition penalty's set; column V: padding, never read)
        self.seen = torch.zeros(batch, text.vocab_size + 1, dtype=torch.bool, device=device) \
            if settings.repetition_penalty is not None else None

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: DecodeSettings) -> None:
        """Refill every buffer for a new call on left-padded prompts ``input_ids`` with ``attention_mask`` (b, T)."""
        width = attention_mask.shape[1]
        self.cache.reset()
        if self.seen is not None:  # generate ignores the left padding (``prompt_ignore_length``)
            self.seen.zero_()
            self.seen.scatter_(1, input_ids.masked_fill(attention_mask == 0, self.seen.shape[1] - 1), True)
        self.key_ok.fill_(True)
        self.key_ok[:, :width] = attention_mask.bool()
        self.slot.fill_(width)
        self.step.zero_()
        self.unfinished.fill_(True)
        self.lengths.zero_()
        self.out.fill_(settings.pad_id if settings.pad_id is not None else 0)
        self.logprobs.zero_()
        self.eos_blocked.fill_(settings.eos_blocked_steps)

    def set_visible(self, visible: int | None) -> None:
        """Let the next steps attend to the first ``visible`` cache slots only (None: all of them). The slots beyond
        hold no key a query may see yet, so the outputs are the same to rounding; fewer K/V bytes are read."""
        self.visible = visible
        for layer in self.cache.layers:
            layer.visible = visible

    def mask(self, query_slots: torch.Tensor) -> torch.Tensor:
        """Additive mask (b, 1, q, L) for queries at ``query_slots`` (q,): a key is seen iff it is no left padding
        and no later than the query, which is what ``generate``'s mask allows (L: the ``visible`` slots)."""
        width = self.visible or self.slots.shape[0]
        seen = self.key_ok[:, None, :width] & (self.slots[None, None, :width] <= query_slots[None, :, None])
        blocked = torch.zeros(seen.shape, dtype=self.mask_dtype, device=seen.device)
        return blocked.masked_fill_(~seen, torch.finfo(self.mask_dtype).min)[:, None]  # (b, 1, q, L)


def static_cache(layers: int, cache_len: int) -> Any:
    """transformers' static KV cache (``StaticCache``'s full-attention layers), except that each layer keeps its
    values in the values' own dtype: under autocast a rotary model's keys come out of the rotation in fp32 while its
    values stay bf16, which one shared dtype cannot hold (the dynamic cache keeps them apart as well)."""
    from transformers.cache_utils import Cache

    return Cache(layers=[_static_layer_class()(max_cache_len=cache_len) for _ in range(layers)])


@functools.cache
def _static_layer_class() -> type:
    from transformers.cache_utils import StaticLayer

    class ValuesInTheirDtype(StaticLayer):
        visible: int | None = None  # ``DecodeState.set_visible``: attention reads only the first slots

        def update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            keys, values = super().update(*args, **kwargs)
            if self.visible is None:
                return keys, values
            return keys[:, :, :self.visible], values[:, :, :self.visible]

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            if self.values.dtype != value_states.dtype:
                self.values = torch.zeros_like(self.values, dtype=value_states.dtype)

    return ValuesInTheirDtype


def prefill(model: Any, state: DecodeState, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            takes_logits_to_keep: bool) -> None:
    """The prompts' forward into the cache (eager: its width varies), then the first token."""
    width = input_ids.shape[1]
    positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)  # (b, T) as generate
    keep = {"logits_to_keep": 1} if takes_logits_to_keep else {}
    out = model(input_ids=input_ids, attention_mask=state.mask(state.slots[:width]), position_ids=positions,
                past_key_values=state.cache, use_cache=True, **keep)
    state.positions.copy_(positions[:, -1:] + 1)
    take_token(state, out.logits[:, -1, :])


def token_step(model: Any, state: DecodeState) -> None:
    """One new token per row: the last token's forward, then ``take_token``. Fixed shapes, values in tensors."""
    out = model(input_ids=state.tokens, attention_mask=state.mask(state.slot.view(1)), position_ids=state.positions,
                past_key_values=state.cache, use_cache=True)
    state.slot.add_(1)
    state.positions.add_(1)
    take_token(state, out.logits[:, -1, :])


def take_token(state: DecodeState, logits: torch.Tensor) -> None:
    """Process ``logits`` (b, V) as ``generate`` does, draw the next token, and record it at ``state.step``."""
    settings = state.settings
    scores = logits.to(dtype=torch.float32, copy=True)  # (b, V)
    if settings.repetition_penalty is not None:  # generate's first processor of these
        penalty = settings.repetition_penalty
        penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
        scores = torch.where(state.seen[:, :scores.shape[1]], penalised, scores)
    if settings.suppress_ids:
        scores = torch.where(state.suppressed, -float("inf"), scores)
    if settings.eos_blocked_steps > 0:  # generate's MinLength / MinNewTokens: EOS impossible for the first steps
        scores = torch.where(state.is_eos & (state.step < state.eos_blocked), -float("inf"), scores)
    for warper in state.warpers:
        scores = warper(None, scores)
    probs = torch.softmax(scores, dim=-1)  # (b, V)
    tokens = sample_exponential_race(probs) if settings.do_sample else scores.argmax(dim=-1)  # (b,)
    logprobs = probs.gather(-1, tokens[:, None]).log()[:, 0]  # (b,) under the distribution drawn from
    if settings.pad_id is not None:
        tokens = torch.where(state.unfinished, tokens, settings.pad_id)
        logprobs = torch.where(state.unfinished, logprobs, 0.0)
    column = state.step.view(1)
    state.out.index_copy_(1, column, tokens[:, None])
    state.logprobs.index_copy_(1, column, logprobs[:, None])
    state.lengths.add_(state.unfinished)
    if settings.eos_ids:  # (isin sorts and uniques its inputs on CUDA beyond a few elements: a host read)
        state.unfinished.logical_and_(~(tokens[:, None] == state.eos[None, :]).any(dim=-1))
    if state.seen is not None:  # generate's input_ids grow by this token (pad on a finished row)
        state.seen.scatter_(1, tokens[:, None], True)
    state.tokens.copy_(tokens[:, None])
    state.step.add_(1)


class GraphBackend(Protocol):
    """What ``StepRunner`` needs to capture a step (``rlhf_core.trainers.cuda_graphs.CudaGraphs`` on CUDA)."""

    warmup_steps: int

    def warmup(self) -> contextlib.AbstractContextManager: ...

    def record(self, step: Callable[[], None]) -> Callable[[], None]: ...


@dataclass
class StepRunner:
    """Runs ``token_step`` on one state: eagerly, or (with a graph backend) as ``warmup_steps`` real eager steps
    and then replays of graphs of the step, one recorded per attended length (``segments``). A recording that
    fails leaves the runner eager for good (the reason goes to ``DECODE_STATS``)."""

    step: Callable[[], None]
    backend: GraphBackend | None = None
    state: DecodeState | None = None
    """With ``state``: each step attends to the written slots rounded up to ``KV_SEGMENT`` (``set_visible``)."""
    replays: dict[int | None, Callable[[], None]] = field(default_factory=dict)
    warmed: int = 0

    def run(self, count: int, first_slot: int = 0) -> None:
        """``count`` token steps, the first of which writes cache slot ``first_slot`` (known on the host)."""
        for i in range(count):
            visible = self._visible(first_slot + i)
            replay = self.replays.get(visible)
            if replay is None and self.backend is not None and self.warmed >= self.backend.warmup_steps:
                replay = self._record(visible)
            if replay is not None:
                replay()
                DECODE_STATS["replays"] += 1
                continue
            with self.backend.warmup() if self.backend is not None else contextlib.nullcontext():
                self.step()
            self.warmed += 1
            DECODE_STATS["eager_steps"] += 1

    def _visible(self, slot: int) -> int | None:
        """The slots a step writing ``slot`` attends to (set on the state); None without a state (all of them)."""
        if self.state is None:
            return None
        visible = min(-(-(slot + 1) // KV_SEGMENT) * KV_SEGMENT, self.state.slots.shape[0])
        if visible != self.state.visible:
            self.state.set_visible(visible)
        return visible

    def _record(self, visible: int | None) -> Callable[[], None] | None:
        try:
            replay = self.backend.record(self.step)  # recording runs nothing: the state is not advanced
        except Exception as exc:  # noqa: BLE001 - a step that cannot be captured still runs eagerly
            DECODE_STATS["capture_failures"].append(f"{type(exc).__name__}: {exc}"[:500])
            self.backend = None
            return None
        DECODE_STATS["captures"] += 1
        self.replays[visible] = replay
        return replay


DECODE_STATS: dict[str, Any] = {"captures": 0, "replays": 0, "eager_steps": 0, "capture_failures": [],
                                "fallbacks": {}}
"""Process-wide counters of the token steps run (the GPU bench reports whether its steps were replayed graphs),
and per reason the calls that went to ``generate`` instead (``count_fallback``)."""


def count_fallback(reason: str) -> None:
    """Count one call sent to ``generate`` for ``reason`` (``decode_plan``'s phrase)."""
    DECODE_STATS["fallbacks"][reason] = DECODE_STATS["fallbacks"].get(reason, 0) + 1


@dataclass
class _Kept:
    state: DecodeState
    runner: StepRunner


# Per model: the states (and their captured steps) of recent call shapes; gone with the model.
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_KEPT_PER_MODEL = 2  # each holds a KV cache; training alternates few prompt-width buckets


def _model_key(model: Any) -> tuple:
    """What a captured forward depends on beyond the state: parameter storage and every module's train flag."""
    return (tuple(p.data_ptr() for p in model.parameters()), tuple(m.training for m in model.modules()))


def compile_decode() -> bool:
    """``RLHF_CORE_COMPILE_DECODE=1`` (opt-in): the token step of a kept state (the graph path) runs compiled.

    One compilation per attended length (``KV_SEGMENT``) per state, each captured in its own graph afterwards;
    nothing recompiles across calls of the same shape. torch.compile's cache (``torch._dynamo.config.
    cache_size_limit``, 8 by default) bounds the compiled variants of the step: beyond it a step runs eagerly, which
    gives the same tokens.
    """
    return os.environ.get("RLHF_CORE_COMPILE_DECODE", "0") == "1"


def _state_and_runner(model: Any, batch: int, cache_len: int, settings: DecodeSettings, device: torch.device,
                      mask_dtype: torch.dtype, backend: GraphBackend | None) -> _Kept:
    """A fresh state (eager), or with a graph backend the kept one for this shape, settings and model state."""
    def new(length: int) -> _Kept:
        state = DecodeState(model, batch, length, settings, device, mask_dtype)
        ref = weakref.ref(model)  # a strong one in the kept runner would keep the model (the dict's key) alive
        step = lambda: token_step(ref(), state)  # noqa: E731
        if backend is not None and compile_decode():
            options = _INDUCTOR_OPTIONS if DECODE_COMPILE_BACKEND == "inductor" else None  # a stand-in takes none
            step = torch.compile(step, dynamic=False, backend=DECODE_COMPILE_BACKEND, options=options)
        return _Kept(state, StepRunner(step, backend, state=state if backend is not None else None))

    if backend is None:
        return new(cache_len)
    length = -(-cache_len // CACHE_BUCKET) * CACHE_BUCKET
    key = (batch, length, settings.step_key(), device, mask_dtype, _model_key(model))
    kept = _KEPT.setdefault(model, OrderedDict())
    if key not in kept:
        kept[key] = new(length)
        while len(kept) > _KEPT_PER_MODEL:
            kept.popitem(last=False)
    kept.move_to_end(key)
    kept[key].state.settings = settings  # same step key; max_new_tokens / eos_blocked_steps may differ
    return kept[key]


@torch.no_grad()
def decode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: DecodeSettings,
           takes_logits_to_keep: bool, *, graphs: GraphBackend | None = None,
           eos_check_every: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (b, T) -> ``(sequences (b, T + n), logprobs (b, n))``; sequences as ``generate``
    returns them.

    Finished rows (an EOS was generated) continue with the pad id (log-prob 0); the output ends where the last
    row finished, or after ``max_new_tokens``. ``logprobs`` holds each token's log-probability under the
    processed distribution it was drawn from. ``graphs``: replay the token step from a captured graph (the state
    is then kept per model for the next call of the same shape). ``eos_check_every``: token steps between host
    reads of "has every row finished?" (default: 1 on the CPU, ``EOS_CHECK_EVERY_ACCELERATOR`` elsewhere).
    """
    batch, width = input_ids.shape
    device = input_ids.device
    every = eos_check_every or (1 if device.type == "cpu" else EOS_CHECK_EVERY_ACCELERATOR)
    kept = _state_and_runner(model, batch, width + settings.max_new_tokens, settings, device,
                             _compute_dtype(model), graphs)
    state = kept.state
    state.start(input_ids, attention_mask, settings)
    state.set_visible(None)  # the prefill attends to every slot (its own shape; eager)
    prefill(model, state, input_ids, attention_mask, takes_logits_to_keep)
    done = 1
    while done < settings.max_new_tokens and bool(state.unfinished.any()):
        count = min(every, settings.max_new_tokens - done)
        kept.runner.run(count, first_slot=width + done - 1)  # the step after ``done`` tokens writes this slot
        done += count
    new = int(state.lengths.max())
    return torch.cat([input_ids, state.out[:, :new]], dim=1), state.logprobs[:, :new].clone()


def _compute_dtype(model: Any) -> torch.dtype:
    """The dtype attention scores are computed in: the autocast dtype inside autocast, else the weights'."""
    weight = next(model.parameters())
    if torch.is_autocast_enabled(weight.device.type):
        return torch.get_autocast_dtype(weight.device.type)
    return weight.dtype if weight.is_floating_point() else torch.float32
