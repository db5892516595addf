"""DPOTrainer: tokenisation and truncation, concatenated forward, references, metrics, errors, save."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from rlhf_core.losses import dpo_loss
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.collators import DPODataCollatorWithPadding
from rlhf_core.trainers.preference.dpo import (
    DPOTrainer,
    concatenate_pairs,
    response_logprobs,
    tokenize_dpo_row,
    truncate_prompt_and_responses,
)

ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was"],
    "chosen": [" great and warm", " loved the film", " lovely", " wonderful"],
    "rejected": [" terrible", " hated it and the pacing", " boring and dull", " awful"],
}
METRIC_KEYS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected",
)


def small_args(tmp_path, **overrides) -> TrainingArguments:
    """Tiny CPU arguments that report nowhere and save nothing."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=5e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def make_trainer(tokenizer, tmp_path, model=None, **kwargs) -> DPOTrainer:
    """A DPO trainer on the four rows above."""
    dataset = Dataset.from_dict(ROWS)
    kwargs.setdefault("args", small_args(tmp_path))
    return DPOTrainer(
        model=model if model is not None else tiny_causal_lm(tokenizer), train_dataset=dataset, eval_dataset=dataset,
        tokenizer=tokenizer, max_length=32, max_prompt_length=8, **kwargs,
    )


def first_batch(trainer: DPOTrainer) -> dict:
    """The first (unshuffled) collated batch of the train set."""
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])


# ---- tokenisation ----------------------------------------------------------------------------


def test_tokenize_row_without_truncation(tokenizer):
    row = {"prompt": "The film was", "chosen": " great", "rejected": " bad"}
    out = tokenize_dpo_row(row, tokenizer, max_length=64, max_prompt_length=32)
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos, p = tokenizer.eos_token_id, enc("The film was")
    assert out["prompt_input_ids"] == p and out["prompt_attention_mask"] == [1] * len(p)
    assert out["chosen_input_ids"] == p + enc(" great") + [eos]
    assert out["rejected_input_ids"] == p + enc(" bad") + [eos]
    assert out["chosen_labels"] == [-100] * len(p) + enc(" great") + [eos]
    assert out["rejected_labels"] == [-100] * len(p) + enc(" bad") + [eos]
    assert out["chosen_attention_mask"] == [1] * len(out["chosen_input_ids"])


def test_truncation_keep_end_and_keep_start_row_by_row():
    prompt, chosen, rejected = list(range(10)), [100, 101, 102], [200]

    def cut(max_length: int, mode: str) -> tuple:
        return truncate_prompt_and_responses(prompt, chosen, rejected, max_length, 4, mode)

    # 10 + 3 > 8: prompt cut to max_prompt_length = 4 tokens, then 4 + 3 <= 8 so responses stay whole
    assert cut(8, "keep_end") == ([6, 7, 8, 9], chosen, rejected)
    assert cut(8, "keep_start") == ([0, 1, 2, 3], chosen, rejected)
    # 10 + 3 > 6: prompt to 4, 4 + 3 > 6: responses cut to 6 - 4 = 2 tokens (keep their start)
    assert cut(6, "keep_end") == ([6, 7, 8, 9], [100, 101], [200])
    # fits: nothing changes even if the prompt is longer than max_prompt_length
    assert cut(20, "keep_end") == (prompt, chosen, rejected)
    with pytest.raises(ValueError, match="truncation_mode"):
        truncate_prompt_and_responses(prompt, chosen, rejected, 8, 4, "middle")


def test_tokenize_row_truncated_labels_still_mask_prompt(tokenizer):
    row = {"prompt": "The plot is boring, the dialogue is awful", "chosen": " great film", "rejected": " bad"}
    out = tokenize_dpo_row(row, tokenizer, max_length=10, max_prompt_length=6, truncation_mode="keep_end")
    n_prompt = len(out["prompt_input_ids"])
    assert n_prompt == 6 and len(out["chosen_input_ids"]) <= 10
    assert out["prompt_input_ids"] == tokenizer(row["prompt"], add_special_tokens=False)["input_ids"][-6:]
    assert out["chosen_labels"][:n_prompt] == [-100] * 6
    assert out["chosen_labels"][n_prompt:] == out["chosen_input_ids"][n_prompt:]


# ---- batching and log-probs ------------------------------------------------------------------


