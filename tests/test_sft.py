"""SFTTrainer, ConstantLengthDataset packing and the completion-only collator."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from rlhf_core.models.tiny import DEFAULT_CORPUS, tiny_causal_lm
from rlhf_core.trainers.collators import IGNORE_INDEX, ConstantLengthDataset, DataCollatorForCompletionOnlyLM
from rlhf_core.trainers.sft import SFTTrainer, tokenize_texts

TEXTS = list(DEFAULT_CORPUS[:8])


def small_args(tmp_path, **overrides) -> TrainingArguments:
    """Tiny CPU arguments that report nowhere and save nothing."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def token_stream(tokenizer, texts) -> list[int]:
    """Expected packing stream: each text's ids followed by EOS."""
    stream = []
    for text in texts:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return stream


def test_packing_full_blocks_eos_separators_no_lost_text(tokenizer):
    # buffer of 8 * 1.0 * 2 = 16 chars: many buffers, so the carry between buffers is exercised
    dataset = Dataset.from_dict({"text": TEXTS})
    packed = ConstantLengthDataset(
        tokenizer, dataset, dataset_text_field="text", seq_length=8, num_of_sequences=2, chars_per_token=1.0
    )
    blocks = [item["input_ids"] for item in packed]
    stream = token_stream(tokenizer, TEXTS)
    assert all(block.shape == (8,) for block in blocks)
    flat = torch.cat(blocks).tolist()
    assert flat == stream[: len(flat)]  # nothing lost or reordered between buffers
    assert len(stream) - len(flat) < 8  # only the final short tail is dropped
    assert flat.count(tokenizer.eos_token_id) == stream[: len(flat)].count(tokenizer.eos_token_id) >= len(TEXTS) - 1
    assert all(torch.equal(item["input_ids"], item["labels"]) for item in packed)


def test_packing_infinite_wraps_and_formatting_func(tokenizer):
    dataset = Dataset.from_dict({"a": ["ab"], "b": ["cd"]})
    packed = ConstantLengthDataset(
        tokenizer, dataset, formatting_func=lambda ex: ex["a"] + " " + ex["b"], infinite=True,
        seq_length=4, num_of_sequences=1, chars_per_token=1.0,
    )
    iterator = iter(packed)
    blocks = [next(iterator)["input_ids"].tolist() for _ in range(5)]  # more than one pass of data
    one_pass = token_stream(tokenizer, ["ab cd"])
    flat = sum(blocks, [])
    assert flat == (one_pass * 20)[: len(flat)]


def test_completion_only_labels_mask_prompt(tokenizer):
    prompts = ["Question: the film\nAnswer:", "Question: a story was\nAnswer:"]
    responses = [" great and warm", " boring"]
    rows = [
        tokenizer(p, add_special_tokens=False)["input_ids"] + tokenizer(r, add_special_tokens=False)["input_ids"]
        for p, r in zip(prompts, responses)
    ]
    collator = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=tokenizer)
    batch = collator([{"input_ids": r} for r in rows])
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        n_prompt = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        labels = batch["labels"][i]
        assert (labels[:n_prompt] == IGNORE_INDEX).all()  # prompt and template: no loss
        assert labels[n_prompt: len(row)].tolist() == row[n_prompt:]  # response: full loss
        assert (labels[len(row):] == IGNORE_INDEX).all()  # padding: no loss
        assert batch["attention_mask"][i].sum() == len(row)


def test_completion_only_missing_template_gets_no_loss(tokenizer):
    collator = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=tokenizer)
    ids = tokenizer("no template here", add_special_tokens=False)["input_ids"]
    with pytest.warns(UserWarning, match="not found"):
        batch = collator([{"input_ids": ids}])
    assert (batch["labels"] == IGNORE_INDEX).all()


def test_tokenize_texts_appends_eos_and_truncates(tokenizer):
    out = tokenize_texts(["the film", "the film was great and the acting was wonderful"], tokenizer, 6)
    assert out["input_ids"][0] == tokenizer("the film")["input_ids"] + [tokenizer.eos_token_id]
    assert len(out["input_ids"][1]) == 6
    assert out["attention_mask"][0] == [1] * len(out["input_ids"][0])


def test_sft_trainer_lowers_loss_and_accepts_tokenizer_kwarg(tokenizer, tmp_path):
    model = tiny_causal_lm(tokenizer)
    dataset = Dataset.from_dict({"text": TEXTS})
    batch = tokenizer(TEXTS[:4], return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)

    def loss() -> float:
        with torch.no_grad():
            return model(**batch, labels=labels).loss.item()

    before = loss()
    trainer = SFTTrainer(
        model=model, args=small_args(tmp_path, max_steps=8), train_dataset=dataset, tokenizer=tokenizer,
        dataset_text_field="text", max_seq_length=32,
    )
    assert trainer.processing_class is tokenizer
    trainer.train()
    assert loss() < before - 0.5


