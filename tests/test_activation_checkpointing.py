"""Activation checkpointing in the trainers' gradient forwards (``forward.checkpointing_in_eval``).

PPO, GRPO and RLOO run their gradient forwards in eval mode (no dropout), where transformers would skip the
checkpointing that ``gradient_checkpointing=True`` asked for. Here it runs (the layers' checkpoint function is
called) and changes no number; off (the default) nothing is checkpointed.
"""

from __future__ import annotations

import pytest
import torch

from rlhf_core import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, RLOOConfig, RLOOTrainer
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead
from tests._online_rl import count_e, online_args, prompt_dataset


def _count_checkpoints(layers) -> list[int]:
    calls = []
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            inner = layer._gradient_checkpointing_func
            layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    return calls


def test_ppo_checkpoints_its_eval_mode_minibatch_forward_and_gets_the_same_update(tokenizer):
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = [torch.tensor([10, 11, 12, 13]), torch.tensor([14, 15])]
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)  # the value head's initialisation
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
        trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, learning_rate=1e-3, seed=0,
                                       gradient_checkpointing=checkpointing), model, None, tokenizer)
        calls = _count_checkpoints(trainer.model.pretrained_model.transformer.h)
        stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])
        runs.append((len(calls), stats, [p.detach().clone() for p in trainer.model.parameters()]))
        assert not trainer.model.pretrained_model.transformer.h[0].training  # eval mode is put back
    (off_calls, off_stats, off_weights), (on_calls, on_stats, on_weights) = runs
    assert off_calls == 0 and on_calls > 0
    assert float(on_stats["ppo/loss/total"]) == pytest.approx(float(off_stats["ppo/loss/total"]), abs=1e-6)
    for a, b in zip(on_weights, off_weights):  # the recomputation repeats the same operations on the same inputs
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("trainer_cls,config_cls", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_grpo_and_rloo_checkpoint_with_dropout_disabled(tokenizer, tmp_path, monkeypatch, trainer_cls, config_cls):
    import transformers.modeling_utils

    calls = []
    checkpoint = transformers.modeling_utils.checkpoint  # what transformers' checkpointing calls for each layer
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint",
                        lambda *a, **k: calls.append(1) or checkpoint(*a, **k))
    args = online_args(config_cls, tmp_path, max_steps=1, gradient_checkpointing=True)
    assert args.disable_dropout
    trainer = trainer_cls(tiny_causal_lm(tokenizer), count_e, args=args, train_dataset=prompt_dataset(8),
                          processing_class=tokenizer)
    trainer.train()  # transformers' Trainer enables checkpointing when training starts
    assert calls and all(layer.gradient_checkpointing for layer in trainer.model.transformer.h)