def test_collator_and_concatenate_pairs():
    features = [
        {"prompt_input_ids": [1, 2], "prompt_attention_mask": [1, 1], "chosen_input_ids": [1, 2, 3],
         "chosen_attention_mask": [1, 1, 1], "chosen_labels": [-100, -100, 3], "rejected_input_ids": [1, 2, 4, 5, 6],
         "rejected_attention_mask": [1] * 5, "rejected_labels": [-100, -100, 4, 5, 6], "prompt": "p"},
        {"prompt_input_ids": [7], "prompt_attention_mask": [1], "chosen_input_ids": [7, 8],
         "chosen_attention_mask": [1, 1], "chosen_labels": [-100, 8], "rejected_input_ids": [7, 9],
         "rejected_attention_mask": [1, 1], "rejected_labels": [-100, 9], "prompt": "q"},
    ]
    batch = DPODataCollatorWithPadding(pad_token_id=0)(features)
    assert batch["prompt_input_ids"].tolist() == [[1, 2], [0, 7]]  # prompts padded on the left
    assert batch["chosen_labels"].tolist() == [[-100, -100, 3], [-100, 8, -100]]
    assert batch["prompt"] == ["p", "q"]
    cat = concatenate_pairs(batch, padding_value=0, label_pad_token_id=-100)
    # rows: chosen 0, chosen 1, rejected 0, rejected 1
    assert cat["concatenated_input_ids"].tolist() == [
        [1, 2, 3, 0, 0], [7, 8, 0, 0, 0], [1, 2, 4, 5, 6], [7, 9, 0, 0, 0]
    ]
    assert cat["concatenated_attention_mask"].sum(1).tolist() == [3, 2, 5, 2]
    assert cat["concatenated_labels"][0].tolist() == [-100, -100, 3, -100, -100]


def test_response_logprobs_matches_naive_loop():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 6), generator=generator)
    labels[:, :2] = -100
    labels[1, 4:] = -100
    total = response_logprobs(logits, labels)
    mean = response_logprobs(logits, labels, average=True)
    for b in range(3):
        terms = [torch.log_softmax(logits[b, t - 1], -1)[labels[b, t]] for t in range(1, 6) if labels[b, t] != -100]
        # core.logprobs_from_logits computes in fp32 (even for fp64 logits), hence 1e-5
        assert abs(total[b].item() - sum(terms).item()) < 1e-5
        assert abs(mean[b].item() - sum(terms).item() / len(terms)) < 1e-5


def test_concatenated_forward_equals_separate_passes(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    batch = first_batch(trainer)
    chosen_logps, rejected_logps, chosen_logits, rejected_logits, _ = trainer.concatenated_forward(trainer.model, batch)
    assert chosen_logps.shape == rejected_logps.shape == (4,) and chosen_logits.shape[0] == 4
    with torch.no_grad():
        for side, got in (("chosen", chosen_logps), ("rejected", rejected_logps)):
            out = trainer.model(input_ids=batch[f"{side}_input_ids"], attention_mask=batch[f"{side}_attention_mask"])
            expected = response_logprobs(out.logits, batch[f"{side}_labels"])
            torch.testing.assert_close(got.detach(), expected, atol=1e-5, rtol=1e-5)


# ---- training and references -----------------------------------------------------------------


def test_training_changes_policy_keeps_reference_and_logs_metrics(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    policy_before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    ref_before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.train()
    changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(v, policy_before[k])]
    assert len(changed) > len(policy_before) // 2
    assert all(torch.equal(v, ref_before[k]) for k, v in trainer.ref_model.state_dict().items())
    step_logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(step_logs) == 3
    for key in METRIC_KEYS:
        assert all(math.isfinite(e[key]) for e in step_logs), key
    # the first step starts from policy == reference: rewards 0, loss log 2
    assert abs(step_logs[0]["rewards/margins"]) < 1e-6 and abs(step_logs[0]["loss"] - math.log(2)) < 1e-5
    assert step_logs[-1]["rewards/margins"] > 0
    metrics = trainer.evaluate()
    assert all(f"eval_{k}" in metrics for k in METRIC_KEYS)


def test_trainer_loss_matches_pure_dpo_loss(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, beta=0.5)
    batch = first_batch(trainer)
    for loss_type, label_smoothing in [("hinge", 0.0), ("ipo", 0.0), ("robust", 0.1), ("sigmoid", 0.1)]:
        trainer.loss_type, trainer.label_smoothing = loss_type, label_smoothing
        loss, _ = trainer.get_batch_metrics(trainer.model, batch)  # classic name of get_batch_loss_metrics
        pc, pr = trainer.concatenated_forward(trainer.model, batch)[:2]
        rc, rr = trainer.compute_reference_log_probs(batch)
        losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type=loss_type, label_smoothing=label_smoothing)
        torch.testing.assert_close(loss, losses.mean())
        if loss_type == "ipo":  # ipo compares mean (not summed) log-probs; policy == reference so h = 0
            torch.testing.assert_close(loss, torch.tensor(1 / (2 * 0.5)) ** 2)


