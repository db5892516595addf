"""RewardTrainer: columns, text tokenisation, padding-side invariance, loss, metrics, save and tracking."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from rlhf_core.models.reward_model import sequence_rewards
from rlhf_core.models.tiny import build_tokenizer, tiny_reward_model
from rlhf_core.trainers.collators import RewardDataCollatorWithPadding
from rlhf_core.trainers.preference.reward import (
    RewardConfig,
    RewardTrainer,
    compute_accuracy,
    tokenize_pair,
)

PAIRS = {
    "prompt": ["Review: ", "Review: ", "Review: ", "Review: "],
    "chosen": ["a lovely film", "great acting", "a good story, warm", "wonderful music"],
    "rejected": ["a boring film", "awful acting and bad", "terrible", "dull music and slow"],
}


def small_args(tmp_path, **overrides) -> RewardConfig:
    """Tiny CPU arguments that report nowhere and save nothing."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=1e-2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return RewardConfig(**kwargs)


def make_trainer(tokenizer, tmp_path, **kwargs) -> RewardTrainer:
    """A reward trainer on the text pairs above."""
    dataset = Dataset.from_dict(PAIRS)
    kwargs.setdefault("args", small_args(tmp_path))
    return RewardTrainer(model=tiny_reward_model(tokenizer), train_dataset=dataset, eval_dataset=dataset,
                         tokenizer=tokenizer, **kwargs)


def test_tokenize_pair_row_by_row(tokenizer):
    row = {"prompt": "Review: ", "chosen": "a lovely film", "rejected": "dull"}
    out = tokenize_pair(row, tokenizer)
    eos = tokenizer.eos_token_id
    assert out["input_ids_chosen"] == tokenizer("Review: a lovely film")["input_ids"] + [eos]
    assert out["input_ids_rejected"] == tokenizer("Review: dull")["input_ids"] + [eos]
    assert out["attention_mask_chosen"] == [1] * len(out["input_ids_chosen"])
    no_prompt = tokenize_pair({"chosen": "dull", "rejected": "bad"}, tokenizer)
    assert no_prompt["input_ids_chosen"] == tokenizer("dull")["input_ids"] + [eos]


def test_missing_columns_warn_at_construction_and_raise_at_train_naming_them(tokenizer, tmp_path):
    """As TRL 0.11: tokenised data without the reward columns builds (a custom collator may read it), with a
    warning; the default collator refuses its first batch, naming the missing columns."""
    bad = Dataset.from_dict({"input_ids_chosen": [[1, 2]] * 2, "attention_mask_chosen": [[1, 1]] * 2})
    with pytest.warns(UserWarning, match=r"lacks the columns \['input_ids_rejected', 'attention_mask_rejected'\]"):
        trainer = RewardTrainer(model=tiny_reward_model(tokenizer), args=small_args(tmp_path, max_steps=1),
                                train_dataset=bad, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"missing the columns \['input_ids_rejected', 'attention_mask_rejected'\]"):
        trainer.train()


