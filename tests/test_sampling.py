"""The sampling seam (``generation.sample_completions``) and the precision it samples in (``sampling_precision``).

``sample_completions`` returns the responses ``generate_batched`` returns, each with the log-probs of its tokens
(the teacher-forced policy's, for greedy decoding), cut where the response is cut; settings only ``generate``
implements give no log-probs. A bf16 sampling copy mirrors the policy's weights (ties kept, buffers left in their
precision, in-place updates followed at the next call) and decodes what the policy cast to bf16 decodes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.decode import decode, decode_settings
from rlhf_core.trainers.generation import generate_batched, pad_queries, response_keep, sample_completions
from rlhf_core.trainers.sampling_precision import half_copy, sampler_for


@pytest.fixture(scope="module")
def setup(decoding_setup):
    return decoding_setup


def test_response_keep_cuts_after_the_first_eos_and_drops_a_distinct_pad():
    # eos 0, pad 1: row 0 keeps up to its first EOS; row 1 drops its pads; with skip=1 the start token always stays
    rows = torch.tensor([[5, 0, 7, 0], [1, 4, 1, 6]])
    assert response_keep(rows, eos_id=0, pad_id=1).tolist() == [[1, 1, 0, 0], [0, 1, 0, 1]]
    assert response_keep(rows, eos_id=0, pad_id=1, skip=1).tolist() == [[1, 1, 0, 0], [1, 1, 0, 1]]
    assert response_keep(rows, eos_id=0, pad_id=0).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # pad == EOS


def test_completions_are_generate_batched_responses_with_their_logprobs(setup):
    tok, model, prompts = setup
    kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": 9, "eos_token_id": 40}
    torch.manual_seed(4)
    done = sample_completions(model, tok, prompts, device="cpu", batch_size=3, **kwargs)
    torch.manual_seed(4)
    plain = generate_batched(model, tok, prompts, device="cpu", batch_size=3, return_prompt=False, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(done.responses, plain))
    assert [len(r) for r in done.responses] == [len(lp) for lp in done.logprobs]
    assert all((lp < 0).all() for lp in done.logprobs)
    with_prompts = generate_batched(model, tok, prompts, device="cpu", batch_size=3, do_sample=False,
                                    max_new_tokens=3)
    assert all(torch.equal(w[:len(p)], p) and len(w) == len(p) + 3 for w, p in zip(with_prompts, prompts))


def test_greedy_logprobs_are_the_policys_teacher_forced_logprobs(setup):
    tok, model, prompts = setup
    done = sample_completions(model, tok, prompts, device="cpu", do_sample=False, max_new_tokens=6)
    for prompt, response, logprobs in zip(prompts, done.responses, done.logprobs):
        ids = torch.cat([prompt, response])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
        # the pad token is suppressed (generation_defaults): renormalised over the rest of the vocabulary
        logits[:, tok.pad_token_id] = -float("inf")
        expected = logits.log_softmax(-1).gather(-1, response[:, None])[:, 0]
        assert torch.allclose(logprobs, expected, atol=1e-5)  # static vs plain forward: ~1e-6 apart


def test_settings_only_generate_implements_give_no_logprobs_and_are_counted(setup):
    from rlhf_core.trainers.decode import DECODE_STATS

    tok, model, prompts = setup
    before = DECODE_STATS["fallbacks"].get("generation settings: no_repeat_ngram_size", 0)
    done = sample_completions(model, tok, prompts, device="cpu", do_sample=False, max_new_tokens=4,
                              no_repeat_ngram_size=2)
    assert done.logprobs is None and len(done.responses) == len(prompts)
    assert DECODE_STATS["fallbacks"]["generation settings: no_repeat_ngram_size"] == before + 1


def test_on_the_cpu_the_policy_samples_as_it_is(setup):
    _, model, _ = setup
    for precision in (None, "no", "bf16", "fp16"):
        sampler = sampler_for(model, precision)
        assert sampler.model is model and not sampler.copied


def test_a_half_copy_mirrors_the_weights_and_follows_updates(setup):
    tok, _, prompts = setup
    torch.manual_seed(0)
    model = tiny_causal_lm(tok, seed=2).eval()
    shadow = half_copy(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in shadow.parameters())
    assert shadow.lm_head.weight is shadow.transformer.wte.weight  # the tie survives
    assert all(torch.equal(p.float(), q.to(torch.bfloat16).float()) for p, q in zip(shadow.parameters(),
                                                                                 model.parameters()))
    with torch.no_grad():
        model.transformer.wte.weight.add_(0.5)
    model.train()
    again = half_copy(model, torch.bfloat16)
    assert again is shadow and again.training and all(m.training for m in again.modules())
    assert torch.equal(again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16))
    model.eval()
    # decoding with the copy = decoding with the model cast to bf16
    cast = copy.deepcopy(model).to(torch.bfloat16)
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    outs = []
    for lm in (half_copy(model, torch.bfloat16), cast):
        settings = decode_settings(lm, batch["input_ids"].shape[1], {"max_new_tokens": 5, "do_sample": False,
                                                                      "pad_token_id": tok.pad_token_id})
        outs.append(decode(lm, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_a_fallback_samples_from_the_weights_the_fast_path_would(setup, monkeypatch):
    """Where the fast path would sample from a half-precision copy (CUDA under bf16, forced here), a call that goes
    to ``generate`` runs the copy's ``generate`` too, not the fp32 policy's."""
    import contextlib

    from rlhf_core.trainers import generation as G
    from rlhf_core.trainers.sampling_precision import Sampler

    tok, model, prompts = setup
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    called = []
    original = copy.generate
    monkeypatch.setattr(copy, "generate", lambda **kw: called.append("copy") or original(**kw))
    monkeypatch.setattr(model, "generate", lambda **kw: called.append("policy"))
    monkeypatch.setattr(G, "sampler_for", lambda lm, precision: Sampler(copy, contextlib.nullcontext(), copied=True))
    done = sample_completions(model, tok, prompts, device="cpu", do_sample=False, max_new_tokens=3,
                              no_repeat_ngram_size=2, mixed_precision="bf16")
    assert called == ["copy"] and done.logprobs is None and len(done.responses) == len(prompts)
