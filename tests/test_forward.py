"""The helpers every trainer's forward passes share (rlhf_core.trainers.forward): the reference model (a separate
model, or the PEFT policy with its adapter off) and dropout off for a block."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.forward import dropout_off, reference_model


class _Wrapper(torch.nn.Module):
    """What DDP does to a policy: the model sits under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class _Accelerator:
    """``unwrap_model`` as accelerate's: the model under a wrapper."""

    def unwrap_model(self, model):
        return model.module


class _NoUnwrap:
    def unwrap_model(self, model):
        raise AssertionError("a separate reference model needs no unwrapping")


def _peft_policy(tokenizer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # init_lora_weights=False: random B, so the adapter changes the logits (LoRA's default starts as the identity)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False,
                      task_type="CAUSAL_LM")
    return get_peft_model(tiny_causal_lm(tokenizer), lora).eval()


def test_a_separate_reference_model_is_yielded_and_the_policy_left_alone():
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with reference_model(_NoUnwrap(), policy, ref, adapter_off=False) as got:
        assert got is ref


def test_adapter_off_yields_the_policy_with_its_adapter_disabled_for_the_block_only(tokenizer):
    policy = _peft_policy(tokenizer)
    ids = torch.tensor([tokenizer.encode("The plot is boring and")])
    with torch.no_grad():
        with_adapter = policy(ids).logits
        with policy.disable_adapter():
            base = policy(ids).logits  # the reference's numbers, by PEFT itself
        assert not torch.equal(with_adapter, base)
        wrapped = _Wrapper(policy)
        with reference_model(_Accelerator(), wrapped, None, adapter_off=True) as got:
            assert got is wrapped
            assert torch.equal(policy(ids).logits, base)
        assert torch.equal(policy(ids).logits, with_adapter)
        with pytest.raises(RuntimeError, match="inside"):
            with reference_model(_Accelerator(), wrapped, None, adapter_off=True):
                raise RuntimeError("inside")
        assert torch.equal(policy(ids).logits, with_adapter)  # the adapter is back after an error too


def test_dropout_off_runs_the_block_in_eval_mode_and_restores_the_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x = torch.ones(4, 8)
    with dropout_off(model):
        assert not model.training and not model[1].training
        assert torch.equal(model(x), model(x))  # no dropout mask drawn
    assert model.training and model[1].training
    with pytest.raises(RuntimeError, match="inside"):
        with dropout_off(model):
            raise RuntimeError("inside")
    assert model.training  # restored after an error too
    with dropout_off(model, enabled=False):
        assert model.training
    model.eval()
    with dropout_off(model):
        pass
    assert not model.training  # a model in eval mode stays there
