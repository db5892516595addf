"""Direct Preference Optimisation of a tiny offline GPT-2 on prompt/chosen/rejected rows (runs in seconds).

    .venv/bin/python examples/dpo_example.py
"""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from datasets import Dataset  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from rlhf_core import DPOTrainer  # noqa: E402
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm  # noqa: E402

ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was"],
    "chosen": [" great and warm", " loved the film", " lovely", " wonderful"],
    "rejected": [" terrible", " hated it", " boring and dull", " awful"],
}


def main() -> None:
    """Train a few DPO steps (the reference is a frozen copy of the policy), print metrics, sample."""
    tokenizer = build_tokenizer()
    model = tiny_causal_lm(tokenizer)
    dataset = Dataset.from_dict(ROWS)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir, max_steps=10, per_device_train_batch_size=4, learning_rate=5e-3,
            logging_steps=5, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        )
        trainer = DPOTrainer(
            model=model, ref_model=None, beta=0.1, args=args, train_dataset=dataset, tokenizer=tokenizer,
            max_length=32, max_prompt_length=8, loss_type="sigmoid",
        )
        trainer.train()
        trainer.save_model(os.path.join(output_dir, "dpo"))
    last = [e for e in trainer.state.log_history if "loss" in e][-1]
    print({k: round(last[k], 3) for k in ("loss", "rewards/accuracies", "rewards/margins")})
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    policy, reference = trainer.get_batch_samples(trainer.model, batch)
    print("policy:", policy, "\nreference:", reference)


if __name__ == "__main__":
    main()
