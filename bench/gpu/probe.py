"""What the GPU bench runs on: the device, the software, and the best bf16 / fp32 matmul and copy it reaches.

    python bench/gpu/probe.py [--smoke]

Prints one JSON line. The measured numbers sit beside the datasheet's (``peaks.py``) in the report: the datasheet
peak is the MFU denominator, the measured one says how much of it a plain large matmul reaches on this card.
"""

import json
import platform
import sys
import time


def best_seconds(fn, repeats: int, sync) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    import torch
    import transformers

    smoke = "--smoke" in sys.argv
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "transformers": transformers.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(capability=f"{props.major}.{props.minor}", memory_gb=props.total_memory / 1e9,
                   bf16_supported=torch.cuda.is_bf16_supported(), tf32=torch.backends.cuda.matmul.allow_tf32)
    n = 512 if smoke or not cuda else 8192
    for dtype in ("bfloat16", "float32"):
        a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
        out[f"matmul_tflops_{dtype}"] = 2 * n**3 / best_seconds(lambda: a @ b, 3 if smoke else 10, sync) / 1e12
    x = torch.empty(2**20 if smoke or not cuda else 2**28, device=device, dtype=torch.float32)  # 1 GiB on a GPU
    seconds = best_seconds(lambda: x.clone(), 3 if smoke else 10, sync)
    out["copy_tb_s"] = 2 * x.numel() * 4 / seconds / 1e12  # read + write
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
