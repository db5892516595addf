"""Packed forward passes (``trainers/packing``, ``trainers/forward``) and sparse tied-embedding gradients (``models/embedding_grads``).

Both are speed changes that must leave the numbers alone: packed log-probs and values equal the padded
path's (float summation order aside), a model whose attention would let packed rows see each other is
detected and keeps the padded path, and the tied weight's gradient is the dense one.
"""

from __future__ import annotations

import types

import pytest
import torch

from rlhf_core.models.embedding_grads import sparse_tied_embedding_grad, tied_input_embedding
from rlhf_core.models.tiny import build_tokenizer
from rlhf_core.trainers import forward, packing
from test_ppo_trainer import LAYOUTS, batch_in_layout, batch_of, make_policy, make_trainer


@LAYOUTS
def test_packed_forward_matches_padded(padding_side, arch, monkeypatch):
    trainer, _, _, batch = batch_in_layout(padding_side, arch)
    assert packing.can_pack(batch)
    trainer.model.eval()  # as every PPO forward pass runs (the value head's dropout off)
    with torch.no_grad():
        lm = trainer.model.pretrained_model
        assert forward.packing_works(trainer.model, lm)
        monkeypatch.setattr(forward, "should_pack", lambda *a: True)  # the packed path
        packed = forward.response_forward(trainer.model, batch, positions="suffix", entropy=True, logits=True)
        monkeypatch.setattr(forward, "should_pack", lambda *a: False)  # the padded path
        padded = forward.response_forward(trainer.model, batch, positions="suffix", entropy=True, logits=True)
    mask = batch.response_mask.bool()
    for name in ("logprobs", "values", "entropy", "logits"):
        assert torch.allclose(getattr(packed, name)[mask], getattr(padded, name)[mask], atol=1e-5), name
    assert (packed.logprobs[~mask] == 0).all() and (packed.values[~mask] == 0).all()  # padding slots hold 0


def test_pack_rows_layout():
    tok = build_tokenizer(padding_side="left")
    trainer = make_trainer(tok)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    responses = [torch.tensor([9, 10]), torch.tensor([11, 12, 13])]
    packed = packing.pack_rows(trainer.prepare_model_inputs(queries, responses))
    assert packed.input_ids.tolist() == [[5, 6, 7, 9, 10, 8, 11, 12, 13]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # token 9 is scored at packed position 2, 10 at 3; 11 at 5, 12 at 6, 13 at 7
    assert packed.score_positions.tolist() == [2, 3, 5, 6, 7]
    assert packed.slot_rows.tolist() == [0, 0, 1, 1, 1] and packed.slot_cols.tolist() == [0, 1, 0, 1, 2]


def test_a_model_that_ignores_packed_positions_keeps_the_padded_path():
    tok = build_tokenizer()
    model = make_policy(tok)
    lm = model.pretrained_model

    class Leaky(torch.nn.Module):  # attends across the packed rows: drops the position ids
        training = False

        def __call__(self, input_ids=None, position_ids=None, **kwargs):
            return model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)

        def eval(self):
            return self

        def train(self, mode=True):
            return self

    forward._PACKING_WORKS.clear()
    try:
        assert forward.packing_works(model, lm)
        assert not forward.packing_works(Leaky(), type("OtherLM", (), {"config": lm.config, "parameters": lm.parameters})())
    finally:
        forward._PACKING_WORKS.clear()


def test_packing_pays_only_when_it_saves_flops():
    tok = build_tokenizer()
    trainer = make_trainer(tok)
    queries, responses = batch_of(tok)
    batch = trainer.prepare_model_inputs(queries, responses)
    wide = types.SimpleNamespace(num_hidden_layers=12, hidden_size=768, vocab_size=50257)
    narrow_long = types.SimpleNamespace(num_hidden_layers=2, hidden_size=8, vocab_size=16)
    assert packing.packing_pays(batch, wide)  # projections dominate: dropping padding wins
    many = trainer.prepare_model_inputs(queries * 64, responses * 64)
    assert not packing.packing_pays(many, narrow_long)  # one 1000-token mask costs more than the padding saves
    assert not packing.packing_pays(batch, types.SimpleNamespace())  # unknown shape: never guess


def test_sparse_tied_embedding_gradient_equals_the_dense_one():
    tok = build_tokenizer()
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(0))
    grads = []
    for sparse in (False, True):
        model = make_policy(tok)
        embedding = tied_input_embedding(model)
        assert embedding is not None and embedding.sparse is False
        with sparse_tied_embedding_grad(model) if sparse else torch.enable_grad():
            logits, _, values = model(input_ids=ids)
        assert embedding.sparse is False  # restored
        (logits.log_softmax(-1)[..., 3].sum() + values.sum()).backward()
        grad = embedding.weight.grad
        assert grad.layout == torch.strided
        grads.append(grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_untied_or_frozen_embeddings_are_left_alone():
    tok = build_tokenizer()
    model = make_policy(tok)
    model.pretrained_model.get_input_embeddings().weight.requires_grad_(False)
    assert tied_input_embedding(model) is None
    with sparse_tied_embedding_grad(model):
        assert model.pretrained_model.get_input_embeddings().sparse is False
