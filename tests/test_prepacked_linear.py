"""rlhf_core.models.prepacked_linear: the same layers with weights packed once, only inside the block."""

import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.models.prepacked_linear import prepacked_linears, prepacking_available
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (3, 9), generator=g)


@pytest.mark.parametrize("arch, layers", [("gpt2", 2 * 4 + 1), ("llama", 2 * 7 + 1)])  # + the LM head
def test_logits_match_and_every_layer_is_restored(tok, arch, layers):
    # gpt2: transformers Conv1D (c_attn, c_proj, c_fc, mlp c_proj); llama: nn.Linear (q, k, v, o, gate, up, down)
    model = tiny_causal_lm(tok, arch=arch).eval()
    ids = _inputs(len(tok))
    with torch.no_grad():
        plain = model(ids).logits
        with prepacked_linears(model, batch_size=3) as switched:
            packed = model(ids).logits
        after = model(ids).logits
    assert switched == layers
    assert torch.allclose(packed, plain, atol=1e-5, rtol=1e-5)  # another summation order, not other math
    assert torch.equal(after, plain)  # own forwards back
    assert not any("forward" in module.__dict__ for module in model.modules())


def test_with_gradients_enabled_the_layers_run_their_own_forward(tok):
    model = tiny_causal_lm(tok).eval()
    ids = _inputs(len(tok))
    expected = model(ids).logits
    with prepacked_linears(model, batch_size=3):
        logits = model(ids).logits
        logits.sum().backward()
    assert torch.equal(logits, expected)
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None


def test_nothing_is_switched_where_packing_does_not_apply(tok):
    model = tiny_causal_lm(tok).double()
    assert not prepacking_available(model)
    with prepacked_linears(model, batch_size=3) as switched:
        assert switched == 0


def test_ppo_generate_with_prepacked_weights_gives_the_same_greedy_tokens(tok, monkeypatch):
    import contextlib

    from rlhf_core.trainers import generation

    switched = []

    @contextlib.contextmanager
    def recorded(model, batch_size):
        with prepacked_linears(model, batch_size) as n:
            switched.append(n)
            yield n

    monkeypatch.setattr(generation, "prepacked_linears", recorded)

    def trainer(**config):
        torch.manual_seed(0)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tok, seed=1))
        return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, **config), model, None, tok)

    queries = [torch.tensor([5, 9, 17]), torch.tensor([4, 8]), torch.tensor([30, 31, 32, 33]), torch.tensor([7])]
    settings = {"do_sample": False, "max_new_tokens": 6, "batch_size": 2}
    plain = trainer().generate(queries, **settings)
    packed = trainer(prepacked_generation=True).generate(queries, **settings)
    assert switched == [2 * 4 + 1]  # one call, the opt-in's only: every Conv1D and the LM head packed
    assert [q.tolist() for q in packed] == [q.tolist() for q in plain]
