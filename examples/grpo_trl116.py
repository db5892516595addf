"""TRL 1.16's GRPO quick-start script, run offline on a tiny model: only the import line differs from TRL.

    .venv/bin/python examples/grpo_trl116.py          # GRPO_EXAMPLE_STEPS=2 for a smoke run

The body is TRL 1.16's documented example (``GRPOConfig`` + ``GRPOTrainer(model=<name or path>,
reward_funcs=<callable>, args=..., train_dataset=<dataset with a "prompt" column>)``, reward: completions close to
20 characters). Offline stand-ins: the model path is a tiny local GPT-2 (``examples/_offline.py``) instead of
``Qwen/Qwen2-0.5B-Instruct`` and the dataset is built in memory instead of ``load_dataset("trl-lib/tldr")``.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from _offline import tiny_checkpoint  # noqa: E402

# from trl import GRPOConfig, GRPOTrainer           # TRL 1.16.0
from rlhf_core import GRPOConfig, GRPOTrainer  # noqa: E402  (the one changed line)

MODEL = tiny_checkpoint()  # TRL's example: "Qwen/Qwen2-0.5B-Instruct"
dataset = Dataset.from_dict({"prompt": ["The film was", "This morning I", "The story is", "The music was",
                                        "My friend said", "The ending", "I think that", "The actors"] * 4})


# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir=os.environ.get("GRPO_EXAMPLE_OUTPUT", "Qwen2-0.5B-GRPO"),
    max_steps=int(os.environ.get("GRPO_EXAMPLE_STEPS", "20")),
    per_device_train_batch_size=16,
    num_generations=8,
    max_completion_length=24,
    learning_rate=1e-3,  # a tiny randomly initialised model; TRL's default (1e-6) suits a pretrained LLM
    logging_steps=1,
    report_to="none",
    save_strategy="no",
)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()

rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
print(f"grpo_trl116: {trainer.state.global_step} steps, reward first {rewards[0]:.2f} last {rewards[-1]:.2f}")
