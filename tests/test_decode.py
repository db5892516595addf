"""The lean decoding loop (``trainers/decode``) against ``model.generate``.

Greedy and sampled decoding give the same tokens as ``generate`` for the same seed (same model calls, same
processors, and the exponential race ``torch.multinomial`` itself uses for one sample); the race is also
checked against a known 3-token distribution. Settings the loop does not implement go to ``generate``.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm
from rlhf_core.trainers.decode import decode, decode_settings, sample_exponential_race
from rlhf_core.trainers.generation import generate_batched, pad_queries


@pytest.fixture(scope="module")
def setup():
    tok = build_tokenizer(padding_side="left")
    torch.manual_seed(0)
    model = tiny_causal_lm(tok, seed=0).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (3, 7, 5, 2)]
    return tok, model, prompts


def _both(model, tok, prompts, **kwargs):
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    settings = decode_settings(model, batch["input_ids"].shape[1], {"pad_token_id": tok.pad_token_id, **kwargs})
    assert settings is not None
    ours = decode(model, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True)
    theirs = model.generate(**batch, pad_token_id=tok.pad_token_id, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 12}, {"max_new_tokens": 9, "min_new_tokens": 4},
                                    {"max_new_tokens": 6, "suppress_tokens": [5, 6, 7]}])
def test_greedy_tokens_equal_generate(setup, kwargs):
    tok, model, prompts = setup
    ours, theirs = _both(model, tok, prompts, do_sample=False, **kwargs)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 12, "top_k": 0, "top_p": 1.0},
                                    {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20, "top_p": 0.9}])
def test_sampled_tokens_equal_generate_for_the_same_seed(setup, kwargs):
    tok, model, prompts = setup
    torch.manual_seed(5)
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    settings = decode_settings(model, batch["input_ids"].shape[1], {"pad_token_id": tok.pad_token_id,
                                                                     "do_sample": True, **kwargs})
    ours = decode(model, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True)
    torch.manual_seed(5)
    theirs = model.generate(**batch, pad_token_id=tok.pad_token_id, do_sample=True, **kwargs)
    assert torch.equal(ours, theirs)


def test_greedy_stops_at_eos_and_pads_finished_rows(setup):
    tok, model, prompts = setup
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    with torch.no_grad():
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
        first = model(**batch, position_ids=positions).logits[:, -1].argmax(-1)  # each row's greedy first token
    # make row 0's first greedy token the EOS: that row finishes at once, the others go on
    settings = decode_settings(model, batch["input_ids"].shape[1], {"max_new_tokens": 5, "do_sample": False,
                                                                     "eos_token_id": int(first[0]), "pad_token_id": 1})
    out = decode(model, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True)
    width = batch["input_ids"].shape[1]
    assert out[0, width] == first[0] and (out[0, width + 1:] == 1).all()


def test_exponential_race_samples_the_categorical_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).expand(60000, -1)
    counts = torch.bincount(sample_exponential_race(probs), minlength=4).float() / 60000
    assert counts[3] == 0  # a zero-probability token is never drawn
    assert torch.allclose(counts[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.01)  # ~5 standard errors


def test_sampling_matches_generates_distribution(setup):
    tok, model, prompts = setup
    prompt = [prompts[1]] * 400
    freq = []
    for fast in (True, False):
        torch.manual_seed(1)
        import rlhf_core.trainers.generation as G

        original = G.decode_settings
        if not fast:
            G.decode_settings = lambda *a: None
        try:
            out = generate_batched(model, tok, prompt, device="cpu", batch_size=200, return_prompt=False,
                                   do_sample=True, top_k=20, temperature=0.8, max_new_tokens=1)
        finally:
            G.decode_settings = original
        freq.append(torch.bincount(torch.stack([o[0] for o in out]), minlength=model.config.vocab_size).float() / 400)
    # same next-token distribution: total variation within sampling noise of 400 draws each
    assert 0.5 * (freq[0] - freq[1]).abs().sum() < 0.2


def test_other_settings_go_to_generate(setup):
    tok, model, _ = setup
    assert decode_settings(model, 4, {"max_new_tokens": 3, "repetition_penalty": 1.3}) is None
    assert decode_settings(model, 4, {"max_new_tokens": 3, "num_beams": 2}) is None
    assert decode_settings(model, 4, {"max_length": 9}) is None  # only max_new_tokens is implemented
    assert decode_settings(model, 4, {"max_new_tokens": 3, "top_p": 0.9, "temperature": 0.7}) is not None
    # neutral values add no processor in generate either (TRL 1.16's GRPO passes repetition_penalty=1.0)
    assert decode_settings(model, 4, {"max_new_tokens": 3, "repetition_penalty": 1.0, "num_beams": 1}) is not None
