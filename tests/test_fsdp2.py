"""Issue 36.2: sharded training (FSDP2, ``torch.distributed.fsdp.fully_shard``).

What runs on the CPU (torch 2.13, gloo): FSDP2 itself. Two ranks shard the trainers' tiny causal LM (each
transformer block and the root: parameters are DTensors, half on each rank), take two SGD-with-momentum steps on
one global batch, and land where one unsharded process lands (tolerance: the reduce-scatter sums the two halves'
gradients in another order, ~1e-7 relative; 1e-5 absolute on weights of order 0.1). The sharded state (weights and
the optimizer's momentum, one shard per rank) is saved with ``torch.distributed.checkpoint`` after step 1; fresh
ranks load it and take step 2, which must equal the uninterrupted step 2 bit for bit (the same operations on the
same values in the same process layout).

What cannot run on the CPU: accelerate's FSDP plugin. accelerate 1.15 sets ``DistributedType.FSDP`` only when the
distributed type is a multi-accelerator one (``MULTI_GPU``, ``MULTI_XPU``, ``MULTI_NPU``, ...: the branch in
``AcceleratorState.__init__``, accelerate/state.py); under ``MULTI_CPU`` the ``fsdp_plugin`` (and
``ACCELERATE_USE_FSDP``) is dropped without a message and ``prepare`` wraps the model in DDP.
``test_accelerate_drops_the_fsdp_plugin_on_cpu_ranks`` pins that, so the day accelerate changes it this file
says so. The trainers' own FSDP2 path (accelerate's plugin, ``fsdp_version: 2``) is therefore tested only by
``test_trainers_under_accelerate_fsdp2_step_as_ddp_does``, which needs two CUDA devices and is skipped here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import ROOT, WORKER_ENV, free_port

LR, MOMENTUM = 0.5, 0.9
TOLERANCE = 1e-5  # see the module docstring
TEXTS = ["a lovely film with a warm story", "great acting", "the music was wonderful and the cast excellent",
         "a boring mess"]


def _torchrun(world: int, *args: str, cpu: bool = True, timeout: int = 300) -> None:
    env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(ROOT)}
    if not cpu:
        env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), __file__, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


# ---- FSDP2 on CPU ranks ----------------------------------------------------------------------------


def _model_and_optimizer(world: int):
    import torch
    from torch.distributed.fsdp import fully_shard

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    model = tiny_causal_lm(build_tokenizer(), seed=0)
    if world > 1:
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _step(model, optimizer, world: int, rank: int) -> None:
    """One step on this rank's half (or all) of the global batch: the global token-mean LM loss."""
    import torch

    from rlhf_core.models.tiny import build_tokenizer

    tok = build_tokenizer()
    rows = tok(TEXTS, padding=True, return_tensors="pt")
    labels = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    tokens = (labels[:, 1:] != -100).sum()  # the global batch's scored tokens
    mine = slice(rank * len(TEXTS) // world, (rank + 1) * len(TEXTS) // world)
    logits = model(input_ids=rows["input_ids"][mine], attention_mask=rows["attention_mask"][mine]).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[mine, 1:].flatten(), reduction="sum")
    (nll * world / tokens).backward()  # FSDP averages the ranks' gradients: x world makes it the global mean
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().contiguous()
            for k, v in model.state_dict().items() if v.is_floating_point()}


