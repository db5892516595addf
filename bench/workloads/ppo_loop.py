"""Workload (f): whole PPO iterations of rlhf_core (generate, reward, step), timed by phase, on a GPT-2 or Qwen2 policy.

    python bench/workloads/ppo_loop.py --lib ours --args '{"arch": "qwen2-0.5b", "batch_size": 64, ...}'

The policy, tokenizer, prompts and gold judge are workload (e)'s (``online.py``: ``"arch"`` picks the shape, e.g.
Qwen2-0.5B's published one with random weights; prompts are the first words of rt-polarity snippets; the reward is
the VADER score of prompt + response). Each iteration samples ``max_new_tokens`` per prompt with
``PPOTrainer.generate`` (temperature 1, top-k 0, top-p 1, no EOS stop beyond the model's own), scores the texts and
runs ``PPOTrainer.step``. Phases, from synchronised timers (``common.PhaseClock``): generation (``generate``),
reward (decoding + judge), policy forward (the rollout's old log-probs and values, ``_policy_rollout``), reference
forward (the rest of ``_rollout_forward``), policy update (the PPO epochs, ``_optimise``); the rest of the step is
bookkeeping. Prints one JSON line: per iteration, its seconds, phase seconds and prompt / response tokens.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

DEFAULTS = {"arch": "qwen2-0.5b", "batch_size": 64, "mini_batch_size": 16, "ppo_epochs": 1, "max_new_tokens": 128,
            "prompt_words": 4, "steps": 3, "warmup": 1, "learning_rate": 1e-6, "mixed_precision": None,
            "bf16_weights": False, "threads": 1}
PHASES = {"generate": "generation", "_policy_rollout": "policy forward", "_rollout_forward": "rollout forwards",
          "_optimise": "policy update"}


def load_online_workload():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "online.py")
    spec = importlib.util.spec_from_file_location("online_workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    lib, args = common.parse_args(("ours",))
    args = {**DEFAULTS, **args}
    import torch

    online = load_online_workload()
    PPOConfig, PPOTrainer, ValueHeadModel, _ = common.library(lib)
    tokenizer = common.load_tokenizer(online.tokenizer_path(), padding_side="left")
    policy = ValueHeadModel.from_pretrained(str(online.model_dir(args["arch"])), summary_dropout_prob=0.0)
    config = PPOConfig(batch_size=args["batch_size"], mini_batch_size=args["mini_batch_size"],
                       ppo_epochs=args["ppo_epochs"], learning_rate=args["learning_rate"], seed=0,
                       model_name=f"bench-{args['arch']}",
                       accelerator_kwargs={"mixed_precision": args["mixed_precision"]} if args["mixed_precision"] else {},
                       **common.bf16_weights_kwargs(lib, args))
    trainer = PPOTrainer(config, policy, None, tokenizer)
    clock = common.PhaseClock()
    for name, phase in PHASES.items():
        clock.wrap(trainer, name, phase)
    judge = online.GoldJudge()
    texts = online.prompts(args["prompt_words"])
    device = trainer.accelerator.device
    sampling = {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": args["max_new_tokens"]}
    iterations = []
    for i in range(args["warmup"] + args["steps"]):
        batch = texts[i * args["batch_size"]:(i + 1) * args["batch_size"]]
        queries = [torch.tensor(ids, device=device) for ids in tokenizer(batch)["input_ids"]]
        start = common.clock()
        responses = trainer.generate(queries, return_prompt=False, batch_size=args["batch_size"], **sampling)
        t = common.clock()
        scores = [torch.tensor(s, device=device) for s in
                  judge(batch, tokenizer.batch_decode(responses, skip_special_tokens=True))]
        clock.current["reward"] = common.clock() - t
        trainer.step(queries, responses, scores)
        seconds = common.clock() - start
        clock.end_step()
        phases = clock.steps[-1]
        phases["reference forward"] = phases.pop("rollout forwards") - phases["policy forward"]
        iterations.append({"seconds": seconds, "phases": phases, "prompt_tokens": sum(len(q) for q in queries),
                           "response_tokens": sum(len(r) for r in responses)})
    from rlhf_core.trainers.decode import DECODE_STATS

    common.emit({"lib": common.version_of(lib), "arch": args["arch"], "iterations": iterations[args["warmup"]:],
                 "warmup_iterations": iterations[:args["warmup"]], "decode_stats": DECODE_STATS,
                 "matmul_params": common.matmul_params(trainer.accelerator.unwrap_model(trainer.model)),
                 "gold_per_iteration": [sum(c) / len(c) for c in judge.calls]})


if __name__ == "__main__":
    main()
