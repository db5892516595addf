"""The fused GELU / RMSNorm / rotary embedding (``models.fused_kernels``), forced on the CPU: the same function as
transformers' eager code to rounding, in the forward and the backward, and never applied on the CPU by the trainers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)
from transformers.activations import FastGELUActivation, NewGELUActivation
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rlhf_core.models import fused_kernels
from rlhf_core.models.fused_kernels import TanhGELU, fuse_kernels, fused_rotary, fuses_on
from rlhf_core.models.tiny import tiny_causal_lm


def test_the_tanh_gelu_is_gpt2s_gelu_new_to_rounding():
    x = torch.linspace(-12, 12, 20001, dtype=torch.float64)
    fused = TanhGELU()(x)
    # float64: the two evaluation orders agree to ~1e-16 relative; a wrong constant or formula would be >1e-4 off
    torch.testing.assert_close(fused, NewGELUActivation()(x), atol=1e-12, rtol=0)
    torch.testing.assert_close(fused, FastGELUActivation()(x), atol=1e-9, rtol=0)  # its constant has 10 digits
    assert (fused - torch.nn.functional.gelu(x)).abs().max() > 1e-4  # the exact GELU is another function


def _models(tokenizer):
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": len(tokenizer)}
    return {"gpt2": tiny_causal_lm(tokenizer, arch="gpt2"), "llama": tiny_causal_lm(tokenizer, arch="llama"),
            "qwen2": Qwen2ForCausalLM(Qwen2Config(**shape)), "mistral": MistralForCausalLM(MistralConfig(**shape)),
            "gemma": GemmaForCausalLM(GemmaConfig(**shape, head_dim=8))}


# GPT-2: one GELU per layer; Llama-style: 2 norms per layer + the final one, and each layer's attention (rotary);
# Gemma: its attention only (its RMSNorm scales by 1 + weight: not the Llama one)
@pytest.mark.parametrize("arch,changed", [("gpt2", 2), ("llama", 7), ("qwen2", 7), ("mistral", 7), ("gemma", 2)])
def test_a_fused_model_gives_the_eager_logits_and_gradients_to_rounding(tokenizer, arch, changed):
    eager = _models(tokenizer)[arch].train(False)
    fused = copy.deepcopy(eager)
    assert fuse_kernels(fused) == changed
    assert set(fused.state_dict()) == set(eager.state_dict())
    ids = torch.randint(3, len(tokenizer), (3, 11), generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (eager, fused):
        model.zero_grad()
        logits = model(input_ids=ids).logits
        logits.float().logsumexp(-1).sum().backward()
        outs.append((logits.detach(), [p.grad for p in model.parameters()]))
    # fp32, another order of the same operations: ~1e-7 relative
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if arch == "gpt2":
        assert all(isinstance(block.mlp.act, TanhGELU) for block in fused.transformer.h)


def test_the_rms_norm_is_the_eager_one_in_bf16(tokenizer):
    """In bf16 the eager RMSNorm upcasts, normalises in fp32 and casts back before the weight: so does the fused."""
    eager = _models(tokenizer)["llama"].model.norm.to(torch.bfloat16)
    fused = copy.deepcopy(eager)
    fuse_kernels(fused)
    x = torch.randn(4, 7, 32, dtype=torch.bfloat16) * 3
    torch.testing.assert_close(fused(x), eager(x), atol=0, rtol=1e-2)  # ~2 bf16 ulps (2^-8 each) at most


def test_the_trainers_fuse_on_cuda_only(tokenizer):
    from rlhf_core import PPOConfig, PPOTrainer
    from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead

    assert fuses_on("cuda") and fuses_on(torch.device("cuda", 1)) and not fuses_on("cpu")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer)
    assert not any(isinstance(m, TanhGELU) for m in trainer.model.modules())  # the CPU keeps its exact results
    assert fuse_kernels(None) == 0


def _fused_modules(model) -> int:
    return sum(isinstance(m, TanhGELU) or "forward" in m.__dict__ for m in model.modules())


# fused modules per model: GPT-2 2 GELUs; Llama 5 RMSNorms and 2 rotary attentions
@pytest.mark.parametrize("arch,per_model", [("gpt2", 2), ("llama", 7)])
def test_a_ppo_step_with_the_cuda_fusion_forced_matches_the_eager_step(tokenizer, monkeypatch, arch, per_model):
    """The trainer's CUDA branch, forced on the CPU: policy and reference fused, one step's stats and updated
    weights equal the eager trainer's to fp32 rounding."""
    from rlhf_core import PPOConfig, PPOTrainer
    from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead
    from rlhf_core.trainers.ppo import trainer as ppo_trainer

    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = [torch.tensor([10, 11, 12, 13]), torch.tensor([14, 15])]
    results = []
    for forced in (False, True):
        monkeypatch.setattr(ppo_trainer, "fuses_on", lambda device: forced)
        torch.manual_seed(0)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, arch=arch, seed=0))
        trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, learning_rate=1e-3, seed=0), model, None,
                             tokenizer)
        fused = _fused_modules(trainer.model) + _fused_modules(trainer.ref_model)
        assert fused == (2 * per_model if forced else 0)  # policy and reference
        stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])
        results.append((stats, [p.detach().clone() for p in trainer.model.parameters()]))
    (eager, eager_w), (fused_stats, fused_w) = results
    for key in ("ppo/loss/total", "ppo/policy/approxkl", "objective/kl"):
        assert abs(float(fused_stats[key]) - float(eager[key])) < 1e-5, key
    # Adam divides each gradient by its own scale: an entry whose gradient is ~0 can turn a 1e-7 difference into a
    # visible share of its lr=1e-3 step; 1e-4 is a tenth of one step, far below what another activation would move
    for a, b in zip(fused_w, eager_w):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_a_copy_of_a_fused_model_runs_its_own_weights(tokenizer):
    """The bf16 sampling copy is a deepcopy: its fused norms must read the copy's weights, not the original's."""
    model = _models(tokenizer)["llama"].eval()
    fuse_kernels(model)
    twin = copy.deepcopy(model)
    assert twin.model.norm.forward.__self__ is twin.model.norm
    with torch.no_grad():
        twin.model.norm.weight.mul_(2.0)
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(twin.model.norm(x), 2.0 * model.model.norm(x))


