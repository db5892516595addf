"""The forward every trainer shares (rlhf_core.trainers.forward): ``response_forward`` (where the LM head runs, logits
kept in the model's dtype and never copied to fp32 whole, accelerate's fp32 output copy skipped), the reference model
(a separate model under the policy's autocast, or the PEFT policy with its adapter off) and dropout off for a block."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_core import core
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead
from rlhf_core.trainers import forward as forward_module
from rlhf_core.trainers.experience import build_causal_batch
from rlhf_core.trainers.forward import (
    LOGIT_POSITIONS, dropout_off, native_dtype_outputs, reference_model, response_forward,
)


class _Wrapper(torch.nn.Module):
    """What DDP does to a policy: the model sits under ``.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class _Accelerator:
    """``unwrap_model`` as accelerate's: the model under a wrapper."""

    def unwrap_model(self, model):
        return model.module


def _peft_policy(tokenizer):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    # init_lora_weights=False: random B, so the adapter changes the logits (LoRA's default starts as the identity)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False,
                      task_type="CAUSAL_LM")
    return get_peft_model(tiny_causal_lm(tokenizer), lora).eval()


class _NoUnwrap:
    """An accelerator without mixed precision that must not be asked to unwrap anything."""

    def unwrap_model(self, model):
        raise AssertionError("a separate reference model needs no unwrapping")

    @contextlib.contextmanager
    def autocast(self):
        yield


def test_a_separate_reference_model_is_yielded_and_the_policy_left_alone():
    policy, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with reference_model(_NoUnwrap(), policy, ref, adapter_off=False) as got:
        assert got is ref


def test_a_separate_reference_model_runs_under_the_accelerators_autocast(bf16_accelerator):
    """accelerate autocasts only the prepared policy's forward; the reference (never prepared) gets the same
    autocast here, so a bf16 run has no fp32 matmul in its reference forward."""
    ref = torch.nn.Linear(2, 2)
    with reference_model(bf16_accelerator, torch.nn.Linear(2, 2), ref, adapter_off=False) as got:
        assert got(torch.ones(1, 2)).dtype == torch.bfloat16
    assert ref(torch.ones(1, 2)).dtype == torch.float32  # only inside the block


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


# ---- response_forward

def _batch(tokenizer, rows=((5, 3), (2, 6), (4, 1))):
    g = torch.Generator().manual_seed(11)
    queries = [torch.randint(3, 400, (q,), generator=g) for q, _ in rows]
    responses = [torch.randint(3, 400, (r,), generator=g) for _, r in rows]
    return build_causal_batch(queries, responses, tokenizer.pad_token_id, left_pad=True)


def test_every_logit_positions_mode_scores_the_same_log_probs(tokenizer):
    """span, suffix and all run the LM head on different positions; each slot's log-prob is the same (the LM head
    computes each row alone: equal here up to the float rounding a matmul kernel may vary by shape)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0)).eval()
    batch = _batch(tokenizer)
    with torch.no_grad():
        outs = {p: response_forward(model, batch, positions=p, entropy=True, logit_mean=True) for p in LOGIT_POSITIONS}
        full_logits, _, full_values = model(**batch.model_inputs)  # (B, T, V) every position, (B, T)
    rows = torch.arange(len(batch))[:, None]
    logp = full_logits.double().log_softmax(-1)[rows, batch.response_index]  # (B, A, V)
    expected = logp.gather(-1, batch.response_tokens[..., None])[..., 0]
    mask = batch.response_mask.bool()
    for out in outs.values():
        torch.testing.assert_close(out.logprobs[mask].double(), expected[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.entropy[mask].double(), -(logp.exp() * logp).sum(-1)[mask], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.logit_mean[mask].double(),
                                   full_logits.double()[rows, batch.response_index].mean(-1)[mask], atol=1e-5, rtol=0)
        values = torch.gather(full_values[:, :-1], 1, batch.response_index)
        torch.testing.assert_close(out.values[mask], values[mask], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="positions must be one of"):
        response_forward(model, batch, positions="last")


class _Allocations(TorchDispatchMode):
    """Records the largest fp32 tensor with a vocabulary-wide last dimension that any operator returns."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel() // self.vocab)  # rows of V fp32 values
        return out