def test_sft_trainer_packing_builds_constant_length_dataset(tokenizer, tmp_path):
    trainer = SFTTrainer(
        model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=2),
        train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer, dataset_text_field="text",
        packing=True, max_seq_length=16, infinite=True,
    )
    assert isinstance(trainer.train_dataset, ConstantLengthDataset)
    trainer.train()
    assert trainer.state.global_step == 2


def test_sft_trainer_errors(tokenizer, tmp_path):
    model = tiny_causal_lm(tokenizer)
    dataset = Dataset.from_dict({"text": TEXTS})
    with pytest.raises(ValueError, match="dataset_text_field='body'"):
        SFTTrainer(model=model, args=small_args(tmp_path), train_dataset=dataset, tokenizer=tokenizer,
                   dataset_text_field="body")
    with pytest.raises(ValueError, match="dataset_text_field or formatting_func"):
        SFTTrainer(model=model, args=small_args(tmp_path), train_dataset=dataset, tokenizer=tokenizer)
    collator = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="packing=True"):
        SFTTrainer(model=model, args=small_args(tmp_path), train_dataset=dataset, tokenizer=tokenizer,
                   dataset_text_field="text", packing=True, data_collator=collator)
    with pytest.raises(ValueError, match="not both"):
        SFTTrainer(model=model, args=small_args(tmp_path), train_dataset=dataset, tokenizer=tokenizer,
                   processing_class=object(), dataset_text_field="text")


def test_sft_save_writes_safetensors_and_card(tokenizer, tmp_path):
    trainer = SFTTrainer(
        model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=1),
        train_dataset=Dataset.from_dict({"text": TEXTS}), tokenizer=tokenizer, dataset_text_field="text",
        max_seq_length=16, log_with="memory",
    )
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    assert (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: rlhf_core\ntags:\n- rlhf_core\n- sft\n")
    assert "max_seq_length" in card
    logged = [m for _, m in trainer.tracker.metrics]
    assert any("loss" in m for m in logged) and trainer.tracker.params["max_seq_length"] == 16


def test_write_model_card_front_matter_parses(tmp_path):
    yaml = pytest.importorskip("yaml")
    from rlhf_core.model_card import write_model_card

    path = write_model_card(
        tmp_path / "ckpt", model_name="policy", trainer_name="PPOTrainer", base_model="org/tiny: v1",
        hyperparameters={"learning_rate": 1e-5, "note": "a|b"}, metrics={"reward": 0.5}, notes="Trained offline.",
    )
    text = path.read_text()
    assert path == tmp_path / "ckpt" / "README.md"
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == {"library_name": "rlhf_core", "tags": ["rlhf_core", "ppo"], "base_model": "org/tiny: v1"}
    assert "trained with `rlhf_core`'s `PPOTrainer`" in text and "| learning_rate | 1e-05 |" in text and "| note | a\\|b |" in text and "## Notes\n\nTrained offline." in text


def test_sft_model_from_path_formatting_func_and_peft(tokenizer, tmp_path):
    from peft import LoraConfig

    path = tmp_path / "base"
    tiny_causal_lm(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    dataset = Dataset.from_dict({"q": ["the film", "the plot"], "a": ["great", "boring"]})
    trainer = SFTTrainer(
        model=str(path), args=small_args(tmp_path, max_steps=2, per_device_train_batch_size=2), train_dataset=dataset,
        formatting_func=lambda ex: f"Q: {ex['q']} A: {ex['a']}", max_seq_length=16,
        peft_config=LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True
        ),
    )
    first = trainer.train_dataset[0]["input_ids"]
    assert first == trainer.processing_class("Q: the film A: great")["input_ids"] + [tokenizer.eos_token_id]
    lora_before = {k: v.clone() for k, v in trainer.model.named_parameters() if "lora_B" in k}
    trainer.train()
    assert any(not torch.equal(v, lora_before[k]) for k, v in trainer.model.named_parameters() if k in lora_before)
    trainer.save_model(str(tmp_path / "adapter"))
    card = (tmp_path / "adapter" / "README.md").read_text()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists() and f'base_model: "{path}"' in card


def test_sft_trainer_with_completion_only_collator(tokenizer, tmp_path):
    texts = ["Question: the film\nAnswer: great", "Question: the plot\nAnswer: boring"]
    collator = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=tokenizer)
    trainer = SFTTrainer(
        model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=1, per_device_train_batch_size=2),
        train_dataset=Dataset.from_dict({"text": texts}), tokenizer=tokenizer, dataset_text_field="text",
        data_collator=collator, max_seq_length=32,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    answer_len = len(tokenizer(" great", add_special_tokens=False)["input_ids"]) + 1  # + EOS
    scored = (batch["labels"] != IGNORE_INDEX).sum(1).tolist()
    assert answer_len in scored and all(n <= 3 for n in scored)
    trainer.train()


