"""Workload (d): a short PPO run on real text towards positive sentiment under the gold judge (VADER).

    python bench/workloads/sentiment.py --lib ours|trl --args '{"steps": 30, "seed": 0, ...}'

The policy is the small GPT-2-shaped LM fine-tuned on the rt-polarity snippets by bench/prepare.py.
Each step: sample prompts (the first few tokens of snippets), generate with the library's
``generate``, score query+response with VADER's compound score, ``step``. Before and after, the
gold reward is measured on fixed held-out prompts with a fixed sampling seed. Same seeds and steps
in both libraries.
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402


def main():
    lib, args = common.parse_args()
    import numpy as np
    import torch
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    PPOConfig, PPOTrainer, _, _ = common.library(lib)
    judge = SentimentIntensityAnalyzer()
    tokenizer = common.load_tokenizer(common.tokenizer_json_path("rt"))
    policy = common.load_policy(lib, common.checkpoint_dir("rt-sft"))
    seed = args.get("seed", 0)
    bs = args["batch_size"]
    config = PPOConfig(batch_size=bs, mini_batch_size=args["mini_batch_size"], ppo_epochs=args["ppo_epochs"],
                       learning_rate=args["learning_rate"], init_kl_coef=args["init_kl_coef"],
                       adap_kl_ctrl=args.get("adap_kl_ctrl", True), target=args.get("target", 6), seed=seed,
                       model_name="rt-sft", **common.bf16_weights_kwargs(lib, args))  # fp32 on a GPU too
    trainer = PPOTrainer(config, policy, None, tokenizer)
    lines = common.rt_polarity_lines()
    rng = random.Random(1234)
    rng.shuffle(lines)
    held_out, train = lines[:args["eval_prompts"]], lines[args["eval_prompts"]:]

    def prompt_ids(text, n):
        ids = tokenizer(text)["input_ids"][:n]
        return torch.tensor(ids if ids else [tokenizer.eos_token_id])

    gen = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True,
           "pad_token_id": tokenizer.eos_token_id, "max_new_tokens": args["max_new_tokens"]}
    eval_queries = [prompt_ids(t, args["prompt_tokens"]) for t in held_out]

    def gold(queries, responses):
        texts = [tokenizer.decode(torch.cat([q, r]), skip_special_tokens=True) for q, r in zip(queries, responses)]
        return [judge.polarity_scores(t)["compound"] for t in texts]

    def evaluate():
        state = torch.random.get_rng_state()
        torch.manual_seed(10_000)
        rewards = []
        for _ in range(args.get("eval_samples", 2)):
            responses = trainer.generate(eval_queries, return_prompt=False, batch_size=args["gen_batch_size"], **gen)
            rewards += gold(eval_queries, responses)
        torch.random.set_rng_state(state)
        return float(np.mean(rewards))

    before = evaluate()
    step_rng = random.Random(seed)
    torch.manual_seed(seed)
    kls, train_rewards = [], []
    for _ in range(args["steps"]):
        texts = step_rng.sample(train, bs)
        queries = [prompt_ids(t, args["prompt_tokens"]) for t in texts]
        responses = trainer.generate(queries, return_prompt=False, batch_size=args["gen_batch_size"], **gen)
        responses = [r if len(r) else torch.tensor([tokenizer.eos_token_id]) for r in responses]
        rewards = gold(queries, responses)
        stats = trainer.step(queries, responses, [torch.tensor(r) for r in rewards])
        kls.append(float(stats["objective/kl"]))
        train_rewards.append(float(np.mean(rewards)))
    after = evaluate()
    common.emit({"lib": common.version_of(lib), "seed": seed, "gold_before": before, "gold_after": after,
                 "gold_gain": after - before, "kl_per_step": kls, "train_reward_per_step": train_rewards,
                 "mean_kl": float(np.mean(kls)), "final_kl": kls[-1]})


if __name__ == "__main__":
    main()
