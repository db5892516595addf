"""The spec's README basic example, with a local tiny model instead of "gpt2".

It builds ``PPOConfig(batch_size=1)``: the newest default ``mini_batch_size`` is 128, so a config
that leaves it at its default is fitted to the batch (one mini-batch of 1), with a warning.
"""

# imports
import torch
from transformers import AutoTokenizer

from rlhf_core import PPOTrainer, PPOConfig, AutoModelForCausalLMWithValueHead, create_reference_model
from rlhf_core.core import respond_to_batch
from _offline import tiny_checkpoint

MODEL = tiny_checkpoint()  # online: "gpt2"

# get models
model = AutoModelForCausalLMWithValueHead.from_pretrained(MODEL)
model_ref = create_reference_model(model)

tokenizer = AutoTokenizer.from_pretrained(MODEL)

# initialize trainer
ppo_config = PPOConfig(
    batch_size=1,
)

# encode a query
query_txt = "This morning I went to the "
query_tensor = tokenizer.encode(query_txt, return_tensors="pt")

# get model response
response_tensor = respond_to_batch(model, query_tensor)

# create a ppo trainer
ppo_trainer = PPOTrainer(ppo_config, model, model_ref, tokenizer)

# define a reward for response
# (this could be any reward such as human feedback or output from another model)
reward = [torch.tensor(1.0)]

# train model for one step with ppo
train_stats = ppo_trainer.step([query_tensor[0]], [response_tensor[0]], reward)
print(f"README example: mini_batch_size={ppo_config.mini_batch_size}, objective/kl={train_stats['objective/kl']:.4f}, "
      f"ppo/mean_scores={train_stats['ppo/mean_scores']:.1f}")