def test_sft_trainer_takes_a_ready_tracker_as_tracker_argument(tokenizer, tmp_path):
    """The tracker reaches the Trainer-based trainers as ``tracker=``, not smuggled through ``log_with``."""
    from rlhf_core.tracking import MemoryTracker

    memory = MemoryTracker()
    trainer = SFTTrainer(
        model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=2), tracker=memory,
        train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer, dataset_text_field="text",
        max_seq_length=16,
    )
    trainer.train()
    assert trainer.tracker is memory
    assert [step for step, row in memory.metrics if "loss" in row] and "learning_rate" in memory.params


def test_completion_only_left_padding_keeps_response_labels(tokenizer):
    """With a left-padding tokenizer (TRL 0.11 pads on the tokenizer's side) the pad sits before each row, and
    the labels still cover exactly the response tokens of each row."""
    import copy

    left = copy.deepcopy(tokenizer)
    left.padding_side = "left"
    prompts = ["Question: the film\nAnswer:", "Question: a story was long and slow\nAnswer:"]
    responses = [" great", " boring"]
    rows = [left(p, add_special_tokens=False)["input_ids"] + left(r, add_special_tokens=False)["input_ids"]
            for p, r in zip(prompts, responses)]
    batch = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=left)([{"input_ids": r} for r in rows])
    width = max(map(len, rows))
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        pad = width - len(row)
        n_prompt = len(left(prompt, add_special_tokens=False)["input_ids"])
        assert batch["input_ids"][i].tolist() == [left.pad_token_id] * pad + row
        assert batch["attention_mask"][i].tolist() == [0] * pad + [1] * len(row)
        assert batch["labels"][i].tolist() == [IGNORE_INDEX] * (pad + n_prompt) + row[n_prompt:]


def test_packed_data_repeats_only_for_max_steps_and_infinite_is_deprecated(tokenizer, tmp_path):
    """TRL 0.11's rule: packing + max_steps > 0 -> the ConstantLengthDataset repeats; max_steps=-1 -> one pass."""
    dataset = Dataset.from_dict({"text": TEXTS})
    common = dict(train_dataset=dataset, processing_class=tokenizer, dataset_text_field="text", packing=True,
                  max_seq_length=16)
    by_steps = SFTTrainer(model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=2), **common)
    assert by_steps.train_dataset.infinite is True
    with pytest.warns(FutureWarning, match=r"SFTTrainer\(infinite=\.\.\.\) is deprecated"):
        by_epochs = SFTTrainer(model=tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=-1),
                               infinite=True, **common)
    assert by_epochs.train_dataset.infinite is False


def test_trl_activate_neftune_adds_bounded_uniform_noise_in_training_only(tokenizer, tmp_path):
    """NEFTune: embeddings + U(-a/sqrt(T*d), a/sqrt(T*d)) in train mode, unchanged in eval mode; one hook,
    removed by its handle; train() adds and removes its own."""
    model = tiny_causal_lm(tokenizer)
    trainer = SFTTrainer(model=model, args=small_args(tmp_path, max_steps=1, neftune_noise_alpha=5.0),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer,
                         dataset_text_field="text", max_seq_length=16)
    embeddings = model.get_input_embeddings()
    ids = torch.tensor([[1, 2, 3]])  # (1, T=3)
    clean = embeddings(ids).detach()  # (1, 3, d)
    assert trainer._trl_activate_neftune(model) is model
    assert len(embeddings._forward_hooks) == 1
    model.train()
    noisy = embeddings(ids).detach()
    bound = 5.0 / (3 * clean.shape[-1]) ** 0.5
    assert 0 < (noisy - clean).abs().max() <= bound + 1e-6
    model.eval()
    assert torch.equal(embeddings(ids), clean)
    trainer.neftune_hook_handle.remove()
    assert len(embeddings._forward_hooks) == 0
    trainer.train()
    assert len(embeddings._forward_hooks) == 0 and not hasattr(embeddings, "neftune_noise_alpha")


