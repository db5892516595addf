"""How fast GRPO, RLOO and PPO raise held-out pass@1 on the arithmetic folder: the sweep behind docs/tasks.md's
"Does it learn?" settings, run outside the pipeline so a setting costs one training run, not a pipeline run.

    python bench/arithmetic_learning.py grpo --lr 1.5e-4 --steps 600 --generations 4 --beta 0
    python bench/arithmetic_learning.py ppo --lr 1e-4 --steps 600 --beta 0.02 --ppo-epochs 1 --mini-batch 64
    python bench/arithmetic_learning.py sft --lr 0 --steps 0        # the SFT policy itself, scored the same way

``--beta`` is PPO's init_kl_coef. It starts from the folder's SFT policy (``pipelines/arithmetic/models/sft``: run
``make run TASK=arithmetic`` first; ``--folder`` names a copy of the folder trained with other SFT settings),
trains on its ``data/prompts_train.jsonl`` with the verifier as the reward (the stages' code: ``accuracy_reward``,
``verifier_scores``), then scores the trained policy as ``evaluate`` does (``score_policy_samples``: the first 64
held-out problems, 8 seeded samples each) and prints one JSON line: the settings, training seconds, pass@1, pass@8,
maj@k, format errors and KL to SFT. Nothing is written to the folder (the trainer's scratch goes to a temporary dir).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FOLDER = ROOT / "pipelines" / "arithmetic"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=("grpo", "rloo", "ppo", "sft"), help="sft: score the SFT policy itself")
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps (grpo/rloo), PPO steps (ppo)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL weight (grpo/rloo beta; ppo init_kl_coef)")
    parser.add_argument("--batch", type=int, default=64, help="completions (grpo/rloo) or rollouts (ppo) per step")
    parser.add_argument("--generations", type=int, default=8, help="grpo/rloo group size")
    parser.add_argument("--iterations", type=int, default=1, help="grpo/rloo updates per generated batch")
    parser.add_argument("--scheduler", default="linear", help="grpo/rloo: lr_scheduler_type (linear decays to 0)")
    parser.add_argument("--ppo-epochs", type=int, default=4, help="ppo: optimisation passes over each batch")
    parser.add_argument("--mini-batch", type=int, default=16, help="ppo: rollouts per gradient step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--eval-problems", type=int, default=64)
    parser.add_argument("--folder", type=Path, default=FOLDER,
                        help="the task folder whose models/sft and data/ to use (a copy with other SFT settings)")
    return parser.parse_args(argv)


def train_group(args, tokenizer, model, rows, scratch: str):
    """GRPO or RLOO (TRL 1.16 API) on the verifier; returns the trained policy."""
    from datasets import Dataset

    from rlhf_core import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_core.rewards import accuracy_reward

    config_class, trainer_class = (GRPOConfig, GRPOTrainer) if args.method == "grpo" else (RLOOConfig, RLOOTrainer)
    config = config_class(output_dir=scratch, learning_rate=args.lr, per_device_train_batch_size=args.batch,
                          num_generations=args.generations, max_completion_length=32, max_steps=args.steps,
                          beta=args.beta, num_iterations=args.iterations, temperature=1.0, seed=0,
                          lr_scheduler_type=args.scheduler,
                          logging_steps=50, report_to=[], save_strategy="no")
    data = Dataset.from_dict({"prompt": [r["query"] for r in rows], "solution": [r["solution"] for r in rows]})
    trainer_class(model, reward_funcs=accuracy_reward, args=config, train_dataset=data,
                  processing_class=tokenizer).train()
    return model


def train_ppo(args, tokenizer, rows):
    """Classic PPO (the ppo stage's loop and generation settings) on the verifier; returns the trained policy."""
    from datasets import Dataset

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.trainers.ppo.loop import run_ppo
    from tasks.stages.common.problems import verifier_scores
    from tasks.stages.ppo import generation_kwargs

    prompts = [r["query"] for r in rows]
    config = PPOConfig(model_name=str(args.folder / "models/sft"), learning_rate=args.lr, batch_size=args.batch,
                       mini_batch_size=args.mini_batch, ppo_epochs=args.ppo_epochs, init_kl_coef=args.beta, adap_kl_ctrl=True, target=6.0,
                       horizon=10000.0, vf_coef=0.1, seed=0, steps=args.steps * args.batch)
    data = Dataset.from_dict({"query": prompts, "input_ids": [tokenizer(q).input_ids for q in prompts]})
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(args.folder / "models/sft"))
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer, dataset=data)
    run_ppo(trainer, verifier_scores(prompts, [r["solution"] for r in rows]), total_steps=args.steps,
            generation_kwargs=generation_kwargs(tokenizer, 32))
    return trainer.accelerator.unwrap_model(trainer.model).pretrained_model


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    import torch

    torch.set_num_threads(args.threads)
    from rlhf_core import set_seed
    from rlhf_core.data import read_jsonl
    from tasks.stages.common.policy import load_sft_policy
    from tasks.stages.common.verified_eval import score_policy_samples

    folder = args.folder
    if not (folder / "models/sft").is_dir():
        raise SystemExit(f"{folder / 'models/sft'}: no SFT policy; run `make run TASK=arithmetic` first")
    rows = read_jsonl(folder / "data/prompts_train.jsonl")
    held_out = read_jsonl(folder / "data/prompts_eval.jsonl")[: args.eval_problems]
    set_seed(0)
    tokenizer, model = load_sft_policy(folder / "models/sft")
    _, reference = load_sft_policy(folder / "models/sft")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if args.method == "sft":
            policy = model
        elif args.method == "ppo":
            policy = train_ppo(args, tokenizer, rows)
        else:
            policy = train_group(args, tokenizer, model, rows, scratch)
    seconds = time.perf_counter() - start
    evaluate = types.SimpleNamespace(max_new_tokens=32, batch_size=64, seed=0)  # evaluate's settings in params.yaml
    metrics, _ = score_policy_samples(policy.eval(), reference, tokenizer, held_out,
                                      [r["solution"] for r in held_out], 8, [1, 8], evaluate)
    settings = {k: str(v) if k == "folder" else v for k, v in vars(args).items() if k != "threads"}
    result = {**settings, "train_s": round(seconds, 1), **metrics}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
