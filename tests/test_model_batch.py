"""``ModelBatch.trimmed``: a sub-batch without its all-padding columns gives the same log-probs and values."""

import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.models.tiny import tiny_causal_lm, tiny_seq2seq_lm
from rlhf_core.trainers.experience import build_causal_batch, build_seq2seq_batch
from rlhf_core.trainers.forward import response_forward


def _pairs(lengths):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 400, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("left_pad", [True, False])
def test_causal_trim_drops_padding_columns_and_keeps_outputs(tokenizer, left_pad):
    queries, responses = _pairs([2, 9, 3, 2]), _pairs([3, 6, 2, 4])  # row 1 is the long one
    batch = build_causal_batch(queries, responses, pad_token_id=0, left_pad=left_pad)
    sub = batch.rows(torch.tensor([0, 2, 3]))  # the short rows: padded to row 1's width
    trimmed = sub.trimmed()
    width = max(len(queries[i]) + len(responses[i]) for i in (0, 2, 3))
    assert sub.model_inputs["input_ids"].shape[1] == 15 and trimmed.model_inputs["input_ids"].shape[1] == width
    assert torch.equal(trimmed.response_mask, sub.response_mask)
    # every real response token is still the same token at the trimmed index
    for b in range(3):
        for a in range(int(sub.response_mask[b].sum())):
            assert (trimmed.model_inputs["input_ids"][b, trimmed.response_index[b, a] + 1]
                    == sub.model_inputs["input_ids"][b, sub.response_index[b, a] + 1])
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    full, cut = (response_forward(model.eval(), x, positions="suffix") for x in (sub, trimmed))
    mask = sub.response_mask.bool()
    torch.testing.assert_close(cut.logprobs[mask], full.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(cut.values[mask], full.values[mask], atol=1e-5, rtol=0)
    assert trimmed.trimmed().model_inputs["input_ids"].shape == trimmed.model_inputs["input_ids"].shape


def test_seq2seq_trim_keeps_outputs(tokenizer):
    queries, responses = _pairs([2, 9, 3]), _pairs([3, 7, 2])
    batch = build_seq2seq_batch(queries, responses, pad_token_id=0, left_pad=False)
    sub = batch.rows(torch.tensor([0, 2]))
    trimmed = sub.trimmed()
    assert trimmed.model_inputs["input_ids"].shape[1] == 3 and trimmed.model_inputs["decoder_input_ids"].shape[1] == 3
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tiny_seq2seq_lm(tokenizer, seed=0)).eval()
    full, cut = (response_forward(model, x, positions="suffix") for x in (sub, trimmed))
    mask = sub.response_mask.bool()
    torch.testing.assert_close(cut.logprobs[mask], full.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(cut.values[mask], full.values[mask], atol=1e-5, rtol=0)


def test_step_with_and_without_trimming_agree(tokenizer, monkeypatch):
    """One PPO step: trimming changes no stat beyond float noise (the trainer trims every forward chunk).

    Plain SGD, so the weights differ by lr x (gradient difference). Adam would divide a near-zero gradient by its
    own magnitude and turn float noise of either sign into a full +-lr step (seen: 1.4e-5 apart after 8 updates).
    """
    from rlhf_core.trainers.experience import ModelBatch

    def run():
        torch.manual_seed(0)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
        trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-3, seed=0), model, None,
                             tokenizer, optimizer=sgd)
        stats = trainer.step(_pairs([2, 9, 3, 2]), _pairs([3, 6, 2, 4]), [torch.tensor(x) for x in (1.0, -1.0, 0.5, 2.0)])
        return stats, {k: v.detach().clone() for k, v in model.state_dict().items()}

    trimmed_stats, trimmed_weights = run()
    monkeypatch.setattr(ModelBatch, "trimmed", lambda self: self)
    full_stats, full_weights = run()
    for key in ("ppo/loss/total", "objective/kl", "ppo/returns/mean", "ppo/val/vpred"):
        assert trimmed_stats[key] == pytest.approx(full_stats[key], abs=1e-5), key
    for key in full_weights:
        torch.testing.assert_close(trimmed_weights[key], full_weights[key], atol=1e-6, rtol=0)
