"""Issue 15.5 on this machine: PPO throughput of one process against two gloo processes (DDP over CPU ranks).

    .venv/bin/python bench/two_process.py --size mid --batch-size 16 --steps 3

Runs ``bench/workloads/ppo_step.py``'s workload through ``PPOTrainer.step`` once as a plain process and once
under ``torch.distributed.run --nproc_per_node 2`` (``ACCELERATE_USE_CPU=1``, one thread per process). Each rank
steps on its own ``batch_size`` samples, so two processes learn from twice the rollouts per step; the
throughput is rollouts per second = processes x batch_size / seconds per step (median after one warm-up).
Prints one JSON line per process count and a ratio; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKER = r'''
import json, os, sys, time
sys.path.insert(0, {bench!r})
import common, torch
torch.set_num_threads(1)
args = json.loads({args!r})
PPOConfig, PPOTrainer, _, _ = common.library("ours")
tok = common.load_tokenizer(common.tokenizer_json_path("default"))
policy = common.load_policy("ours", common.ensure_random_checkpoint(args["size"], seed=0))
trainer = PPOTrainer(PPOConfig(batch_size=args["batch_size"], mini_batch_size=args["mini_batch_size"], ppo_epochs=4,
                               learning_rate=1e-5, seed=0), policy, None, tok)
rank = trainer.accelerator.process_index
vocab = min(len(tok), common.SIZES[args["size"]]["vocab_size"])
q, r, s = common.synthetic_batch(args["batch_size"], (8, 16), (16, 32), vocab, seed=1 + rank)
times = []
for i in range(1 + args["steps"]):
    t = time.perf_counter()
    trainer.step(q, r, s)
    if i:
        times.append(time.perf_counter() - t)
if rank == 0:
    print("RESULT " + json.dumps({{"processes": trainer.accelerator.num_processes, "step_seconds": times}}), flush=True)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(processes: int, args: dict) -> dict:
    code = WORKER.format(bench=str(HERE), args=json.dumps(args))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if processes == 1:
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_addr",
               "127.0.0.1", "--master_port", str(_free_port()), "--no-python", sys.executable, "-c", code]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        sys.exit(f"{processes} process(es) failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    times = sorted(result["step_seconds"])
    result["median_step_seconds"] = times[len(times) // 2]
    result["rollouts_per_second"] = processes * args["batch_size"] / result["median_step_seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="mid")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--mini-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    args = {"size": opts.size, "batch_size": opts.batch_size, "mini_batch_size": opts.mini_batch_size,
            "steps": opts.steps}
    sys.path.insert(0, str(HERE))
    import prepare

    prepare.ensure_default_tokenizer()
    prepare.ensure_models()
    results = {}
    for processes in (1, 2):
        start = time.time()
        results[processes] = run(processes, args)
        print(json.dumps({**results[processes], "wall_s": round(time.time() - start, 1), "load": os.getloadavg()}),
              flush=True)
    print(json.dumps({"settings": args, "throughput_2_over_1": results[2]["rollouts_per_second"]
                      / results[1]["rollouts_per_second"]}))


if __name__ == "__main__":
    main()
