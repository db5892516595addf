"""Under bf16 a PPO step runs no matrix product in fp32 (issue 23).

The first GPU profile found ~70 of 205 ms of GEMM time still fp32 under bf16 autocast: the separate reference
model ran outside the autocast accelerate puts around the prepared policy only. CPU autocast dispatches like
CUDA's (the same op lists decide what runs in bf16), so the CPU can list every product a step dispatches and
the dtypes it gets. Deliberately fp32 and not a GEMM: the log-softmax and entropy over the logits (chunked,
``core.token_logprobs``), the losses and the optimizer's fp32 masters.
"""

import collections
import warnings

import pytest
import torch
from accelerate.state import AcceleratorState
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.models.tiny import tiny_causal_lm

aten = torch.ops.aten
GEMMS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


class GemmDtypes(TorchDispatchMode):
    """Counts the dispatched matrix products by the dtypes of their operands."""

    def __init__(self):
        super().__init__()
        self.dtypes: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in GEMMS:
            self.dtypes[tuple(a.dtype for a in args if isinstance(a, torch.Tensor))] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def reset_accelerate():
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)  # later Accelerator()s must not inherit bf16


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["autocast", "bf16_weights"])
def test_a_bf16_ppo_step_runs_every_matrix_product_in_bf16(tokenizer, reset_accelerate, bf16_weights):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, bf16_weights=bf16_weights,
                       accelerator_kwargs={"mixed_precision": "bf16"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset
        trainer = PPOTrainer(config, model, None, tokenizer)  # a separate reference: create_reference_model
    g = torch.Generator().manual_seed(7)
    queries = [torch.randint(3, 400, (3,), generator=g) for _ in range(4)]
    responses = [torch.randint(3, 400, (4,), generator=g) for _ in range(4)]
    probe = GemmDtypes()
    with probe:
        trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert sum(probe.dtypes.values()) > 50  # rollout, reference and update forwards, the backward
    assert all(dtype == torch.bfloat16 for key in probe.dtypes for dtype in key), probe.dtypes
