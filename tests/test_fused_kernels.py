"""The one-kernel GELU / RMSNorm (``models.fused_kernels``), forced on the CPU: the same function as transformers'
eager modules to rounding, in the forward and the backward, and never applied on the CPU by the trainers."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.activations import FastGELUActivation, NewGELUActivation

from rlhf_core.models.fused_kernels import TanhGELU, fuse_kernels, fuses_on
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
            "qwen2": Qwen2ForCausalLM(Qwen2Config(**shape)), "mistral": MistralForCausalLM(MistralConfig(**shape))}


@pytest.mark.parametrize("arch,changed", [("gpt2", 2), ("llama", 5), ("qwen2", 5), ("mistral", 5)])
def test_a_fused_model_gives_the_eager_logits_and_gradients_to_rounding(tokenizer, arch, changed):
    eager = _models(tokenizer)[arch].train(False)
    fused = copy.deepcopy(eager)
    assert fuse_kernels(fused) == changed  # GPT-2: one GELU per layer; Llama-style: 2 norms per layer + final
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


def test_a_ppo_step_with_the_cuda_fusion_forced_matches_the_eager_step(tokenizer, monkeypatch):
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
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
        trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, learning_rate=1e-3, seed=0), model, None,
                             tokenizer)
        fused = [isinstance(m, TanhGELU) for m in (*trainer.model.modules(), *trainer.ref_model.modules())]
        assert sum(fused) == (4 if forced else 0)  # 2 layers x (policy, reference)
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