def _fsdp_worker(out: Path) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model, optimizer = _model_and_optimizer(world)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    _step(model, optimizer, world, rank)
    weights, optim = get_state_dict(model, optimizer)  # sharded: each rank writes its own shard
    dcp.save({"model": weights, "optim": optim}, checkpoint_id=str(out / f"ckpt-{world}"))
    _step(model, optimizer, world, rank)
    straight = _full_state(model)

    model, optimizer = _model_and_optimizer(world)  # a fresh start, as after a crash
    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optim": optim}
    dcp.load(state, checkpoint_id=str(out / f"ckpt-{world}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _step(model, optimizer, world, rank)
    resumed = _full_state(model)
    if rank == 0:
        save_file(straight, str(out / f"straight-{world}.safetensors"))
        save_file(resumed, str(out / f"resumed-{world}.safetensors"))
        (out / f"meta-{world}.json").write_text(json.dumps({"sharded": sharded, "local": local}))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    _torchrun(1, "--fsdp-worker", str(out))
    _torchrun(2, "--fsdp-worker", str(out))
    return out


def test_fsdp2_shards_on_cpu_ranks_and_steps_as_one_process(fsdp_runs):
    import torch
    from safetensors.torch import load_file

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    one, two = (json.loads((fsdp_runs / f"meta-{w}.json").read_text()) for w in (1, 2))
    total = sum(p.numel() for p in tiny_causal_lm(build_tokenizer(), seed=0).parameters())
    assert one == {"sharded": 0, "local": total}
    assert two["sharded"] > 0 and two["local"] <= total // 2 + 64  # half of every tensor (rows round up)
    a, b = (load_file(str(fsdp_runs / f"straight-{w}.safetensors")) for w in (1, 2))
    assert set(a) == set(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < TOLERANCE, f"FSDP2 on 2 ranks vs 1 process: {worst:.3g}"
    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    assert (a["transformer.h.0.mlp.c_fc.weight"] - initial["transformer.h.0.mlp.c_fc.weight"]).abs().max() > 1e-3
    assert torch.is_tensor(a["lm_head.weight"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_sharded_checkpoint_resumes_exactly(fsdp_runs, world):
    import torch
    from safetensors.torch import load_file

    straight, resumed = (load_file(str(fsdp_runs / f"{kind}-{world}.safetensors")) for kind in ("straight", "resumed"))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # weights and momentum came back exactly
    if world == 2:  # one shard file per rank: nobody gathered the state
        assert len(list((fsdp_runs / "ckpt-2").glob("*.distcp"))) == 2


# ---- accelerate's FSDP plugin ------------------------------------------------------------------------


def _accelerate_worker(out: Path) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2), cpu=True)
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    if accelerator.is_main_process:
        (out / "accelerate.json").write_text(json.dumps({"type": str(accelerator.distributed_type),
                                                         "wrapped": type(model).__name__}))


def test_accelerate_drops_the_fsdp_plugin_on_cpu_ranks(tmp_path):
    _torchrun(2, "--accelerate-worker", str(tmp_path))
    seen = json.loads((tmp_path / "accelerate.json").read_text())
    assert seen == {"type": "DistributedType.MULTI_CPU", "wrapped": "DistributedDataParallel"}, (
        "accelerate now keeps the FSDP plugin on CPU ranks: run the trainers' FSDP2 test on the CPU too")


# ---- the trainers under accelerate's FSDP2 plugin: two CUDA devices ------------------------------------


@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="accelerate's FSDP plugin needs a multi-GPU distributed type (ignored on CPU ranks: "
                           "accelerate/state.py); this needs two CUDA devices")
def test_trainers_under_accelerate_fsdp2_step_as_ddp_does(tmp_path):
    """tests/test_ddp_equivalence.py's one-step runs, once with DDP and once with FSDP2 (accelerate's plugin,
    ``fsdp_version: 2``, full shard, one unit per transformer block; the reference model kept whole on every
    rank, in eval mode, outside the plugin), on two GPUs: the same weights after the step."""
    import torch
    from safetensors.torch import load_file

    equivalence = ROOT / "tests" / "test_ddp_equivalence.py"
    for mode in ("ddp", "fsdp2"):
        out = tmp_path / mode
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RLHF_TEST_SHARDING": mode, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(equivalence), "--worker", str(out), "sft,dpo,kto,grpo,rloo,ppo"]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-5000:]
    for name in ("sft", "dpo", "kto", "grpo", "rloo", "ppo"):
        ddp, fsdp = (load_file(str(tmp_path / m / f"{name}-world2.safetensors")) for m in ("ddp", "fsdp2"))
        assert set(ddp) == set(fsdp), name
        worst = max((ddp[k].float() - fsdp[k].float()).abs().max().item() for k in ddp)
        assert worst < 1e-4, f"{name}: FSDP2 vs DDP {worst:.3g}"  # GPU reductions reorder more than the CPU's


if __name__ == "__main__" and "--fsdp-worker" in sys.argv:
    _fsdp_worker(Path(sys.argv[sys.argv.index("--fsdp-worker") + 1]))
if __name__ == "__main__" and "--accelerate-worker" in sys.argv:
    _accelerate_worker(Path(sys.argv[sys.argv.index("--accelerate-worker") + 1]))
