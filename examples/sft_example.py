"""Supervised fine-tuning of a tiny offline GPT-2 on a few sentences, with packing (runs in seconds).

    .venv/bin/python examples/sft_example.py
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from rlhf_core import SFTTrainer  # noqa: E402
from rlhf_core.models.tiny import DEFAULT_CORPUS, build_tokenizer, tiny_causal_lm  # noqa: E402


def main() -> None:
    """Train a few packed steps, save, and print the loss curve."""
    tokenizer = build_tokenizer()
    model = tiny_causal_lm(tokenizer)
    dataset = Dataset.from_dict({"text": list(DEFAULT_CORPUS[:8])})
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=10, per_device_train_batch_size=4, learning_rate=5e-3,
            logging_steps=2, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=dataset, tokenizer=tokenizer,
            dataset_text_field="text", max_seq_length=32, packing=True, infinite=True,
        )
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "sft"))
        print("saved:", sorted(os.listdir(os.path.join(output_dir, "sft"))))
    print("loss:", [round(e["loss"], 3) for e in trainer.state.log_history if "loss" in e])


if __name__ == "__main__":
    main()
