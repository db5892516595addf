"""Train a tiny policy with PPO on a programmatic reward and watch the mean score rise.

The reward is the share of response tokens that begin a new word (byte-level BPE marks them with a
leading space), which a random tiny model produces for roughly a third of its tokens. Runs offline
in about a minute on two CPU cores.
"""

import os

import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer, set_seed
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

STEPS = int(os.environ.get("PPO_EXAMPLE_STEPS", "30"))
set_seed(0)
tokenizer = build_tokenizer()
word_start = torch.tensor([tok.startswith("\u0120") for tok in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))])

model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, hidden_size=64))
config = PPOConfig(batch_size=16, mini_batch_size=8, learning_rate=3e-3, init_kl_coef=0.01, adap_kl_ctrl=False, seed=0)
trainer = PPOTrainer(config, model, None, tokenizer)

prompts = ["This movie was", "I think", "The plot", "A good film", "The acting", "What a", "It was", "My friend"] * 2
queries = [torch.tensor(tokenizer.encode(p)) for p in prompts]
generation_kwargs = {"do_sample": True, "top_k": 0, "top_p": 1.0, "max_new_tokens": 10, "min_new_tokens": 10}


def reward(response: torch.Tensor) -> torch.Tensor:
    """Share of the response's tokens that start a word."""
    return word_start[response].float().mean()


for step in range(STEPS):
    responses = trainer.generate(queries, batch_size=16, return_prompt=False, **generation_kwargs)
    scores = [reward(r) for r in responses]
    stats = trainer.step(queries, responses, scores)
    if step % 5 == 0 or step == STEPS - 1:
        print(f"step {step:3d}  mean score {stats['ppo/mean_scores']:.3f}  KL {stats['objective/kl']:.3f}")
print("sample:", tokenizer.decode(torch.cat([queries[0], responses[0]])))
