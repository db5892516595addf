"""Soak: many PPO steps on a tiny model; resident memory and step time must not grow after warm-up.

    OMP_NUM_THREADS=1 .venv/bin/python bench/soak.py [--steps 300] [--warmup 50] [--json out.json]

Each step: generate (response lengths vary 3-8 tokens, drawn from a seeded generator and forced with
``min_new_tokens``, so the work per step does not drift as the policy learns to end responses later),
score, ``step``, ``log_stats`` to a null tracker.
Measured: RSS (``/proc/self/statm``, after ``gc.collect()``) and the number of live tensors every 10 steps; per-step CPU time
(``time.process_time``, insensitive to other processes on a shared machine) and wall time. Reported: RSS
growth from the end of warm-up to the end, its least-squares slope (MB per 100 steps), and the median step
time of the first and last 50 post-warm-up steps. ``tests/test_soak.py`` runs this and asserts the bounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_tensors() -> int:
    """Tensors the garbage collector can see: exact, unlike RSS, which moves with the allocator's arenas."""
    import torch

    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op shim warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def run_soak(steps: int = 300, warmup: int = 50, seed: int = 0) -> dict:
    import torch

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=seed))
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-4, seed=seed,
                       adap_kl_ctrl=True, use_score_scaling=True, use_score_norm=True)
    trainer = PPOTrainer(config, model, None, tokenizer)
    prompts = ["This movie was", "I", "The plot", "A good film", "The actors", "Honestly the", "My friend", "It"]
    half = len(tokenizer) // 2
    generator = torch.Generator().manual_seed(seed)
    cpu, wall, rss, tensors = [], [], [], []
    for step in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        batch = [prompts[(step * 4 + i) % len(prompts)] for i in range(4)]
        queries = [torch.tensor(tokenizer.encode(p)) for p in batch]
        n_new = int(torch.randint(3, 9, (1,), generator=generator))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            responses = trainer.generate(queries, return_prompt=False, batch_size=4, max_new_tokens=n_new,
                                         min_new_tokens=n_new, do_sample=True, top_k=0, top_p=1.0)
            scores = [(r < half).float().mean() for r in responses]
            stats = trainer.step(queries, responses, scores)
            trainer.log_stats(stats, {"query": batch, "response": [tokenizer.decode(r) for r in responses]}, scores)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        if step % 10 == 9 or step == warmup - 1:
            gc.collect()
            rss.append((step + 1, rss_mb()))
            tensors.append((step + 1, live_tensors()))
    after = [(s, m) for s, m in rss if s >= warmup]
    tensors_after = [n for s, n in tensors if s >= warmup]
    post = slice(warmup, None)
    cpu_post, wall_post = cpu[post], wall[post]
    window = min(50, len(cpu_post) // 2)
    return {
        "steps": steps, "warmup": warmup,
        "rss_mb_at_warmup": round(after[0][1], 1), "rss_mb_final": round(after[-1][1], 1),
        "rss_growth_mb": round(after[-1][1] - after[0][1], 2),
        "rss_max_minus_warmup_mb": round(max(m for _, m in after) - after[0][1], 2),
        "rss_slope_mb_per_100_steps": round(100 * slope([s for s, _ in after], [m for _, m in after]), 3),
        "live_tensors_at_warmup": tensors_after[0], "live_tensors_final": tensors_after[-1],
        "live_tensor_growth": tensors_after[-1] - tensors_after[0],
        "cpu_s_per_step_first": round(statistics.median(cpu_post[:window]), 4),
        "cpu_s_per_step_last": round(statistics.median(cpu_post[-window:]), 4),
        "cpu_time_ratio_last_over_first": round(statistics.median(cpu_post[-window:]) / statistics.median(cpu_post[:window]), 3),
        "cpu_time_slope_ms_per_100_steps": round(1e5 * slope(list(range(len(cpu_post))), cpu_post), 3),
        "wall_s_per_step_first": round(statistics.median(wall_post[:window]), 4),
        "wall_s_per_step_last": round(statistics.median(wall_post[-window:]), 4),
        "total_wall_s": round(sum(wall), 1), "total_cpu_s": round(sum(cpu), 1),
        "rss_samples": [(s, round(m, 1)) for s, m in rss],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    result = run_soak(args.steps, args.warmup)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
