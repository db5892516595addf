"""``PPOConfig(bf16_weights=True)``: bf16 weights for the model, fp32 master weights for the optimizer.

The point of master weights is what bf16 alone loses: updates below half a bf16 ulp, and gradients summed in
bf16. Both are checked against plain bf16 training, which must show the loss (so the tests can fail).
"""

import warnings

import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.master_weights import MasterWeights

SCORES = [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(0.5), torch.tensor(-1.0)]


def _batch():
    g = torch.Generator().manual_seed(7)
    queries = [torch.randint(3, 400, (2 + i % 3,), generator=g) for i in range(4)]
    responses = [torch.randint(3, 400, (3 + i % 2,), generator=g) for i in range(4)]
    return queries, responses


def _trainer(tokenizer, optimizer=None, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = {"batch_size": 4, "mini_batch_size": 2, "learning_rate": 1e-3, "bf16_weights": True, **config}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset
        return PPOTrainer(PPOConfig(**config), model, None, tokenizer,
                          optimizer=None if optimizer is None else optimizer(model.parameters()))


def test_masters_keep_updates_smaller_than_half_a_bf16_ulp():
    # w = 1.0, gradient 1, SGD lr 1e-3: each update is 1e-3, below half the bf16 spacing under 1.0 (2^-9 = 0.00195).
    def run(with_masters: bool) -> torch.Tensor:
        layer = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(layer.weight)
        optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
        master = MasterWeights(layer, optimizer) if with_masters else None
        if master is None:
            layer.to(torch.bfloat16)
        for _ in range(10):
            layer.weight.grad = torch.ones_like(layer.weight)
            if master is not None:
                master.grads_to_masters()
            optimizer.step()
            if master is not None:
                master.masters_to_params()
            optimizer.zero_grad()
        return layer.weight.detach().float()

    assert run(with_masters=False).item() == 1.0  # plain bf16: every update rounds away
    assert run(with_masters=True).item() == torch.tensor(0.99).to(torch.bfloat16).item() == 0.98828125  # 253/256


def test_gradients_accumulate_in_fp32():
    layer = torch.nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(layer.parameters(), lr=1.0)
    master = MasterWeights(layer, optimizer)
    for value in (1.0, 2.0 ** -9):  # bf16 would drop the second: 1 + 2^-9 rounds to 1
        layer.weight.grad = torch.full_like(layer.weight, value)
        master.grads_to_masters()
        assert layer.weight.grad is None
    assert master.masters[0].grad.dtype == torch.float32
    assert master.masters[0].grad.item() == 1.0 + 2.0 ** -9
    assert (torch.tensor(1.0, dtype=torch.bfloat16) + 2.0 ** -9).item() == 1.0


def test_master_gradients_live_in_one_flat_buffer_kept_across_steps(tokenizer):
    """The masters' fp32 gradients are views of one buffer allocated once: a PPO step with gradient accumulation
    and ``zero_grad(set_to_none=True)`` between steps reuses the same memory and no other gradient storage."""
    trainer = _trainer(tokenizer, gradient_accumulation_steps=2)
    master = trainer._master
    queries, responses = _batch()
    trainer.step(queries, responses, SCORES)
    flat = master.flat_grad
    assert flat is not None and flat.dtype == torch.float32 and flat.numel() == sum(m.numel() for m in master.masters)
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * 4
    trainer.step(queries, responses, SCORES)
    assert master.flat_grad is flat  # kept, not reallocated
    assert all(p.grad is None for p in master.params)  # the bf16 gradients were handed over and freed
    for p in master.params:  # what a backward leaves
        p.grad = torch.full_like(p, 0.5)
    master.grads_to_masters()
    assert all(start <= m.grad.data_ptr() < end and bool((m.grad == 0.5).all()) for m in master.masters)


def test_ppo_trainer_holds_bf16_weights_and_fp32_masters(tokenizer):
    torch.manual_seed(0)
    initial = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    trainer = _trainer(tokenizer)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.ref_model.parameters()} == {torch.bfloat16}
    masters = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert {p.dtype for p in masters} == {torch.float32}
    # the masters are the fp32 weights as loaded, bit for bit (same order as model.parameters())
    assert all(torch.equal(m, p.detach()) for m, p in zip(masters, initial.parameters()))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ppo_step_updates_the_masters_and_rounds_them_into_the_weights(tokenizer, accumulation):
    trainer = _trainer(tokenizer, gradient_accumulation_steps=accumulation, mini_batch_size=2 // accumulation,
                       max_grad_norm=1.0)
    before = [m.detach().clone() for m in trainer._master.masters]
    stats = trainer.step(*_batch(), SCORES)
    assert all(torch.isfinite(torch.as_tensor(stats[k])).all() for k in ("ppo/loss/total", "objective/kl"))
    moved = [not torch.equal(b, m) for b, m in zip(before, trainer._master.masters)]
    assert sum(moved) > len(moved) // 2  # most tensors learned (a few may get no gradient)
    for param, master in zip(trainer._master.params, trainer._master.masters):
        assert param.dtype == torch.bfloat16 and param.grad is None
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))
    states = [v for s in trainer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    assert states and {v.dtype for v in states} == {torch.float32}  # Adam moments in fp32


@pytest.mark.parametrize("max_grad_norm", [None, 1e-3])
def test_gradient_clipping_acts_on_the_fp32_master_gradients(tokenizer, max_grad_norm):
    # SGD at lr 1: each update is the clipped gradient itself, so 8 updates (2 mini-batches x 4 epochs) move the
    # masters by at most 8 x max_grad_norm. Clipping the (emptied) bf16 gradients instead would not clip at all.
    trainer = _trainer(tokenizer, optimizer=lambda params: torch.optim.SGD(params, lr=1.0), max_grad_norm=max_grad_norm)
    before = torch.cat([m.detach().flatten() for m in trainer._master.masters])
    trainer.step(*_batch(), SCORES)
    moved = (torch.cat([m.detach().flatten() for m in trainer._master.masters]) - before).norm().item()
    if max_grad_norm is None:
        assert moved > 8e-3  # unclipped, the same step moves them much further
    else:
        assert 0 < moved <= 8 * max_grad_norm * (1 + 1e-4)


def test_resume_restores_the_masters_exactly(tokenizer, tmp_path):
    queries, responses = _batch()
    straight = _trainer(tokenizer)
    straight.step(queries, responses, SCORES)
    straight.save_state(str(tmp_path / "ckpt"))
    straight.step(queries, responses, SCORES)

    resumed = _trainer(tokenizer)
    resumed.load_state(str(tmp_path / "ckpt"))
    resumed.step(queries, responses, SCORES)
    for a, b in zip(straight._master.masters, resumed._master.masters):
        assert torch.equal(a, b)  # not just the bf16 rounding: the fp32 masters themselves

    with pytest.raises(ValueError, match="bf16_weights"):
        _trainer(tokenizer, bf16_weights=False).load_state(str(tmp_path / "ckpt"))


def test_bad_setups_are_refused_before_any_weight_changes(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, bf16_weights=True), model, None, tokenizer)

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="freshly built optimizer"):
        MasterWeights(layer, optimizer)
    assert layer.weight.dtype == torch.float32  # untouched


def test_lora_policy_keeps_masters_for_the_adapter_only(tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0), peft_config=lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-2, bf16_weights=True),
                             model, None, tokenizer)
    assert len(trainer._master.masters) == len(trainable)  # the frozen base has no fp32 copy
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainer.step(*_batch(), SCORES)
    second = trainer.step(*_batch(), SCORES)
    assert second["objective/kl"] != 0.0  # the adapter moved away from the adapter-disabled reference
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if n in base)


def test_shared_reference_layers_stay_shared_and_frozen(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-3, bf16_weights=True),
                             model, None, tokenizer, num_shared_layers=1)
    policy_block = model.pretrained_model.transformer.h[0].attn.c_attn.weight
    ref_block = trainer.ref_model.pretrained_model.transformer.h[0].attn.c_attn.weight
    assert policy_block is ref_block and policy_block.dtype == torch.bfloat16 and not policy_block.requires_grad
    before = policy_block.detach().clone()
    trainer.step(*_batch(), SCORES)
    assert torch.equal(before, policy_block)