def test_two_output_model_trains_every_output_as_a_reward(tokenizer, tmp_path):
    """TRL 0.11 semantics for num_labels=2: loss = mean over pairs and outputs of -log sigmoid(r_c - r_r)."""
    model = tiny_reward_model(tokenizer, num_labels=2)
    with pytest.warns(UserWarning, match="num_labels=2"):
        trainer = RewardTrainer(model=model, args=small_args(tmp_path), train_dataset=Dataset.from_dict(PAIRS),
                                tokenizer=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, outputs = trainer.compute_loss(model, batch, return_outputs=True)
    chosen, rejected = outputs["rewards_chosen"].double(), outputs["rewards_rejected"].double()
    assert chosen.shape == rejected.shape == (4, 2)
    expected = sum(-math.log(1 / (1 + math.exp(-(chosen[i, k] - rejected[i, k]).item())))
                   for i in range(4) for k in range(2)) / 8
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    assert (model.score.weight.grad.abs().sum(dim=1) > 0).all()  # both output rows learn
    _, logits, _ = trainer.prediction_step(model, batch, prediction_loss_only=False)
    assert logits.shape == (4, 2)
    assert torch.allclose(logits[:, 0], outputs["rewards_chosen"].mean(dim=1))


def test_collator_pads_pairs_to_common_length_with_margin(tokenizer):
    collator = RewardDataCollatorWithPadding(tokenizer)
    features = [
        {"input_ids_chosen": [5, 6, 7], "attention_mask_chosen": [1, 1, 1], "input_ids_rejected": [8],
         "attention_mask_rejected": [1], "margin": 0.5},
        {"input_ids_chosen": [9], "attention_mask_chosen": [1], "input_ids_rejected": [10, 11],
         "attention_mask_rejected": [1, 1], "margin": 1},
    ]
    batch = collator(features)
    pad = tokenizer.pad_token_id
    assert batch["input_ids_chosen"].tolist() == [[5, 6, 7], [9, pad, pad]]
    assert batch["input_ids_rejected"].tolist() == [[8, pad, pad], [10, 11, pad]]
    assert batch["attention_mask_rejected"].tolist() == [[1, 0, 0], [1, 1, 0]]
    assert batch["margin"].tolist() == [0.5, 1.0]


def test_collator_takes_one_element_list_margins_and_refuses_longer(tokenizer):
    """TRL 0.11 datasets store a margin as a one-element list ([1.0]); it becomes one value per pair (B,)."""
    collator = RewardDataCollatorWithPadding(tokenizer)
    row = {"input_ids_chosen": [5], "attention_mask_chosen": [1], "input_ids_rejected": [8],
           "attention_mask_rejected": [1]}
    batch = collator([{**row, "margin": [1.5]}, {**row, "margin": torch.tensor([-0.25])}])
    assert batch["margin"].tolist() == [1.5, -0.25]
    with pytest.raises(ValueError, match=r"reward feature 0 margin must be one number .* got 2 values"):
        collator([{**row, "margin": [1.0, 2.0]}])


def test_reward_read_at_last_real_token_whatever_padding_side(tokenizer):
    model = tiny_reward_model(tokenizer).eval()
    texts = ["a lovely film", "the plot is boring and the ending is bad"]
    right = build_tokenizer(padding_side="right")(texts, return_tensors="pt", padding=True)
    left = build_tokenizer(padding_side="left")(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        r_right = sequence_rewards(model, right["input_ids"], right["attention_mask"])
        r_left = sequence_rewards(model, left["input_ids"], left["attention_mask"])
        pooled = model(**right).logits[:, 0]  # transformers' own pooling, right padding
        alone = torch.stack([sequence_rewards(model, *tokenizer(t, return_tensors="pt").values()) for t in texts])
    torch.testing.assert_close(r_left, r_right, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, pooled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_right, alone[:, 0], atol=1e-5, rtol=1e-5)


def test_compute_loss_is_pairwise_closed_form_with_margin(tokenizer, tmp_path):
    data = {**PAIRS, "margin": [0.0, 1.0, 2.0, -1.0]}
    trainer = RewardTrainer(model=tiny_reward_model(tokenizer), args=small_args(tmp_path),
                            train_dataset=Dataset.from_dict(data), tokenizer=tokenizer)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    loss, out = trainer.compute_loss(trainer.model, batch, return_outputs=True)
    expected = -F.logsigmoid(out["rewards_chosen"] - out["rewards_rejected"] - batch["margin"]).mean()
    torch.testing.assert_close(loss, expected)


def test_train_changes_weights_and_eval_reports_accuracy(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, center_rewards_coefficient=0.01)
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(v, before[k])]
    assert "score.weight" in changed and len(changed) > len(before) // 2
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and torch.isfinite(torch.tensor(metrics["eval_loss"]))


def test_compute_accuracy_is_strict():
    preds = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [3.0, -1.0]]).numpy()
    assert compute_accuracy((preds, None)) == {"accuracy": 0.5}


