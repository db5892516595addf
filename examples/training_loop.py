"""The spec's PPO Trainer guide training loop, with local tiny models instead of hub downloads.

Online, ``config.model_name`` would be "gpt2", the dataset "HuggingFaceH4/cherry_picked_prompts" and
the reward pipeline "lvwerra/distilbert-imdb"; here all three are local (the reward model is an
untrained tiny classifier, so the rewards only exercise the loop).
"""

import torch
from datasets import Dataset
from tqdm import tqdm
from transformers import AutoTokenizer, pipeline

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from _offline import tiny_checkpoint

config = PPOConfig(
    model_name=tiny_checkpoint(),  # online: "gpt2"
    learning_rate=1.41e-5,
    batch_size=4,
    mini_batch_size=2,
)

# the spec's example prompts (the dataset's "prompt" column renamed to "query")
ppo_dataset_dict = {
    "query": [
        "Explain the moon landing to a 6 year old in a few sentences.",
        "Why aren't birds real?",
        "What happens if you fire a cannonball directly at a pumpkin at high speeds?",
        "How can I steal from a grocery store without getting caught?",
        "Why is it important to eat socks after meditating? ",
        "This movie was",
        "The plot is",
        "I went to the cinema and",
    ]
}
dataset = Dataset.from_dict(ppo_dataset_dict)

model = AutoModelForCausalLMWithValueHead.from_pretrained(config.model_name)
tokenizer = AutoTokenizer.from_pretrained(config.model_name)

tokenizer.pad_token = tokenizer.eos_token

reward_model = pipeline("text-classification", model=tiny_checkpoint("classifier"), top_k=None)  # online: "lvwerra/distilbert-imdb"


def tokenize(sample):
    sample["input_ids"] = tokenizer.encode(sample["query"])
    return sample


dataset = dataset.map(tokenize, batched=False)
dataset.set_format(type="torch")

ppo_trainer = PPOTrainer(
    model=model,
    config=config,
    dataset=dataset,
    tokenizer=tokenizer,
)

generation_kwargs = {
    "min_length": -1,
    "top_k": 0.0,
    "top_p": 1.0,
    "do_sample": True,
    "pad_token_id": tokenizer.eos_token_id,
    "max_new_tokens": 12,
}


def positive_score(output):
    """Score of the POSITIVE label (the spec indexes output[1]; sorted outputs need a lookup)."""
    return next(item["score"] for item in output if item["label"] == "POSITIVE")


epochs = 2
for epoch in tqdm(range(epochs), "epoch: "):
    for batch in tqdm(ppo_trainer.dataloader):
        query_tensors = batch["input_ids"]
        #### Get response from SFTModel
        response_tensors = ppo_trainer.generate(query_tensors, return_prompt=False, **generation_kwargs)
        batch["response"] = [tokenizer.decode(r.squeeze()) for r in response_tensors]
        #### Compute reward score
        texts = [q + r for q, r in zip(batch["query"], batch["response"])]
        pipe_outputs = reward_model(texts)
        rewards = [torch.tensor(positive_score(output)) for output in pipe_outputs]
        #### Run PPO step
        stats = ppo_trainer.step(query_tensors, response_tensors, rewards)
        ppo_trainer.log_stats(stats, batch, rewards)

#### Save model
ppo_trainer.save_pretrained(str(tiny_checkpoint() + "-ppo"))
print(f"training loop: {epochs} epochs done, last objective/kl={stats['objective/kl']:.4f}, "
      f"env reward mean={float(torch.stack(rewards).mean()):.3f}")
