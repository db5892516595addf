"""Build the GPU bench's cached inputs (run in the rlhf_core environment before the rows that need them).

    python bench/gpu/prepare_inputs.py --sizes tiny,gpt2s --archs 4x128,gpt2s qwen2-0.5b

The bench tokenizers (default BPE; rt-polarity BPE), the neutral GPT-2 checkpoints of ``common.SIZES`` and the
online workload's ``save_pretrained`` policies (``online.ARCHS``), each written once, atomically, under BENCH_CACHE.
"""

import argparse
import importlib.util
import os
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)
import common  # noqa: E402
import prepare  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="")
    parser.add_argument("--archs", default="")
    opts = parser.parse_args()
    start = time.perf_counter()
    spec = importlib.util.spec_from_file_location("online_workload", os.path.join(BENCH, "workloads", "online.py"))
    online = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(online)
    prepare.ensure_default_tokenizer()
    online.tokenizer_path()
    for size in filter(None, opts.sizes.split(",")):
        common.ensure_random_checkpoint(size, seed=0)
    for arch in filter(None, opts.archs.split(",")):
        online.model_dir(arch)
    print(f"prepared sizes [{opts.sizes}] archs [{opts.archs}] in {time.perf_counter() - start:.1f} s "
          f"under {common.CACHE_DIR}", flush=True)


if __name__ == "__main__":
    main()
