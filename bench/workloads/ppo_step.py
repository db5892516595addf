"""Workload (a): time ``PPOTrainer.step`` on identical queries, responses and scores.

    python bench/workloads/ppo_step.py --lib ours|trl --args '{"size": "tiny", "batch_size": 16, ...}'

Prints one JSON line: per-step seconds (after warm-up), tokens, and the padded token count the
FLOP estimate uses.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def main():
    lib, args = common.parse_args()
    import numpy as np
    import torch

    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    size = args.get("size", "tiny")
    ckpt = common.ensure_random_checkpoint(size, seed=0)
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    policy = common.load_policy(lib, ckpt)
    config = PPOConfig(
        batch_size=args["batch_size"], mini_batch_size=args["mini_batch_size"], ppo_epochs=args["ppo_epochs"],
        learning_rate=args.get("learning_rate", 1e-5), seed=0, model_name=f"bench-{size}",
        gradient_accumulation_steps=args.get("gradient_accumulation_steps", 1),
        # "bf16": accelerate's CPU/GPU autocast around both models' forward passes (same kwargs in both libraries)
        accelerator_kwargs={"mixed_precision": args["mixed_precision"]} if args.get("mixed_precision") else {},
        **({"torch_compile": True} if args.get("torch_compile") and lib == "ours" else {}),  # rlhf_core's opt-in
        **common.bf16_weights_kwargs(lib, args),  # rlhf_core: bf16 weights + fp32 masters, fp32, or its default
    )
    trainer = PPOTrainer(config, policy, None, tokenizer)
    vocab = min(len(tokenizer), common.SIZES[size]["vocab_size"])
    queries, responses, scores = common.synthetic_batch(
        args["batch_size"], tuple(args["query_len"]), tuple(args["response_len"]), vocab, seed=1
    )
    times, warmup_times = [], []
    for i in range(args.get("warmup", 1) + args["steps"]):
        t = common.clock()
        stats = trainer.step(queries, responses, scores)
        (times if i >= args.get("warmup", 1) else warmup_times).append(common.clock() - t)
    width = max(len(q) + len(r) for q, r in zip(queries, responses))
    common.emit({
        "lib": common.version_of(lib), "step_seconds": times, "warmup_seconds": warmup_times,  # compile time
        "tokens_per_step": int(sum(len(q) + len(r) for q, r in zip(queries, responses))),
        "response_tokens_per_step": int(sum(len(r) for r in responses)),
        "padded_tokens_per_step": int(len(queries) * width),
        "num_params": int(sum(p.numel() for p in trainer.accelerator.unwrap_model(trainer.model).parameters())),
        # the model FLOPs of a step (bench/gpu/roofline.py; the GPU bench's MFU column)
        "matmul_params": common.matmul_params(trainer.accelerator.unwrap_model(trainer.model)),
        "prompt_tokens_per_step": int(sum(len(q) for q in queries)), "rows": len(queries),
        "size": size, "ppo_epochs": args["ppo_epochs"],
        "last_loss_total": float(np.asarray(stats["ppo/loss/total"]).mean()),
    })


if __name__ == "__main__":
    main()
