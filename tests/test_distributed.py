"""PPOTrainer under ``accelerate launch`` with two CPU processes (gloo).

The test launches this very file as the worker with ``torchrun`` (two processes, gloo) and
``ACCELERATE_USE_CPU=1``, which is exactly what ``Accelerator`` needs to pick ``MULTI_CPU``.
(``accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`` starts CPU ranks through
``mpirun`` when MPI is installed; without MPI it silently starts ONE process, so the test does not
rely on it.) Each rank builds the same
tiny policy, steps twice on its OWN batch (different queries and scores per rank), and writes its
weights and returned stats. The test then checks that DDP kept both ranks' weights identical, that
the weights moved, and that the returned stats are gathered across ranks (the mean score both ranks
report is the mean of the two local means, and equal on both ranks).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2


def _local_scores(rank: int, step: int) -> list[float]:
    """Per-rank, per-step scores: rank 0 positive, rank 1 negative, so the gathered mean is distinctive."""
    return [(1.0 if rank == 0 else -3.0) + 0.25 * i + 0.1 * step for i in range(4)]


def _worker(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=0)
    trainer = PPOTrainer(config, policy, None, tokenizer)
    rank = trainer.accelerator.process_index
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    records = []
    for step in range(STEPS):
        queries = [torch.randint(3, 400, (3 + i % 2,), generator=g) for i in range(4)]
        responses = [torch.randint(3, 400, (2 + i,), generator=g) for i in range(4)]
        scores = _local_scores(rank, step)
        stats = trainer.step(queries, responses, [torch.tensor(s) for s in scores])
        records.append({key: float(stats[key]) for key in ("ppo/mean_scores", "objective/kl", "ppo/loss/total",
                                                             "objective/kl_coef")})
    model = trainer.accelerator.unwrap_model(trainer.model)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"world": trainer.accelerator.num_processes,
                                                      "type": str(trainer.accelerator.distributed_type),
                                                      "stats": records}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_ppo_keeps_ranks_identical_and_gathers_stats(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), str(Path(__file__).resolve()), "--worker", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               ACCELERATE_USE_CPU="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    from safetensors.torch import load_file

    import torch

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    meta = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [m["world"] for m in meta] == [2, 2] and "MULTI_CPU" in meta[0]["type"]
    w0, w1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert set(w0) == set(w1)
    for key in w0:
        assert torch.equal(w0[key], w1[key]), f"ranks differ on {key}"
    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    assert not torch.equal(w0["transformer.h.0.mlp.c_fc.weight"], initial["transformer.h.0.mlp.c_fc.weight"])

    for step in range(STEPS):
        expected = (sum(_local_scores(0, step)) / 4 + sum(_local_scores(1, step)) / 4) / 2
        for rank in (0, 1):
            assert meta[rank]["stats"][step]["ppo/mean_scores"] == pytest.approx(expected, abs=1e-5)
        for key in ("objective/kl", "ppo/loss/total", "objective/kl_coef"):
            assert meta[0]["stats"][step][key] == pytest.approx(meta[1]["stats"][step][key], abs=1e-6), key


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
