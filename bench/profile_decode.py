"""What bounds KV-cached decoding of a GPT-2-small-shaped model on this CPU (evidence for bench/analysis.md (b)).

    .venv/bin/python bench/profile_decode.py [--batch 4 64] [--steps 24] [--threads 1]

For each batch size: the median time of one decode step (one new token per row, KV cache of ~16 positions),
split into the 12 transformer blocks (``model.transformer``; of which their 48 projection matmuls alone) and the
LM head, beside two floors measured on this
machine with the same thread count: streaming every weight once from memory (a ``sum`` over a tensor of the
weights' size: the floor while a step is memory-bound, small batches) and the step's matmul FLOPs at the
measured fp32 matmul peak (the floor while it is compute-bound, large batches). Both libraries run these same
model calls, so a step cannot get faster than the larger floor without fewer bytes or FLOPs (another precision).
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: allocator, oneDNN primitive cache
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stream_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes per second of one pass over a fresh fp32 tensor of ``num_bytes`` (a reduction: reads only)."""
    import torch

    x = torch.ones(num_bytes // 4)
    return num_bytes / median_seconds(lambda: x.sum(), repeats)


def matmul_peak(repeats: int) -> float:
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    return 2 * 2048**3 / median_seconds(lambda: a @ b, repeats)


def decode_profile(model, batch: int, steps: int) -> dict:
    """Median seconds of one decode step and of its two parts, with a KV cache of a 16-token prompt."""
    import torch

    torch.manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (batch, 16))
    with torch.no_grad():
        prefill = model(prompt, use_cache=True)
        cache = prefill.past_key_values
        token = prompt[:, -1:]
        positions = torch.full((batch, 1), 16)

        def blocks():
            out = model.transformer(token, past_key_values=cache, position_ids=positions, use_cache=True)
            cache.crop(-1)  # drop the position this call appended
            return out.last_hidden_state

        hidden = blocks()
        head = median_seconds(lambda: model.lm_head(hidden), steps)
        body = median_seconds(blocks, steps)

        def step():
            model(token, past_key_values=cache, position_ids=positions, use_cache=True)
            cache.crop(-1)  # drop the position this call appended

        whole = median_seconds(step, steps)
        matmuls = median_seconds(lambda: block_matmuls(model, hidden), steps)
    return {"step_s": whole, "blocks_s": body, "block_matmuls_s": matmuls, "lm_head_s": head}


def block_matmuls(model, hidden) -> None:
    """Only the four projections of every block (GPT-2's Conv1D: ``addmm(bias, x, W)``), on the right shapes."""
    import torch

    x = hidden.reshape(-1, hidden.shape[-1])
    for block in model.transformer.h:
        qkv = torch.addmm(block.attn.c_attn.bias, x, block.attn.c_attn.weight)
        torch.addmm(block.attn.c_proj.bias, qkv[:, : x.shape[1]], block.attn.c_proj.weight)
        up = torch.addmm(block.mlp.c_fc.bias, x, block.mlp.c_fc.weight)
        torch.addmm(block.mlp.c_proj.bias, up, block.mlp.c_proj.weight)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    import torch

    torch.set_num_threads(ns.threads)
    model, _ = common.build_random(common.SIZES["gpt2s"], seed=0)
    model.eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # tied embedding counted once
    arch = common.SIZES["gpt2s"]
    layers, width, vocab = arch["n_layer"], arch["n_embd"], arch["vocab_size"]
    flops_per_token = 2 * (12 * layers * width**2 + width * vocab)  # no attention term: 17 cached positions
    bandwidth, peak = stream_bandwidth(weights, 8), matmul_peak(8)
    rows = []
    for batch in ns.batch:
        measured = decode_profile(model, batch, ns.steps)
        rows.append({"batch": batch, **measured,
                     "memory_floor_s": weights / bandwidth,
                     "flop_floor_s": batch * flops_per_token / peak,
                     "tokens_per_second": batch / measured["step_s"]})
    print(json.dumps({"threads": ns.threads, "weights_mb": weights / 2**20, "stream_gb_per_s": bandwidth / 1e9,
                      "matmul_peak_gflops": peak / 1e9, "load_1min": os.getloadavg()[0], "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
