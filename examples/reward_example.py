"""Pairwise reward-model training on a few text pairs with a tiny offline reward model (runs in seconds).

    .venv/bin/python examples/reward_example.py
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from rlhf_core import RewardTrainer  # noqa: E402
from rlhf_core.models.tiny import build_tokenizer, tiny_reward_model  # noqa: E402

PAIRS = {
    "prompt": ["Review: "] * 4,
    "chosen": ["a lovely film", "great acting", "a good story, warm", "wonderful music"],
    "rejected": ["a boring film", "awful acting and bad", "terrible", "dull music and slow"],
}


def main() -> None:
    """Train, evaluate accuracy, save, and score two new texts."""
    tokenizer = build_tokenizer()
    model = tiny_reward_model(tokenizer)
    dataset = Dataset.from_dict(PAIRS)  # text columns are tokenised into input_ids_chosen/... for you
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=20, per_device_train_batch_size=4, learning_rate=5e-3,
            logging_steps=5, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        trainer = RewardTrainer(
            model=model, args=args, tokenizer=tokenizer, train_dataset=dataset, eval_dataset=dataset, max_length=64,
        )
        trainer.train()
        print("eval:", {k: round(v, 3) for k, v in trainer.evaluate().items() if k in ("eval_loss", "eval_accuracy")})
        trainer.save_model(os.path.join(output_dir, "reward"))
    batch = tokenizer(["Review: a lovely story", "Review: a boring story"], return_tensors="pt", padding=True)
    with torch.no_grad():
        print("rewards:", model(**batch).logits[:, 0].tolist())


if __name__ == "__main__":
    main()
