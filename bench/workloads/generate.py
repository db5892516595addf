"""Workload (b): ``PPOTrainer.generate`` on the same prompts with the same sampling settings.

    python bench/workloads/generate.py --lib ours|trl --args '{"size": "tiny", "batch_size": null, ...}'

``batch_size: null`` means the library's own default (the argument is not passed). Prints one JSON
line with the seconds of each timed pass and the number of generated tokens.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def main():
    lib, args = common.parse_args()
    import torch

    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    size = args.get("size", "tiny")
    ckpt = common.ensure_random_checkpoint(size, seed=0)
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    policy = common.load_policy(lib, ckpt)
    n = args["num_prompts"]
    config = PPOConfig(batch_size=n, mini_batch_size=n, seed=0, model_name=f"bench-{size}",
                       **({"prepacked_generation": True} if args.get("prepacked_generation") and lib == "ours" else {}))
    trainer = PPOTrainer(config, policy, None, tokenizer)
    vocab = min(len(tokenizer), common.SIZES[size]["vocab_size"])
    queries, _, _ = common.synthetic_batch(n, tuple(args["query_len"]), (1, 1), vocab, seed=2)
    gen_kwargs = {
        "min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
        "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": args["max_new_tokens"],
    }
    call = {} if args.get("batch_size") is None else {"batch_size": args["batch_size"]}
    times, tokens = [], []
    for i in range(args.get("warmup", 1) + args["repeats"]):
        torch.manual_seed(100 + i)
        t = time.perf_counter()
        responses = trainer.generate(queries, return_prompt=False, **call, **gen_kwargs)
        elapsed = time.perf_counter() - t
        if i >= args.get("warmup", 1):
            times.append(elapsed)
            tokens.append(int(sum(len(r) for r in responses)))
    common.emit({"lib": common.version_of(lib), "seconds": times, "generated_tokens": tokens,
                 "batch_size": args.get("batch_size")})


if __name__ == "__main__":
    main()
