"""``PPOConfig(torch_compile=True)`` over ragged batches: a bounded number of compilations, the eager numbers.

The compile backend is a stand-in that counts the graphs dynamo hands it and runs them as traced (what decides a
recompilation is dynamo's guards, not the backend, so the count is the real one; inductor's code generation, which
takes minutes on a CPU, is left out). ``dynamic=True`` makes one graph serve every length: after the first few
steps (new guards for the first shapes) the count stops growing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from rlhf_core import PPOConfig, PPOTrainer
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead
from rlhf_core.trainers.ppo import setup as ppo_setup


def _ragged_batches(steps: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        queries = [torch.randint(3, 400, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g) for _ in range(4)]
        responses = [torch.randint(3, 400, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g)
                     for _ in range(4)]
        yield queries, responses, [torch.tensor(1.0), torch.tensor(-0.5), torch.tensor(0.2), torch.tensor(0.0)]


def _trainer(tokenizer, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset
        return PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, seed=0, **config), model, None,
                          tokenizer)


@pytest.mark.slow
def test_compiled_ppo_over_ragged_batches_stops_compiling_and_matches_eager(tokenizer, monkeypatch):
    graphs: list[int] = []

    def counting(graph_module, example_inputs):
        graphs.append(len(graph_module.graph.nodes))
        return graph_module.forward

    monkeypatch.setattr(ppo_setup, "COMPILE_BACKEND", counting)
    batches = list(_ragged_batches(8))
    reference = _trainer(tokenizer).step(*batches[0])  # each trainer seeds the RNGs (mini-batch order) at init
    torch._dynamo.reset()
    compiled = _trainer(tokenizer, torch_compile=True)
    counts = []
    for i, (queries, responses, scores) in enumerate(batches):
        stats = compiled.step(queries, responses, scores)
        counts.append(len(graphs))
        if i == 0:
            for key in ("ppo/loss/total", "objective/kl", "ppo/policy/approxkl"):  # traced ops, fp32: ~1e-7
                assert float(stats[key]) == pytest.approx(float(reference[key]), abs=1e-5), key
    torch._dynamo.reset()
    assert counts[0] > 0  # the stand-in backend was used
    # measured: 7, 7, 7, 8, then 8 for every later length (9, 11, 11, 12, 12 while transformers' hooks were installed
    # inside the first traced forward); one compilation per shape would be ~2 per step
    assert counts[-1] == counts[4] and counts[-1] <= 10, counts


def test_compiled_transformers_trace_without_graph_breaks(tokenizer, monkeypatch):
    """transformers installs its hidden-state hooks lazily inside the first forward (a threading lock and
    ``register_forward_hook``: graph breaks under dynamo); ``compile_transformers`` installs them first, so the
    value head's forward (hidden states asked for) traces as whole graphs. Dynamo's graph-break counter says so."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(ppo_setup, "COMPILE_BACKEND", "eager")  # breaks are dynamo's, whatever the backend
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, num_layers=1, seed=0))
    torch._dynamo.reset()
    counters.clear()
    try:
        ppo_setup.compile_transformers(model)
        assert model.pretrained_model.transformer._output_capturing_hooks_installed  # before any forward
        ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(0))
        _, _, values = model(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert values.shape == (2, 7) and counters["stats"]["unique_graphs"] > 0
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
