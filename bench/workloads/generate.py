"""Workload (b): ``PPOTrainer.generate`` on the same prompts with the same sampling settings.

    python bench/workloads/generate.py --lib ours|trl|hf --args '{"size": "tiny", "batch_size": null, ...}'

``batch_size: null`` means the library's own default (the argument is not passed). ``"mixed_precision": "bf16"``
gives both libraries' ``PPOConfig`` accelerate's bf16 setting (rlhf_core then samples in bf16 on CUDA; classic
TRL's ``generate`` ignores it). ``--lib hf`` is transformers' own ``generate`` on the same model and prompts, in one
batch, in ``"hf_dtype"`` (default bf16): the reference the GPU target is stated against. Prints one JSON line with
the seconds of each timed pass, the number of generated tokens, and (ours) how many token steps were replayed
CUDA graphs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

SAMPLING = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True}


def trainer_generate(lib: str, args: dict, tokenizer, queries):
    """``generate(queries)`` of a PPOTrainer of ``lib`` around the random checkpoint."""
    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    size = args.get("size", "tiny")
    policy = common.load_policy(lib, common.ensure_random_checkpoint(size, seed=0))
    n = args["num_prompts"]
    config = PPOConfig(batch_size=n, mini_batch_size=n, seed=0, model_name=f"bench-{size}",
                       accelerator_kwargs={"mixed_precision": args["mixed_precision"]}
                       if args.get("mixed_precision") else {},
                       **common.bf16_weights_kwargs(lib, args),  # fp32 unless the row says "default" or true
                       **({"prepacked_generation": True} if args.get("prepacked_generation") and lib == "ours" else {}))
    trainer = PPOTrainer(config, policy, None, tokenizer)
    kwargs = {**SAMPLING, "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": args["max_new_tokens"]}
    call = {} if args.get("batch_size") is None else {"batch_size": args["batch_size"]}
    return lambda: trainer.generate(queries, return_prompt=False, **call, **kwargs)


def hf_generate(args: dict, tokenizer, queries):
    """transformers' ``generate`` on the same model and prompts, one left-padded batch, in ``hf_dtype``."""
    import torch

    model, _ = common.load_transformer(common.ensure_random_checkpoint(args.get("size", "tiny"), seed=0))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = model.to(device=device, dtype=getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[
        args.get("hf_dtype", "bf16")]))
    ids, mask = common.left_padded(queries, tokenizer.pad_token_id)
    width = ids.shape[1]
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    kwargs = {**SAMPLING, "top_k": 0, "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": args["max_new_tokens"],
              "suppress_tokens": [tokenizer.pad_token_id]}  # as rlhf_core's generate: never sample the pad token

    def run():
        with torch.no_grad():
            out = model.generate(**batch, **kwargs)[:, width:]
        return common.cut_after_eos(out, tokenizer.eos_token_id)

    return run


def main():
    lib, args = common.parse_args(("ours", "trl", "hf"))
    import torch

    size = args.get("size", "tiny")
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("default"))
    vocab = min(len(tokenizer), common.SIZES[size]["vocab_size"])
    queries, _, _ = common.synthetic_batch(args["num_prompts"], tuple(args["query_len"]), (1, 1), vocab, seed=2)
    generate = hf_generate(args, tokenizer, queries) if lib == "hf" else trainer_generate(lib, args, tokenizer, queries)
    times, tokens = [], []
    for i in range(args.get("warmup", 1) + args["repeats"]):
        torch.manual_seed(100 + i)
        t = common.clock()
        responses = generate()
        elapsed = common.clock() - t
        if i >= args.get("warmup", 1):
            times.append(elapsed)
            tokens.append(int(sum(len(r) for r in responses)))
    result = {"lib": common.version_of(lib), "seconds": times, "generated_tokens": tokens,
              "batch_size": args.get("batch_size"), "prompt_tokens": int(sum(len(q) for q in queries)),
              "prompt_width": max(len(q) for q in queries)}
    if lib == "ours":
        from rlhf_core.trainers.decode import DECODE_STATS

        result["decode_stats"] = DECODE_STATS
    common.emit(result)


if __name__ == "__main__":
    main()
