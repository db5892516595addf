"""Sampling responses from a causal LM (or encoder-decoder) for on-policy trainers: one fast path for all.

Used by ``PPOTrainer.generate`` and by every trainer that samples its own rollouts (GRPO, RLOO). Queries are
left-padded into chunks (right-padded for encoder-decoders) and decoded together with the KV cache; each
response is cut after its first EOS (kept), and never contains padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from rlhf_core.trainers.decode import decode, decode_settings
from rlhf_core.models.prepacked_linear import prepacked_linears
from rlhf_core.models.unwrap import language_model

# Queries generated together. Every decoding step is one forward pass over the whole chunk with the KV cache,
# so a larger chunk amortises per-step overhead and weight reads: on CPU, 64 tiny-model prompts x 32 tokens
# took 1.0 s at 4 per chunk and 0.15 s at 64 (bench/results.md, (b)).
DEFAULT_GENERATION_BATCH_SIZE = 64


def pad_id_of(tokenizer) -> int:
    """The id used to pad queries: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def generation_defaults(tokenizer, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate`` kwargs with the pad id set, a distinct pad token suppressed, and ``top_k=0.0`` made an int."""
    kwargs = dict(kwargs)
    kwargs.setdefault("pad_token_id", pad_id_of(tokenizer))
    # A pad token distinct from EOS is not text: never sample it, so no pad id can leak into a response.
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        kwargs.setdefault("suppress_tokens", [tokenizer.pad_token_id])
    if kwargs.get("top_k") == 0.0:
        kwargs["top_k"] = 0  # the spec's examples pass 0.0; transformers wants an int
    return kwargs


def pad_queries(queries: list[torch.Tensor], pad_id: int, left: bool = True) -> dict[str, torch.Tensor]:
    """Pad 1-d queries into ``input_ids``/``attention_mask`` (B, T): left for decoder-only generation."""
    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long, device=queries[0].device)  # (B, T)
    mask = torch.zeros_like(ids)  # (B, T)
    for i, q in enumerate(queries):
        cols = slice(width - len(q), width) if left else slice(0, len(q))
        ids[i, cols], mask[i, cols] = q, 1
    return {"input_ids": ids, "attention_mask": mask}


def clean_generation(row: torch.Tensor, mask: torch.Tensor, return_prompt: bool, *, eos_id: int | None,
                     pad_id: int | None, is_encoder_decoder: bool = False) -> torch.Tensor:
    """One generated row: drop left padding (and the prompt if asked); cut the response after its first EOS.

    ``row`` (T + A,) is the padded query followed by the response (decoder-only) or the decoder output
    (encoder-decoder); ``mask`` (T,) is the query's attention mask. A pad id distinct from EOS is removed.
    """
    if is_encoder_decoder:
        prompt, response = row[:0], row
    else:
        prompt_len = int(mask.sum())
        prompt = row[len(mask) - prompt_len: len(mask)]
        response = row[len(mask):]
    skip = 1 if is_encoder_decoder else 0  # the decoder-start token may equal EOS/pad
    hits = (response[skip:] == eos_id).nonzero()
    if eos_id is not None and len(hits):
        response = response[: skip + int(hits[0]) + 1]
    if pad_id is not None and pad_id != eos_id:
        response = torch.cat([response[:skip], response[skip:][response[skip:] != pad_id]])
    return torch.cat([prompt, response]) if return_prompt else response


@torch.no_grad()
def generate_batched(model, tokenizer, queries: list[torch.Tensor], *, device: torch.device | str,
                     batch_size: int = DEFAULT_GENERATION_BATCH_SIZE,
                     length_sampler: Callable[[], int] | None = None, return_prompt: bool = True,
                     is_encoder_decoder: bool = False, prepack_weights: bool = False,
                     **generation_kwargs) -> list[torch.Tensor]:
    """Generate for a list of 1-d queries in padded chunks of ``batch_size``; one cleaned tensor per query.

    ``model`` is an unwrapped model with ``generate``; ``generation_kwargs`` go to ``generate`` after
    ``generation_defaults``. ``length_sampler`` (if given) draws ``max_new_tokens`` once per chunk.
    ``prepack_weights``: the CPU opt-in of ``rlhf_core.models.prepacked_linear`` for the whole call.
    """
    kwargs = generation_defaults(tokenizer, generation_kwargs)
    batch_size = max(1, min(len(queries), batch_size))
    lm = getattr(model, "pretrained_model", model)  # the value head does not take part
    with prepacked_linears(lm, batch_size) if prepack_weights else contextlib.nullcontext():
        return [row for start in range(0, len(queries), batch_size)
                for row in _generate_chunk(model, tokenizer, queries[start:start + batch_size], kwargs, device,
                                           length_sampler, return_prompt, is_encoder_decoder)]


def _generate_chunk(model, tokenizer, chunk: list[torch.Tensor], kwargs: dict[str, Any], device,
                    length_sampler: Callable[[], int] | None, return_prompt: bool,
                    is_encoder_decoder: bool) -> list[torch.Tensor]:
    """One chunk of ``generate_batched``: pad, generate, one cleaned tensor per query."""
    if length_sampler is not None:
        kwargs["max_new_tokens"] = length_sampler()
    batch = pad_queries([q.to(device) for q in chunk], pad_id_of(tokenizer), left=not is_encoder_decoder)
    generated = _generate(model, batch, kwargs, is_encoder_decoder)  # (b, T + A)
    return [clean_generation(row, mask, return_prompt, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                             is_encoder_decoder=is_encoder_decoder)
            for row, mask in zip(generated, batch["attention_mask"])]


def _generate(model, batch: dict[str, torch.Tensor], kwargs: dict[str, Any], is_encoder_decoder: bool) -> torch.Tensor:
    """One padded chunk: the lean loop (``decode``) when the settings allow it, else ``model.generate``."""
    lm = getattr(model, "pretrained_model", model)  # the value-head wrapper generates with its transformer
    settings = None if is_encoder_decoder else decode_settings(lm, batch["input_ids"].shape[1], kwargs)
    if settings is None:
        return model.generate(**batch, **kwargs)
    return decode(lm, batch["input_ids"], batch["attention_mask"], settings,
                  takes_logits_to_keep=language_model(lm) is not None)


@torch.no_grad()
def generate_single(model, tokenizer, query: torch.Tensor, *, device: torch.device | str, return_prompt: bool = True,
                    is_encoder_decoder: bool = False, **generation_kwargs) -> torch.Tensor:
    """Generate for one 1-d query; the raw (1, L) output (prompt dropped if asked), as classic TRL returns it."""
    kwargs = generation_defaults(tokenizer, generation_kwargs)
    output = model.generate(input_ids=query.unsqueeze(0).to(device),
                            attention_mask=torch.ones_like(query).unsqueeze(0).to(device), **kwargs)
    if not return_prompt and not is_encoder_decoder:
        output = output[:, query.shape[0]:]
    return output