@pytest.mark.parametrize("value_head", [False, True], ids=["lm", "value_head"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_bf16_logits_are_upcast_a_chunk_at_a_time_in_the_forward_and_the_backward(tokenizer, monkeypatch, value_head,
                                                                                    packed):
    """The model's bf16 logits never get an fp32 copy of all their rows, neither in the forward (log-probs,
    entropy) nor in the backward; with one chunk as large as the batch the same probe sees all rows at once."""
    torch.manual_seed(0)
    lm = tiny_causal_lm(tokenizer, seed=0)
    model = (AutoModelForCausalLMWithValueHead.from_pretrained(lm) if value_head else lm).to(torch.bfloat16).eval()
    vocab = lm.config.vocab_size
    batch = _batch(tokenizer)
    monkeypatch.setattr(forward_module, "should_pack", lambda *a: packed)
    scored = int(batch.response_mask.sum()) if packed else batch.response_mask.numel()  # LM-head rows scored
    for chunk_rows, expected in ((2, 2), (10_000, scored)):
        monkeypatch.setattr(core, "LOGIT_CHUNK_BYTES", chunk_rows * 4 * vocab)
        probe = _Allocations(vocab)
        with probe:
            out = response_forward(model, batch, positions="span", entropy=True)
            out.logprobs.sum().backward()
        assert out.logprobs.dtype == out.entropy.dtype == torch.float32
        assert probe.largest == expected, (chunk_rows, probe.largest)


def test_native_dtype_outputs_skips_accelerates_fp32_copy_of_the_outputs(tokenizer, bf16_accelerator):
    torch.manual_seed(0)
    model = bf16_accelerator.prepare_model(tiny_causal_lm(tokenizer, seed=0).eval())
    ids = torch.tensor([tokenizer.encode("The plot is boring and")])
    with torch.no_grad():
        converted = model(ids).logits  # accelerate's wrapper: autocast, then every output copied to fp32
        with native_dtype_outputs(model):
            native = model(ids).logits
        again = model(ids).logits
    assert converted.dtype == again.dtype == torch.float32 and native.dtype == torch.bfloat16
    assert torch.equal(native.float(), converted)  # the same bf16 numbers, only not copied


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("left_pad", [True, False], ids=["left", "right"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_4d_masks_of_a_gpu_run_score_what_transformers_masks_score(tokenizer, monkeypatch, arch, left_pad,
                                                                       packed):
    """On CUDA the forward builds its own 4-d masks (``explicit_masks``: transformers would read the 2-d mask on
    the host); forced here on the CPU, they give the numbers of transformers' own masks, gradients included."""
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, arch=arch, seed=0)).eval()
    g = torch.Generator().manual_seed(5)
    queries = [torch.randint(3, 400, (n,), generator=g) for n in (5, 2, 4)]
    responses = [torch.randint(3, 400, (n,), generator=g) for n in (3, 6, 1)]
    batch = build_causal_batch(queries, responses, tokenizer.pad_token_id, left_pad=left_pad)
    monkeypatch.setattr(forward_module, "should_pack", lambda *a: packed)
    outs = []
    for explicit in (False, True):
        monkeypatch.setattr(forward_module, "explicit_masks", lambda lm, device: explicit)
        model.zero_grad()
        out = response_forward(model, batch, positions="span")
        (out.logprobs * batch.response_mask).sum().backward()
        outs.append((out, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (own, own_grads), (explicit, explicit_grads) = outs
    mask = batch.response_mask.bool()
    torch.testing.assert_close(explicit.logprobs[mask], own.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(explicit.values[mask], own.values[mask], atol=1e-5, rtol=0)
    for a, b in zip(explicit_grads, own_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # float32 sums in another order at most


def test_a_query_sees_the_real_keys_up_to_it_and_itself():
    mask = forward_module.padded_mask(torch.tensor([[0, 1, 1], [1, 1, 0]]))[:, 0]  # (2, 3, 3)
    # left padding: the padding query sees itself only (no key at all would softmax to NaN)
    assert mask[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert mask[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    packed = forward_module.packed_mask(torch.tensor([0, 0, 1, 1, 1]))[0, 0]
    assert packed.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                     [0, 0, 1, 1, 1]]