def test_max_length_drops_long_pairs(tokenizer, tmp_path):
    rows = [dict(zip(PAIRS, values)) for values in zip(*PAIRS.values())]
    longest = sorted(max(len(v) for v in tokenize_pair(r, tokenizer).values()) for r in rows)
    trainer = make_trainer(tokenizer, tmp_path, max_length=longest[1])  # keeps exactly the two shortest pairs
    kept = [max(len(r["input_ids_chosen"]), len(r["input_ids_rejected"])) for r in trainer.train_dataset]
    assert len(kept) == 2 + longest[2:].count(longest[1]) and max(kept) <= longest[1]
    with pytest.raises(ValueError, match="max_length=1"):
        make_trainer(tokenizer, tmp_path, max_length=1)


def test_peft_reward_model_trains_only_adapters(tokenizer, tmp_path):
    from peft import LoraConfig, TaskType

    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, lora_alpha=8, target_modules=["c_attn"])
    trainer = make_trainer(tokenizer, tmp_path, peft_config=config)
    frozen = {k: v.clone() for k, v in trainer.model.named_parameters() if not v.requires_grad}
    trainer.train()
    assert all(torch.equal(v, frozen[k]) for k, v in trainer.model.named_parameters() if k in frozen)
    trainer.save_model(str(tmp_path / "lora"))
    assert (tmp_path / "lora" / "adapter_model.safetensors").exists() and (tmp_path / "lora" / "README.md").exists()


def test_save_and_mlflow_tracking_without_double_logging(tokenizer, tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    args = small_args(tmp_path, max_steps=2, report_to=["mlflow"])
    trainer = make_trainer(tokenizer, tmp_path, args=args, log_with="mlflow", tracker_project_name="reward-test")
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert "MLflowCallback" not in names and names.count("TrackerCallback") == 1
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    run_id = mlflow.active_run().info.run_id
    trainer.tracker.finish()
    history = mlflow.MlflowClient().get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [1, 2]  # once per step: transformers' MLflowCallback was removed
    params = mlflow.get_run(run_id).data.params
    assert params["max_length"] == "512" and params["learning_rate"] == "0.01"
    assert (tmp_path / "final" / "model.safetensors").exists()
    card = (tmp_path / "final" / "README.md").read_text()
    assert "- reward\n" in card and "max_length" in card


def test_text_data_without_rejected_names_missing_columns(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="missing the columns .*Found: \\['chosen', 'text'\\]"):
        RewardTrainer(model=tiny_reward_model(tokenizer), args=small_args(tmp_path),
                      train_dataset=Dataset.from_dict({"text": ["x"], "chosen": ["y"]}), tokenizer=tokenizer)


def test_model_path_brings_its_tokenizer_and_conversational_pairs_are_rendered(tokenizer, tmp_path):
    """``RewardTrainer(model="<path>", train_dataset=<conversational chosen/rejected>)``, as TRL 1.x's quickstart:
    the tokenizer saved beside the model is loaded and each conversation rendered with its chat template (as TRL
    0.11.4 maps reward data) before ``tokenize_pair``."""
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tiny_reward_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    chosen = [{"role": "user", "content": "The film?"}, {"role": "assistant", "content": "great"}]
    rejected = [{"role": "user", "content": "The film?"}, {"role": "assistant", "content": "dull"}]
    trainer = RewardTrainer(model=str(tmp_path / "model"), args=small_args(tmp_path),
                            train_dataset=Dataset.from_dict({"chosen": [chosen], "rejected": [rejected]}))
    expected = tokenize_pair({"chosen": "<user>The film?\n<assistant>great\n",
                              "rejected": "<user>The film?\n<assistant>dull\n"}, trainer.processing_class)
    row = trainer.train_dataset[0]
    assert row["input_ids_chosen"] == expected["input_ids_chosen"]
    assert row["input_ids_rejected"] == expected["input_ids_rejected"]