def test_peft_policy_uses_disabled_adapter_as_reference(tokenizer, tmp_path):
    from peft import LoraConfig

    base = tiny_causal_lm(tokenizer)
    original = tiny_causal_lm(tokenizer)  # same seed: the weights the adapter starts from
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True)
    trainer = make_trainer(tokenizer, tmp_path, model=base, peft_config=config)
    assert trainer.ref_model is None and trainer.use_peft_reference
    trainer.train()
    batch = first_batch(trainer)
    ref_chosen, _ = trainer.compute_reference_log_probs(batch)
    policy_chosen = trainer.concatenated_forward(trainer.model, batch)[0]
    with torch.no_grad():
        logits = original(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
        expected = response_logprobs(logits, batch["chosen_labels"])
    torch.testing.assert_close(ref_chosen, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(policy_chosen.detach(), expected)  # the adapter did learn something


def test_precomputed_reference_logps_match_live_reference(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=small_args(tmp_path, max_steps=1), precompute_ref_log_probs=True)
    assert {"reference_chosen_logps", "reference_rejected_logps"} <= set(trainer.train_dataset.column_names)
    batch = first_batch(trainer)
    live_chosen, live_rejected = trainer.compute_reference_log_probs(batch)
    torch.testing.assert_close(batch["reference_chosen_logps"], live_chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch["reference_rejected_logps"], live_rejected, atol=1e-5, rtol=1e-5)
    trainer.train()
    assert trainer.state.global_step == 1


def test_reference_free_needs_no_reference(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=small_args(tmp_path, max_steps=1), reference_free=True)
    assert trainer.ref_model is None
    trainer.train()
    with pytest.raises(ValueError, match="reference_free"):
        trainer.compute_reference_log_probs(first_batch(trainer))


def test_get_batch_samples_generates_from_policy_and_reference(tokenizer, tmp_path):
    # training (other tests) goes through transformers' own get_batch_samples(epoch_iterator, ...)
    trainer = make_trainer(tokenizer, tmp_path, log_with="memory", generate_during_eval=True)
    trainer.max_length = 12  # prompts are <= 8 tokens: at most 4 sampled tokens keeps this fast
    batch = first_batch(trainer)
    policy, reference = trainer.get_batch_samples(trainer.model, batch)
    assert len(policy) == len(reference) == 4 and all(isinstance(s, str) for s in policy + reference)
    assert all(text.startswith(prompt) for text, prompt in zip(policy, ROWS["prompt"]))
    trainer.evaluate()
    name, columns, rows, _ = trainer.tracker.tables[0]
    assert name == "game_log" and columns == ["Prompt", "Policy", "Ref Model"] and len(rows) == 4


# ---- errors and save -------------------------------------------------------------------------


def test_value_errors(tokenizer, tmp_path):
    model = tiny_causal_lm(tokenizer)
    with pytest.raises(ValueError, match="needs model="):
        DPOTrainer(model=None, args=small_args(tmp_path), tokenizer=tokenizer)
    with pytest.raises(ValueError, match="ref_model is model"):
        make_trainer(tokenizer, tmp_path, model=model, ref_model=model)
    with pytest.raises(ValueError, match=r"missing the columns \['rejected'\]"):
        DPOTrainer(model=model, args=small_args(tmp_path), tokenizer=tokenizer,
                   train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"]}))
    with pytest.raises(ValueError, match="loss_type"):
        make_trainer(tokenizer, tmp_path, model=model, loss_type="kto")
    with pytest.raises(ValueError, match="truncation_mode"):
        make_trainer(tokenizer, tmp_path, model=model, truncation_mode="keep_middle")
    with pytest.raises(ValueError, match="max_prompt_length"):
        DPOTrainer(model=model, args=small_args(tmp_path), tokenizer=tokenizer, max_length=8, max_prompt_length=8)


def test_save_model_card_and_tracker(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=small_args(tmp_path, max_steps=1), log_with="memory")
    trainer.train()
    trainer.evaluate()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()
    card = (tmp_path / "final" / "README.md").read_text()
    assert "- dpo\n" in card and "| beta | 0.1 |" in card and "rewards/accuracies" in card
    logged = {k for _, metrics in trainer.tracker.metrics for k in metrics}
    assert {"rewards/accuracies", "eval_rewards/accuracies", "loss"} <= logged
    assert trainer.tracker.params["beta"] == 0.1


def test_generate_during_eval_without_tracker_needs_wandb_as_in_trl(tokenizer, tmp_path, monkeypatch):
    import rlhf_core.trainers.preference.dpo as dpo_module

    monkeypatch.setattr(dpo_module, "is_wandb_available", lambda: False)
    with pytest.raises(ValueError, match="`generate_during_eval=True` requires Weights and Biases to be installed"):
        make_trainer(tokenizer, tmp_path, generate_during_eval=True)
    trainer = make_trainer(tokenizer, tmp_path, generate_during_eval=True, log_with="memory")  # a tracker takes it
    assert trainer.generate_during_eval


def test_model_init_kwargs_torch_dtype_checked_with_trl_wording(tokenizer, tmp_path):
    from rlhf_core.trainers.preference.dpo import DPOConfig

    path = tmp_path / "base"
    tiny_causal_lm(tokenizer).save_pretrained(path)
    args = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, model_init_kwargs={"torch_dtype": "float16"},
                     ref_model_init_kwargs={"torch_dtype": "float16"})
    trainer = DPOTrainer(model=str(path), ref_model=str(path), args=args, tokenizer=tokenizer,
                         train_dataset=Dataset.from_dict(ROWS), max_length=32, max_prompt_length=8)
    assert trainer.model.dtype == trainer.ref_model.dtype == torch.float16
    for field in ("model_init_kwargs", "ref_model_init_kwargs"):
        bad = DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **{field: {"torch_dtype": -1}})
        with pytest.raises(ValueError, match=r"Invalid `torch_dtype` passed to the DPOConfig\. Expected a string "
                                             rf"with either `torch.dtype` or 'auto', but got -1\. \(DPOConfig.{field}"):
            DPOTrainer(model=str(path), ref_model=str(path), args=bad, tokenizer=tokenizer,
                       train_dataset=Dataset.from_dict(ROWS), max_length=32, max_prompt_length=8)


# ---- TRL 1.x's quickstart call: a model name, conversational pairs with an implicit prompt --------------------

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_model_name_brings_its_tokenizer_and_conversations_are_rendered(tokenizer, tmp_path):
    """``DPOTrainer(model="<path>", train_dataset=<conversational chosen/rejected>)``, as TRL 1.x's quickstart:
    the tokenizer saved beside the model is loaded, the shared prompt extracted and every part rendered with the
    chat template (as TRL 0.11.4 maps its datasets) before tokenising."""
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_causal_lm(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    rows = Dataset.from_dict({"chosen": [conversation("The film?", "great")],
                              "rejected": [conversation("The film?", "dull")]})
    trainer = DPOTrainer(model=str(tmp_path / "model"), args=small_args(tmp_path), train_dataset=rows,
                         max_length=32, max_prompt_length=16)
    assert trainer.processing_class.chat_template == CHAT_TEMPLATE
    row = trainer.train_dataset[0]
    assert (row["prompt"], row["chosen"], row["rejected"]) == ("<user>The film?\n<assistant>", "great\n", "dull\n")
    assert row["prompt_input_ids"] == trainer.processing_class("<user>The film?\n<assistant>")["input_ids"]


def test_string_rows_with_a_prompt_are_not_mapped_before_tokenising(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    rows = Dataset.from_dict(ROWS)
    assert trainer._render_conversations(rows) is rows


def test_string_rows_without_a_prompt_get_the_shared_start_as_prompt(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    rows = trainer._render_conversations(Dataset.from_dict({"chosen": ["The film was great"],
                                                            "rejected": ["The film was dull"]}))
    assert (rows[0]["prompt"], rows[0]["chosen"], rows[0]["rejected"]) == ("The film was", " great", " dull")


def test_no_tokenizer_and_no_model_path_names_both_ways(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="needs tokenizer= .*or a model name/path"):
        DPOTrainer(model=tiny_causal_lm(tokenizer), args=small_args(tmp_path), train_dataset=Dataset.from_dict(ROWS))
