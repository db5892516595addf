"""Sampling responses from a causal LM (or encoder-decoder) for on-policy trainers: one path for all.

``sample_completions`` turns prompts into completions and their log-probs; ``PPOTrainer.generate`` and every
trainer that samples its own rollouts (GRPO, RLOO) go through it (``generate_batched`` keeps the responses).
Queries are left-padded into chunks (right-padded for encoder-decoders) and decoded together with a static KV cache
(``decode.py``; the token step replayed from a CUDA graph on a GPU, ``cuda_graphs.py``) in the policy's training
precision (``sampling_precision.py``); each response is cut after its first EOS (kept), and never contains padding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlhf_core.models.padding import pad_id_of
from rlhf_core.models.peft_support import is_peft_model
from rlhf_core.models.prepacked_linear import prepacked_linears
from rlhf_core.models.unwrap import language_model
from rlhf_core.trainers.cuda_graphs import CudaGraphs, graphs_enabled
from rlhf_core.trainers.decode import DecodeSettings, count_fallback, decode, decode_plan
from rlhf_core.trainers.sampling_precision import Sampler, sampler_for

# Queries generated together. Every decoding step is one forward pass over the whole chunk with the KV cache,
# so a larger chunk amortises per-step overhead and weight reads: on CPU, 64 tiny-model prompts x 32 tokens
# took 1.0 s at 4 per chunk and 0.15 s at 64 (bench/results.md, (b)).
DEFAULT_GENERATION_BATCH_SIZE = 64


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


def response_keep(responses: torch.Tensor, *, eos_id: int | None, pad_id: int | None, skip: int = 0) -> torch.Tensor:
    """Which positions of generated ``responses`` (b, A) are kept (b, A) bool: up to and including each row's first
    EOS, without a pad id distinct from EOS. The first ``skip`` columns (an encoder-decoder's start token, which
    may equal EOS or pad) are always kept."""
    body = responses[:, skip:]  # (b, A - skip)
    keep = torch.ones_like(body, dtype=torch.bool)
    if eos_id is not None:
        is_eos = (body == eos_id).long()
        keep &= (is_eos.cumsum(dim=1) - is_eos) == 0  # no EOS before this position
    if pad_id is not None and pad_id != eos_id:
        keep &= body != pad_id
    return torch.cat([torch.ones_like(responses[:, :skip], dtype=torch.bool), keep], dim=1)


def kept_rows(values: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """The kept entries of each row of ``values`` (b, A) as a list of 1-d tensors (two host reads in all)."""
    return list(values[keep].split(keep.sum(dim=1).tolist()))


@dataclass
class Completions:
    """What sampling returns for a list of prompts, in their order."""

    responses: list[torch.Tensor]
    """One (A_i,) long tensor per prompt: the sampled response, cut after its first EOS (kept), no padding."""
    logprobs: list[torch.Tensor] | None
    """One (A_i,) float32 tensor per prompt: each response token's log-probability under the distribution it was
    drawn from (after temperature / top-k / top-p), in the sampling precision; None where ``generate`` sampled."""


@torch.no_grad()
def sample_completions(model, tokenizer, queries: list[torch.Tensor], *, device: torch.device | str,
                       batch_size: int = DEFAULT_GENERATION_BATCH_SIZE,
                       length_sampler: Callable[[], int] | None = None, is_encoder_decoder: bool = False,
                       prepack_weights: bool = False, mixed_precision: str | None = None,
                       **generation_kwargs) -> Completions:
    """Prompts in, completions and their log-probs out: the one function every sampling trainer goes through.

    This is the seam where another sampling engine (a vLLM server, say) would plug in: it would take the same
    arguments and return the same ``Completions``. Here: queries are left-padded into chunks of ``batch_size``
    (right-padded for encoder-decoders) and decoded by ``decode.decode`` (static KV cache; on CUDA the token step
    replayed from a CUDA graph), or by ``model.generate`` for settings and models the loop does not cover.
    ``model`` is an unwrapped model (a value-head wrapper samples with its transformer);
    ``generation_kwargs`` go through ``generation_defaults``; ``length_sampler`` (if given) draws
    ``max_new_tokens`` once per chunk; ``mixed_precision`` (accelerate's setting: "no", "bf16", "fp16") is the
    policy's training precision, which sampling follows on CUDA (``sampling_precision``); ``prepack_weights``:
    the CPU opt-in of ``rlhf_core.models.prepacked_linear`` for the whole call.
    """
    kwargs = generation_defaults(tokenizer, generation_kwargs)
    batch_size = max(1, min(len(queries), batch_size))
    lm = getattr(model, "pretrained_model", model)  # the value head does not take part
    sampler = sampler_for(lm, mixed_precision)
    packing = prepacked_linears(lm, batch_size) if prepack_weights else contextlib.nullcontext()
    responses, logprobs = [], []
    with packing, sampler.context:
        for start in range(0, len(queries), batch_size):
            chunk = _sample_chunk(model, sampler, tokenizer, queries[start:start + batch_size], dict(kwargs), device,
                                  length_sampler, is_encoder_decoder)
            responses += chunk[0]
            logprobs = None if chunk[1] is None or logprobs is None else logprobs + chunk[1]
    return Completions(responses, logprobs)


@torch.no_grad()
def generate_batched(model, tokenizer, queries: list[torch.Tensor], *, device: torch.device | str,
                     batch_size: int = DEFAULT_GENERATION_BATCH_SIZE,
                     length_sampler: Callable[[], int] | None = None, return_prompt: bool = True,
                     is_encoder_decoder: bool = False, prepack_weights: bool = False,
                     mixed_precision: str | None = None, **generation_kwargs) -> list[torch.Tensor]:
    """``sample_completions``' responses, each after its query when ``return_prompt`` (decoder-only models)."""
    completions = sample_completions(model, tokenizer, queries, device=device, batch_size=batch_size,
                                     length_sampler=length_sampler, is_encoder_decoder=is_encoder_decoder,
                                     prepack_weights=prepack_weights, mixed_precision=mixed_precision,
                                     **generation_kwargs)
    if not return_prompt or is_encoder_decoder:
        return completions.responses
    return [torch.cat([q.to(r.device), r]) for q, r in zip(queries, completions.responses)]


def _sample_chunk(model, sampler: Sampler, tokenizer, chunk: list[torch.Tensor], kwargs: dict[str, Any], device,
                  length_sampler: Callable[[], int] | None,
                  is_encoder_decoder: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """One chunk of ``sample_completions``: pad, decode (or generate), clean each row."""
    if length_sampler is not None:
        kwargs["max_new_tokens"] = length_sampler()
    batch = pad_queries([q.to(device) for q in chunk], pad_id_of(tokenizer), left=not is_encoder_decoder)
    width = 0 if is_encoder_decoder else batch["input_ids"].shape[1]
    settings = "encoder-decoder" if is_encoder_decoder else decode_plan(sampler.model, width, kwargs)
    if not isinstance(settings, DecodeSettings):
        count_fallback(settings)
        # the weights the fast path would sample from: the half-precision copy where there is one (the value-head
        # wrapper's generate is its transformer's, so sampling from ``sampler.model`` skips nothing)
        generator = sampler.model if sampler.copied else model
        generated, logprobs = generator.generate(**batch, **kwargs), None  # (b, T + A) / encoder-decoder: (b, A)
    else:
        lm = sampler.model
        graphs = CudaGraphs() if graphs_enabled(batch["input_ids"].device) and not is_peft_model(lm) else None
        generated, logprobs = decode(lm, batch["input_ids"], batch["attention_mask"], settings,
                                     takes_logits_to_keep=language_model(lm) is not None, graphs=graphs)
    skip = 1 if is_encoder_decoder else 0  # the decoder-start token may equal EOS/pad
    keep = response_keep(generated[:, width:], eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                         skip=skip)  # (b, A)
    responses = kept_rows(generated[:, width:], keep)
    return responses, None if logprobs is None else kept_rows(logprobs, keep)


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
