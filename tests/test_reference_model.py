"""create_reference_model: a frozen copy whose first layers are really shared with the policy."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.reference import create_reference_model, shared_parameters
from rlhf_core.models.tiny import tiny_causal_lm, tiny_seq2seq_lm
from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead

IDS = torch.tensor([[5, 9, 17, 33, 2], [7, 8, 40, 41, 3]])  # (B=2, T=5)


def _policy(tokenizer, arch: str = "gpt2", num_layers: int = 3):
    """A tiny causal policy with a value head."""
    base = tiny_causal_lm(tokenizer, arch=arch, num_layers=num_layers)
    return AutoModelForCausalLMWithValueHead.from_pretrained(base)


def _storages(model) -> set[int]:
    """Addresses of the storages behind a model's parameters."""
    return {p.untyped_storage().data_ptr() for p in model.parameters()}


def _new_bytes(reference, policy) -> int:
    """Bytes of reference parameters whose storage the policy does not already own."""
    owned = _storages(policy)
    fresh = [p for p in reference.parameters() if p.untyped_storage().data_ptr() not in owned]
    return sum(p.numel() * p.element_size() for p in fresh)


def _split(reference, policy):
    """(shared names, unshared names) of the reference, by parameter identity with the policy."""
    policy_params = dict(policy.named_parameters())
    shared = [n for n, p in reference.named_parameters() if p is policy_params[n]]
    unshared = [n for n, p in reference.named_parameters() if p is not policy_params[n]]
    return shared, unshared


def test_full_copy_is_frozen_identical_and_independent(tokenizer):
    policy = _policy(tokenizer).eval()
    reference = create_reference_model(policy)
    assert not reference.training and all(not p.requires_grad for p in reference.parameters())
    assert all(p.requires_grad for p in policy.parameters())  # the policy is untouched
    assert not (_storages(reference) & _storages(policy))
    with torch.no_grad():
        for a, b in zip(policy(IDS), reference(IDS)):
            assert (a is None and b is None) or torch.equal(a, b)


def test_gpt2_shared_layers_are_the_same_objects_and_frozen(tokenizer):
    policy = _policy(tokenizer)
    reference = create_reference_model(policy, num_shared_layers=2)
    shared, unshared = _split(reference, policy)
    prefix = "pretrained_model.transformer."
    assert shared[:2] == [prefix + "wte.weight", prefix + "wpe.weight"]
    assert all(n.startswith((prefix + "wte", prefix + "wpe", prefix + "h.0.", prefix + "h.1.")) for n in shared)
    assert any(n.startswith(prefix + "h.1.") for n in shared)
    assert all(n.startswith((prefix + "h.2.", prefix + "ln_f", "v_head.")) for n in unshared)
    policy_params = dict(policy.named_parameters())
    for name in shared:
        assert not policy_params[name].requires_grad  # frozen in the policy too
    for name in unshared:
        ref_param = dict(reference.named_parameters())[name]
        assert policy_params[name].requires_grad and not ref_param.requires_grad
        assert ref_param.data_ptr() != policy_params[name].data_ptr()
    # GPT-2 ties its LM head to the (shared) token embedding: it stays tied in the reference.
    assert reference.pretrained_model.lm_head.weight is policy.pretrained_model.transformer.wte.weight


def test_llama_shared_layers(tokenizer):
    policy = _policy(tokenizer, "llama")
    reference = create_reference_model(policy, num_shared_layers=1)
    shared, unshared = _split(reference, policy)
    assert shared[0] == "pretrained_model.model.embed_tokens.weight"
    assert all(".layers.0." in n for n in shared[1:]) and len(shared) > 1
    assert "pretrained_model.lm_head.weight" in unshared and "pretrained_model.model.norm.weight" in unshared
    assert not any(".layers.0." in n for n in unshared)


def test_t5_shares_embedding_and_first_encoder_blocks(tokenizer):
    policy = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tiny_seq2seq_lm(tokenizer))
    reference = create_reference_model(policy, num_shared_layers=1)
    shared, unshared = _split(reference, policy)
    assert shared[0] == "pretrained_model.shared.weight"
    assert all(".encoder.block.0." in n for n in shared[1:]) and len(shared) > 1
    assert any(".decoder.block.0." in n for n in unshared)


def test_sharing_reduces_the_reference_memory(tokenizer):
    policy = _policy(tokenizer)
    full = _new_bytes(create_reference_model(policy), policy)
    shared_two = _new_bytes(create_reference_model(policy, num_shared_layers=2), policy)
    expected_saving = sum(p.numel() * p.element_size() for p in shared_parameters(policy, 2))
    assert full == sum(p.numel() * p.element_size() for p in policy.parameters())
    assert shared_two == full - expected_saving and shared_two < full


def test_training_the_policy_leaves_the_reference_unchanged(tokenizer):
    policy = _policy(tokenizer)
    reference = create_reference_model(policy, num_shared_layers=1)
    with torch.no_grad():
        before = reference(IDS)[0].clone()
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=1.0)
    logits, _, value = policy(IDS)
    (logits.mean() + value.mean()).backward()
    optimizer.step()
    with torch.no_grad():
        assert torch.equal(reference(IDS)[0], before)
        assert not torch.equal(policy.eval()(IDS)[0], before)


def test_explicit_pattern_matches_automatic_choice(tokenizer):
    policy = _policy(tokenizer)
    automatic = shared_parameters(policy, 1)
    explicit = shared_parameters(policy, 1, pattern="transformer.h.{layer}")
    assert [id(p) for p in automatic] == [id(p) for p in explicit]


def test_works_on_a_plain_transformers_model(tokenizer):
    model = tiny_causal_lm(tokenizer, num_layers=2)
    reference = create_reference_model(model, num_shared_layers=1)
    assert reference.transformer.h[0].mlp.c_fc.weight is model.transformer.h[0].mlp.c_fc.weight
    assert reference.transformer.h[1].mlp.c_fc.weight is not model.transformer.h[1].mlp.c_fc.weight


def test_errors(tokenizer):
    policy = _policy(tokenizer)
    with pytest.raises(ValueError, match="decoder.block.{layer}"):
        create_reference_model(policy, num_shared_layers=1, pattern="decoder.block.{layer}")
    with pytest.raises(ValueError, match=r"\[0, 3\).*got 3"):
        create_reference_model(policy, num_shared_layers=3)
    with pytest.raises(ValueError, match="{layer}"):
        create_reference_model(policy, num_shared_layers=1, pattern="transformer.h.1")
    with pytest.raises(ValueError, match="num_shared_layers"):
        create_reference_model(policy, pattern="transformer.h.{layer}")
    assert all(p.requires_grad for p in policy.parameters())  # nothing was frozen by a failed call


def test_peft_policy_is_rejected(tokenizer):
    from peft import LoraConfig

    config = LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer), peft_config=config)
    with pytest.raises(ValueError, match="adapter disabled"):
        create_reference_model(policy)
    with pytest.raises(ValueError, match="adapter disabled"):
        create_reference_model(policy.pretrained_model)
