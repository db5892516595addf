"""The log-prob forwards of GRPO/RLOO: the padded path scores what a full forward scores, and RLOO's
sampling-time log-probs reuse the loss forward where that changes nothing (one forward fewer per step)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core import RLOOConfig, RLOOTrainer
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm
from rlhf_core.trainers import forward
from rlhf_core.trainers.online import trainer as online
from rlhf_core.trainers.experience import build_causal_batch
from tests._online_rl import count_e, online_args, prompt_dataset, train_logs


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


class _NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward does not take ``logits_to_keep`` (the full-logits branch)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask, position_ids):
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("wrap", [False, True], ids=["logits_to_keep", "full_logits"])
def test_padded_logprobs_and_entropy_equal_a_full_forward(tok, wrap, monkeypatch):
    lm = tiny_causal_lm(tok).eval()
    texts = [("The film was great", " and good fun"), ("A", " lovely film today and"), ("My favourite", " it")]
    queries = [torch.tensor(tok(q)["input_ids"]) for q, _ in texts]
    responses = [torch.tensor(tok(r)["input_ids"]) for _, r in texts]
    batch = build_causal_batch(queries, responses, tok.pad_token_id, left_pad=True)
    monkeypatch.setattr(forward, "should_pack", lambda *a: False)  # the padded path
    with torch.no_grad():
        logprobs, entropy = online.token_logprobs_and_entropy(_NoLogitsToKeep(lm) if wrap else lm, batch, True)
        full = lm(**batch.model_inputs).logits.double()  # (B, T, V) every position
    index, mask = batch.response_index, batch.response_mask.bool()  # (B, A)
    rows = torch.arange(len(index))[:, None]
    logp = full.log_softmax(-1)[rows, index]  # (B, A, V)
    tokens = batch.model_inputs["input_ids"][rows, index + 1]  # (B, A)
    expected = logp.gather(-1, tokens[..., None])[..., 0]
    expected_entropy = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(logprobs[mask].double(), expected[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy[mask].double(), expected_entropy[mask], atol=1e-5, rtol=1e-5)


def _train_rloo(tok, tmp_path, reuse: bool, monkeypatch) -> tuple[dict, list[dict], int]:
    """Two RLOO steps with beta > 0; returns (final parameters, logs, policy/reference forwards run)."""
    monkeypatch.setattr(online.OnlineRLTrainer, "_can_reuse_loss_forward",
                        online.OnlineRLTrainer._can_reuse_loss_forward if reuse else (lambda self: False))
    calls = []
    forward = online.token_logprobs_and_entropy
    monkeypatch.setattr(online, "token_logprobs_and_entropy", lambda *a, **k: calls.append(1) or forward(*a, **k))
    torch.manual_seed(0)
    model = tiny_causal_lm(tok)
    trainer = RLOOTrainer(model, count_e, args=online_args(RLOOConfig, tmp_path / str(reuse), beta=0.5),
                          train_dataset=prompt_dataset(), processing_class=tok)
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, train_logs(trainer), len(calls)


def test_rloo_sampling_logprobs_reuse_the_loss_forward_with_the_same_updates(tok, tmp_path, monkeypatch):
    reused, reused_logs, reused_forwards = _train_rloo(tok, tmp_path, True, monkeypatch)
    separate, separate_logs, separate_forwards = _train_rloo(tok, tmp_path, False, monkeypatch)
    assert (reused_forwards, separate_forwards) == (2 * 2, 3 * 2)  # per step: reference + loss (+ old policy)
    for key, value in separate.items():
        torch.testing.assert_close(reused[key], value, atol=1e-6, rtol=1e-5)
    for a, b in zip(reused_logs, separate_logs):
        for key in ("loss", "kl", "reward", "entropy", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("overrides, reuse", [
    ({}, True),
    ({"num_iterations": 2}, False),  # the second update is off-policy: old log-probs are needed
    ({"steps_per_generation": 2}, False),  # the generation batch spans two micro-batches
    ({"disable_dropout": False}, False),  # each pass would draw its own dropout mask
])
def test_the_loss_forward_is_reused_only_when_it_changes_nothing(tok, tmp_path, overrides, reuse):
    trainer = RLOOTrainer(tiny_causal_lm(tok), count_e, args=online_args(RLOOConfig, tmp_path, **overrides),
                          train_dataset=prompt_dataset(), processing_class=tok)
    assert trainer._can_reuse_loss_forward() is reuse
