"""A lean decoding loop for the sampling settings RL trainers use; ``model.generate`` for everything else.

``generate`` is general: per token it runs stopping-criteria objects, output bookkeeping, cache and mask
preparation through generic hooks, and samples with ``torch.multinomial``. For a decoder-only LM with plain
settings (greedy or sampling with temperature / top-k / top-p, suppressed tokens, a minimum length, EOS and
pad ids, ``max_new_tokens``) this loop does the same model calls (same inputs, position ids, attention mask
and KV cache as ``generate`` builds them, the logits processors of transformers itself) and samples as
``torch.multinomial(probs, 1)`` does: an exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)`` per token (token
i with probability p_i exactly), drawn from the same generator in the same order, so the tokens are the ones
``generate`` returns for the same seed, greedy or sampled (tests/test_decode.py). Any other setting, or a
model that does not fit, goes to ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# Generation settings the loop implements exactly; any other non-default field sends the call to `generate`.
_SUPPORTED = {"do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "min_length", "min_new_tokens",
              "suppress_tokens", "pad_token_id", "eos_token_id", "bos_token_id", "use_cache",
                        "transformers_version", "_from_model_config", "decoder_start_token_id"}
# Output options that change nothing while they are off (model configs often spell them out as False).
_OFF_OPTIONS = {"output_attentions", "output_hidden_states", "output_scores", "output_logits",
                "return_dict_in_generate"}
# Settings at the value for which generate adds no processor (TRL 1.16's GRPO passes repetition_penalty=1.0).
_NEUTRAL = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "num_beams": 1, "num_beam_groups": 1,
            "num_return_sequences": 1, "length_penalty": 1.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
            "eta_cutoff": 0.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0}


@dataclass(kw_only=True)
class DecodeSettings:
    """What the loop needs from the merged generation config."""

    max_new_tokens: int
    do_sample: bool
    eos_ids: list[int]
    pad_id: int | None
    processors: Any
    """transformers ``LogitsProcessorList``: min length, suppressed tokens, then temperature/top-k/top-p."""


def decode_settings(model: Any, prompt_len: int, kwargs: dict[str, Any]) -> DecodeSettings | None:
    """The loop's settings for ``model.generate(**kwargs)``, or None when ``generate`` must run it."""
    from transformers import GenerationConfig

    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False) or not hasattr(model, "generation_config"):
        return None
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return None  # virtual tokens: generate handles them
    merged = GenerationConfig(**model.generation_config.to_dict())
    unknown = merged.update(**kwargs)
    active = {k for k, v in merged.to_diff_dict().items()
              if not (k in _OFF_OPTIONS and not v) and not (k in _NEUTRAL and v == _NEUTRAL[k])}
    if unknown or not active <= _SUPPORTED or not merged.use_cache:
        return None
    if merged.max_new_tokens is None or merged.max_new_tokens < 1:
        return None
    eos = merged.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    pad = merged.pad_token_id if merged.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    return DecodeSettings(max_new_tokens=int(merged.max_new_tokens), do_sample=bool(merged.do_sample),
                          eos_ids=eos_ids, pad_id=pad, processors=_processors(merged, prompt_len, eos_ids))


def _processors(config: Any, prompt_len: int, eos_ids: list[int]) -> Any:
    """The logits processors ``generate`` builds for these settings, in its order."""
    from transformers.generation import (
        LogitsProcessorList,
        MinLengthLogitsProcessor,
        MinNewTokensLengthLogitsProcessor,
        SuppressTokensLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    out = LogitsProcessorList()
    if config.suppress_tokens is not None:
        out.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
    if eos_ids and config.min_length is not None and config.min_length > 0:
        out.append(MinLengthLogitsProcessor(config.min_length, eos_ids))
    if eos_ids and config.min_new_tokens is not None and config.min_new_tokens > 0:
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, eos_ids))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            out.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            out.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    return out


def sample_exponential_race(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` (b, V), token i with probability p_i: argmax of p_i / E_i, E_i ~ Exp(1)."""
    return probs.div(torch.empty_like(probs).exponential_(1.0)).argmax(dim=-1)  # (b,)


@torch.no_grad()
def decode(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: DecodeSettings,
           takes_logits_to_keep: bool) -> torch.Tensor:
    """Left-padded prompts (b, T) -> prompts and generated tokens (b, T + n), as ``generate`` returns them.

    Finished rows (an EOS was generated) continue with the pad id; the loop stops when every row has
    finished or after ``max_new_tokens``.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    mask = attention_mask
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (b, T): as generate computes them
    keep = {"logits_to_keep": 1} if takes_logits_to_keep else {}
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, **keep)
    sequences = input_ids
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # (b,)
    eos = torch.tensor(settings.eos_ids, device=input_ids.device, dtype=torch.long)
    for step in range(settings.max_new_tokens):
        scores = settings.processors(sequences, out.logits[:, -1, :].to(copy=True, dtype=torch.float32))  # (b, V)
        if settings.do_sample:
            tokens = sample_exponential_race(torch.softmax(scores, dim=-1))
        else:
            tokens = scores.argmax(dim=-1)
        if settings.pad_id is not None:
            tokens = torch.where(unfinished, tokens, torch.full_like(tokens, settings.pad_id))
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        if len(eos):
            unfinished &= ~torch.isin(tokens, eos)
        if step == settings.max_new_tokens - 1 or not bool(unfinished.any()):
            break
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True)
    return sequences
