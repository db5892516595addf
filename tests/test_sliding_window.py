"""Sliding-window (and other windowed) attention on the paths built for CUDA, forced on the CPU.

The forward's own 4-d masks (``forward.explicit_masks``, CUDA + SDPA) and the static decode's mask are plain causal.
A model whose window is shorter than the sequence (tiny Gemma2 / Gemma3 / Mistral / Qwen2 with ``sliding_window=4``
over ~12 tokens) must still get its own mask semantics: the forward then takes transformers' mask path, and the
decode goes to ``generate`` with the reason counted. A window the sequence fits in keeps the fast paths.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM,
    Qwen2Config, Qwen2ForCausalLM,
)

from rlhf_core.models import sliding_window
from rlhf_core.trainers import decode as D
from rlhf_core.trainers import forward as forward_module
from rlhf_core.trainers.experience import build_causal_batch
from rlhf_core.trainers.forward import response_forward
from rlhf_core.trainers.generation import sample_completions

_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 512, "pad_token_id": 1, "eos_token_id": 0, "bos_token_id": 0}


def _model(family: str, window: int | None):
    torch.manual_seed(0)
    if family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**_SHAPE, head_dim=8, sliding_window=window or 4096))
    elif family == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**_SHAPE, head_dim=8, sliding_window=window or 4096))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**_SHAPE, sliding_window=window))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**_SHAPE, use_sliding_window=window is not None,
                                             sliding_window=window or 4096, max_window_layers=0))
    # what explicit_masks builds for on CUDA (Gemma2's logit soft-capping runs in eager attention only)
    model.config._attn_implementation = "eager" if family == "gemma2" else "sdpa"
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(5)
    queries = [torch.randint(3, 400, (n,), generator=g) for n in (7, 3, 6)]
    responses = [torch.randint(3, 400, (n,), generator=g) for n in (5, 8, 2)]
    return build_causal_batch(queries, responses, 1, left_pad=True)


def _logprobs(model, batch, monkeypatch, explicit: bool, packed: bool) -> torch.Tensor:
    monkeypatch.setattr(forward_module, "explicit_masks", lambda lm, device: explicit)
    monkeypatch.setattr(forward_module, "should_pack", lambda *a: packed)
    with torch.no_grad():
        return response_forward(model, batch, positions="span").logprobs[batch.response_mask.bool()]


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "qwen2"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_window_shorter_than_the_rows_gets_the_models_own_masks(family, packed, monkeypatch):
    model, batch = _model(family, window=4), _batch()
    own = _logprobs(model, batch, monkeypatch, explicit=False, packed=packed)
    cuda_path = _logprobs(model, batch, monkeypatch, explicit=True, packed=packed)
    torch.testing.assert_close(cuda_path, own, atol=1e-5, rtol=0)
    # the test can fail: the plain causal mask built here, forced over the window, scores other numbers
    monkeypatch.setattr(forward_module, "window_binds", lambda config, length: False)
    full_causal = _logprobs(model, batch, monkeypatch, explicit=True, packed=packed)
    assert (full_causal - own).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_a_window_longer_than_the_rows_keeps_the_masks_built_here(family, monkeypatch):
    model, batch = _model(family, window=64), _batch()
    built = []
    padded_mask = forward_module.padded_mask
    monkeypatch.setattr(forward_module, "padded_mask", lambda m: built.append(m.shape) or padded_mask(m))
    own = _logprobs(model, batch, monkeypatch, explicit=False, packed=False)
    cuda_path = _logprobs(model, batch, monkeypatch, explicit=True, packed=False)
    assert len(built) == 1
    torch.testing.assert_close(cuda_path, own, atol=1e-5, rtol=0)


def test_attention_window_reads_every_family():
    assert sliding_window.attention_window(_model("mistral", 4).config) == 4
    assert sliding_window.attention_window(_model("mistral", None).config) is None
    assert sliding_window.attention_window(_model("qwen2", None).config) is None
    assert sliding_window.attention_window(_model("gemma2", 4).config) == 4  # alternating layers: the shortest
    assert not sliding_window.window_binds(_model("gemma3", 4).config, 4)
    assert sliding_window.window_binds(_model("gemma3", 4).config, 5)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g) for n in (3, 7, 5)]


class _Tok:
    pad_token_id, eos_token_id = 1, 0


@pytest.mark.parametrize("family", ["mistral", "gemma3", "qwen2"])
def test_decoding_past_the_window_is_generates_and_counted(family):
    model, prompts = _model(family, window=4), _prompts()
    before = dict(D.DECODE_STATS["fallbacks"])
    torch.manual_seed(0)
    ours = sample_completions(model, _Tok(), prompts, device="cpu", do_sample=False, max_new_tokens=8)
    batch = {"input_ids": torch.stack([torch.cat([torch.ones(7 - len(p), dtype=torch.long), p]) for p in prompts])}
    batch["attention_mask"] = (batch["input_ids"] != 1).long()
    theirs = model.generate(**batch, do_sample=False, max_new_tokens=8, pad_token_id=1)[:, 7:]
    for mine, row in zip(ours.responses, theirs):
        assert torch.equal(mine, row[:len(mine)])
    reasons = {k: v - before.get(k, 0) for k, v in D.DECODE_STATS["fallbacks"].items() if v != before.get(k, 0)}
    assert sum(reasons.values()) == 1 and ours.logprobs is None
    reason = next(iter(reasons))
    assert ("attention window 4" in reason) if family == "mistral" else reason == "layer types sliding_attention"


def test_a_mistral_window_the_call_fits_in_decodes_statically_as_generate():
    model, prompts = _model("mistral", window=64), _prompts()
    plan = D.decode_plan(model, 7, {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 1})
    assert isinstance(plan, D.DecodeSettings)
    assert D.decode_plan(model, 7, {"max_new_tokens": 60, "pad_token_id": 1}).startswith("attention window 64")
    ours = sample_completions(model, _Tok(), prompts, device="cpu", do_sample=False, max_new_tokens=8)
    assert ours.logprobs is not None  # the static decode ran
    batch = {"input_ids": torch.stack([torch.cat([torch.ones(7 - len(p), dtype=torch.long), p]) for p in prompts])}
    batch["attention_mask"] = (batch["input_ids"] != 1).long()
    theirs = model.generate(**batch, do_sample=False, max_new_tokens=8, pad_token_id=1)[:, 7:]
    for mine, row in zip(ours.responses, theirs):
        assert torch.equal(mine, row[:len(mine)])