def test_neftune_keyword_overrides_config_and_torch_dtype_is_checked(tokenizer, tmp_path):
    from rlhf_core.trainers.base import checked_init_kwargs

    args = small_args(tmp_path, neftune_noise_alpha=1.0)
    with pytest.warns(UserWarning, match="neftune_noise_alpha=3.0 passed to the trainer overrides"):
        trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, train_dataset=Dataset.from_dict(
            {"text": TEXTS}), processing_class=tokenizer, dataset_text_field="text", neftune_noise_alpha=3.0)
    assert trainer.neftune_noise_alpha == 3.0
    assert checked_init_kwargs({"torch_dtype": "float16"}, "SFTConfig") == {"torch_dtype": torch.float16}
    assert checked_init_kwargs({"torch_dtype": "auto", "x": 1}, "SFTConfig") == {"torch_dtype": "auto", "x": 1}
    with pytest.raises(ValueError, match=r"Invalid `torch_dtype` passed to the SFTConfig.*but got -1\. "
                                         r"\(SFTConfig.model_init_kwargs\['torch_dtype'\]\)"):
        SFTTrainer(model="any/path", args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                   processing_class=tokenizer, dataset_text_field="text", model_init_kwargs={"torch_dtype": -1})
    with pytest.raises(ValueError, match="but got Tensor"):
        checked_init_kwargs({"torch_dtype": "Tensor"}, "DPOConfig", "ref_model_init_kwargs")


# ---- an evaluation strategy without an eval dataset (TRL 0.11 with transformers 4.45 accepts it) -----------


def test_eval_strategy_without_eval_dataset_trains_when_no_evaluation_falls_in_the_run(tokenizer, tmp_path):
    # eval_steps defaults to logging_steps (500): the 2-step run ends first, so TRL 0.11 never evaluated
    from rlhf_core.trainers.sft import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path), eval_strategy="steps", max_steps=2, per_device_train_batch_size=2,
                     max_seq_length=16, dataset_text_field="text", report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(tiny_causal_lm(tokenizer), args=args, train_dataset=Dataset.from_dict({"text": TEXTS}),
                         tokenizer=tokenizer)
    assert args.eval_strategy == "steps"  # the caller's arguments are left as given
    trainer.train()
    assert trainer.state.global_step == 2 and trainer.state.log_history[-1]["train_loss"] is not None
    assert not any(key.startswith("eval_") for entry in trainer.state.log_history for key in entry)


@pytest.mark.parametrize("overrides, due", [({"eval_strategy": "steps", "eval_steps": 2}, 2),
                                            ({"eval_strategy": "steps", "eval_steps": 0.5}, 2),
                                            ({"eval_strategy": "epoch"}, 2)])
def test_eval_strategy_without_eval_dataset_is_refused_before_training_when_an_evaluation_is_due(
    overrides, due, tokenizer, tmp_path
):
    model = tiny_causal_lm(tokenizer)
    trainer = SFTTrainer(model, args=small_args(tmp_path, max_steps=3, **overrides),
                         train_dataset=Dataset.from_dict({"text": TEXTS}), tokenizer=tokenizer, max_seq_length=16,
                         dataset_text_field="text")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"evaluates at step {due} of this run's 3, but no eval_dataset was given"):
        trainer.train()
    assert trainer.state.global_step == 0 and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_eval_strategy_with_an_eval_dataset_still_evaluates(tokenizer, tmp_path):
    dataset = Dataset.from_dict({"text": TEXTS})
    trainer = SFTTrainer(tiny_causal_lm(tokenizer), args=small_args(tmp_path, max_steps=2, eval_strategy="steps",
                                                                    eval_steps=1, per_device_eval_batch_size=4),
                         train_dataset=dataset, eval_dataset=dataset, tokenizer=tokenizer, max_seq_length=16,
                         dataset_text_field="text")
    trainer.train()
    assert sum("eval_loss" in entry for entry in trainer.state.log_history) >= 2


def test_packing_data_too_short_for_one_block_is_refused_as_trl_does(tokenizer, tmp_path):
    # TRL 0.11 packs a sized dataset up front and refuses one that yields no max_seq_length block
    dataset = Dataset.from_dict({"text": TEXTS[:2]})
    with pytest.raises(ValueError, match=r"enough samples to at least yield one packed sequence. \(2 rows give fewer "
                                         r"than max_seq_length=1024 tokens"):
        SFTTrainer(tiny_causal_lm(tokenizer), args=small_args(tmp_path), train_dataset=dataset, tokenizer=tokenizer,
                   dataset_text_field="text", packing=True, max_seq_length=1024)
    packed = ConstantLengthDataset(tokenizer, dataset, dataset_text_field="text", seq_length=1024, infinite=True)
    assert not packed.fills_a_block() and packed.infinite  # one pass decides; the dataset itself keeps repeating
    assert ConstantLengthDataset(tokenizer, dataset, dataset_text_field="text", seq_length=4).fills_a_block()
