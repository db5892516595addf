"""PPO's loop over mini-batches reads no tensor value on the host.

On a GPU every such read (``.item()``, ``float(t)``, ``if t:``, an output whose size depends on values such as
``nonzero``) waits for every kernel queued before it; once per mini-batch that leaves the GPU idle while the host
catches up. The CPU tests cannot watch a GPU wait, but they can list the operators the loop dispatches: the ones
that need values on the host are the same on both devices (the decode step's test does the same).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_core.trainers import forward
from test_ppo_trainer import batch_of, make_trainer

aten = torch.ops.aten
# operators whose result needs tensor values on the host (a copy to the host, or an output sized by the values)
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
              aten.is_nonzero.default, aten.equal.default, aten._unique2.default, aten.unique_consecutive.default,
              aten.repeat_interleave.Tensor}


class HostReads(TorchDispatchMode):
    """Records every dispatched operator that reads tensor values on the host (boolean-mask indexing too)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
        if func in HOST_READS or bool_index:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def gpu_masks(monkeypatch):
    """The attention masks a CUDA run builds (``forward.explicit_masks``): on the CPU transformers prepares its own
    from the 2-d mask, which reads it on the host (harmless there, and it keeps the CPU results byte-identical)."""
    monkeypatch.setattr(forward, "explicit_masks", lambda lm, device: lm is not None)


def reads_in_the_minibatch_loop(trainer, scores=(1.0, -1.0, 0.5, 2.0)) -> list[str]:
    """Run one ``step`` with the probe on inside ``_optimise`` (the epochs over mini-batches) only."""
    probe, optimise = HostReads(), trainer._optimise

    def probed(*args, **kwargs):
        with probe:
            return optimise(*args, **kwargs)

    trainer._optimise = probed
    queries, responses = batch_of(trainer.tokenizer)
    trainer.step(queries, responses, [torch.tensor(s) for s in scores])
    return probe.reads


@pytest.mark.parametrize("config", [
    {},
    {"gradient_accumulation_steps": 2, "batch_size": 4, "mini_batch_size": 1},
    {"max_grad_norm": 0.5},
    {"bf16_weights": True},
    {"kl_penalty": "full", "ratio_threshold": 0.5},  # every update zeroed by the ratio guard: still no read
], ids=["default", "accumulation", "clipping", "bf16_weights", "full_kl_ratio_guard"])
def test_no_host_read_inside_the_loop_over_mini_batches(tokenizer, config):
    trainer = make_trainer(tokenizer, **config)
    with pytest.warns() if config.get("ratio_threshold") else _no_warning():
        reads = reads_in_the_minibatch_loop(trainer)
    assert reads == []


def test_a_nonfinite_update_is_still_skipped_without_a_read_in_the_loop(tokenizer):
    trainer = make_trainer(tokenizer, max_nonfinite_updates=100)
    trainer.model.v_head.summary.weight.register_hook(lambda grad: grad * float("nan"))
    with pytest.warns(UserWarning, match="non-finite gradient norm"):
        assert reads_in_the_minibatch_loop(trainer) == []


def test_the_probe_sees_the_reads_early_stopping_makes(tokenizer):
    """Early stopping reads the KL once per epoch (to leave the loop): the probe must see it, or the tests above
    would prove nothing."""
    trainer = make_trainer(tokenizer, early_stopping=True, target_kl=1e9, ppo_epochs=3)
    assert reads_in_the_minibatch_loop(trainer).count("aten._local_scalar_dense.default") == 3


def test_the_probe_sees_transformers_own_mask_preparation(tokenizer, monkeypatch):
    """Without the 4-d masks, transformers' mask preparation reads every forward's mask on the host."""
    monkeypatch.setattr(forward, "explicit_masks", lambda lm, device: False)
    assert len(reads_in_the_minibatch_loop(make_trainer(tokenizer))) >= 8  # 4 epochs x 2 mini-batches


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
