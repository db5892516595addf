"""Workload (c): peak resident memory of a short PPO run with a reference model.

    python bench/workloads/memory.py --lib ours|trl --args '{"size": "gpt2s", "reference": "full|shared|lora", ...}'

``full``: the trainer builds a frozen full copy; ``shared``: ``num_shared_layers`` first layers (and
the embeddings) are shared with the policy; ``lora``: a LoRA policy whose reference is the same model
with the adapter disabled. Runs in a fresh process; reports ru_maxrss and the RSS after imports.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def main():
    lib, args = common.parse_args()
    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    import torch  # noqa: F401

    baseline = common.current_rss_mb()  # after importing torch, transformers and the library
    size = args.get("size", "tiny")
    ckpt = common.ensure_random_checkpoint(size, seed=0)
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    reference = args["reference"]
    peft_config = common.lora_config() if reference == "lora" else None
    policy = common.load_policy(lib, ckpt, peft_config=peft_config)
    config = PPOConfig(batch_size=args["batch_size"], mini_batch_size=args["mini_batch_size"],
                       ppo_epochs=args["ppo_epochs"], learning_rate=1e-5, seed=0, model_name=f"bench-{size}",
                       **common.bf16_weights_kwargs(lib, args))  # fp32 weights on a GPU too, as the peer's
    extra = {"num_shared_layers": args["num_shared_layers"]} if reference == "shared" else {}
    trainer = PPOTrainer(config, policy, None, tokenizer, **extra)
    after_setup = common.current_rss_mb()
    vocab = min(len(tokenizer), common.SIZES[size]["vocab_size"])
    queries, responses, scores = common.synthetic_batch(
        args["batch_size"], tuple(args["query_len"]), tuple(args["response_len"]), vocab, seed=1)
    for _ in range(args["steps"]):
        trainer.step(queries, responses, scores)
    common.emit({"lib": common.version_of(lib), "reference": reference, "rss_after_imports_mb": baseline,
                 "rss_after_setup_mb": after_setup})


if __name__ == "__main__":
    main()