def _rotary_inputs(dtype):
    """q (2, 4, 9, 16), k (2, 2, 9, 16) and the cos / sin Llama's rotary embedding makes for ragged positions."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 9, 16, generator=g, dtype=dtype), torch.randn(2, 2, 9, 16, generator=g, dtype=dtype)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=64))
    positions = torch.stack([torch.arange(9), torch.arange(9).clamp(min=3) - 3])  # a left-padded row
    cos, sin = rotary(q, positions)
    return q, k, cos, sin


def test_the_fused_rotary_is_transformers_rotary_to_rounding():
    q, k, cos, sin = _rotary_inputs(torch.float64)
    fused, eager = fused_rotary(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)
    for a, b in zip(fused, eager):
        # float64: the same products, summed in one addcmul instead of a multiply and an add (~1e-16 relative); a
        # sign or half swapped wrongly is O(1) off
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert (fused[0] - q * cos[:, None]).abs().max() > 0.5  # the rotation part is not negligible here
    q32, k32, cos32, sin32 = (t.float() for t in (q, k, cos, sin))
    for a, b in zip(fused_rotary(q32, k32, cos32, sin32), apply_rotary_pos_emb(q32, k32, cos32, sin32)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # fp32: one rounding fewer (addcmul), ~1 ulp
    with pytest.raises(ValueError, match="cos has 8 features, q has 16"):
        fused_rotary(q, k, cos[..., :8], sin[..., :8])  # a partial rotary is not this function


def test_the_rotary_is_replaced_only_where_it_is_llamas():
    """Every family listed calls Llama's very code (so the swap is exact to rounding); Phi3's partial rotary is
    another function and is not matched."""
    import importlib

    for name in sorted(fused_kernels._ROTARY_ATTENTION):
        family = name.removesuffix("Attention").lower()
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        assert fused_kernels._standard_rotary(getattr(module, name).forward), name
    from transformers.models.phi3.modeling_phi3 import Phi3Attention

    assert not fused_kernels._standard_rotary(Phi3Attention.forward)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma"])
def test_the_fused_rotary_runs_in_the_model_and_gives_its_logits_and_logprobs(tokenizer, monkeypatch, arch):
    """Counted: one ``fused_rotary`` call per layer per forward of the fused model, none from an eager model of the
    same class (the swap is per module, not in transformers' module); logits and log-probs as eager to rounding."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)
        return fused_rotary(*args, **kwargs)

    monkeypatch.setattr(fused_kernels, "fused_rotary", counting)
    eager = _models(tokenizer)[arch].train(False)
    fused = copy.deepcopy(eager)
    fuse_kernels(fused)
    ids = torch.randint(3, len(tokenizer), (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: positions start later in that row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    outs = []
    for model in (fused, eager):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logprobs = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        outs.append((logits, logprobs))
    assert len(calls) == eager.config.num_hidden_layers  # the fused forward only
    # fp32: addcmul rounds once where multiply-then-add rounds twice; ~1e-7 relative per layer
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


def test_a_fused_model_traces_as_one_graph(tokenizer):
    """On CUDA the fused model may also run under ``torch_compile`` / the compiled decode step: dynamo traces the
    rebound attention forward (its copied globals) and the fused norms as one graph, no graph break."""
    from torch._dynamo.utils import counters

    model = _models(tokenizer)["llama"].eval()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert fuse_kernels(model) == 7
        torch._dynamo.reset()
        counters.clear()
        try:
            got = torch.compile(model, backend="eager", dynamic=True)(input_ids=ids).logits
            assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
        finally:
            torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fused vs eager kernels: fp32 rounding
