"""What TRL 0.11's example scripts met and rlhf_core lacked: ``PPOConfig.dataset_num_proc``, a tracker with
``log_images`` for DDPO's image hook, and clear errors for a tokenizer without a pad token in the completion-only
collator and for dataset rows that were never tensors in ``PPOTrainer.generate``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, DataCollatorForCompletionOnlyLM, PPOConfig, PPOTrainer
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.tracking import MemoryTracker, TensorBoardTracker, Tracker, image_array


def test_ppo_config_has_dataset_num_proc():
    assert PPOConfig().dataset_num_proc is None
    assert PPOConfig(dataset_num_proc=2).dataset_num_proc == 2
    assert "dataset_num_proc" in {f.name for f in dataclasses.fields(PPOConfig)}  # so HfArgumentParser parses it


def test_image_array_layouts():
    chw = torch.zeros(3, 2, 4)
    chw[0] = 1.0  # red, float in [0, 1]
    hwc = image_array(chw.unsqueeze(0))  # (1, C, H, W) as DDPO's example logs it
    assert hwc.shape == (2, 4, 3) and hwc.dtype == np.uint8
    assert hwc[..., 0].min() == 255 and hwc[..., 1:].max() == 0
    assert image_array(np.full((2, 4, 3), 7, dtype=np.uint8)).tolist() == np.full((2, 4, 3), 7).tolist()
    with pytest.raises(ValueError, match="C,H,W or H,W,C"):
        image_array(torch.zeros(4))


def test_trackers_take_images(tmp_path):
    Tracker().log_images({"a": torch.zeros(3, 2, 2)}, step=1)  # the null tracker accepts and drops
    memory = MemoryTracker()
    memory.log_images({"prompt | 0.50": torch.ones(1, 3, 2, 2)}, step=3)
    (step, images), = memory.images
    assert step == 3 and images["prompt | 0.50"].shape == (2, 2, 3) and images["prompt | 0.50"].min() == 255
    board = TensorBoardTracker(project_name="p", logging_dir=str(tmp_path))
    board.log_images({"img": torch.rand(3, 4, 4)}, step=0)
    board.finish()
    assert any((tmp_path / "p").iterdir())


def test_ddpo_hook_gets_a_tracker_with_log_images():
    """TRL 0.11's examples/scripts/ddpo.py hook calls ``accelerate_logger.log_images(result, step=...)`` on the
    tracker the trainer hands it: the trainer hands it ``self.tracker``, whose class has the method."""
    import inspect

    from rlhf_core.ddpo import trainer as ddpo_trainer

    assert "self.image_samples_callback(prompt_image_data, global_step, self.tracker)" in \
        inspect.getsource(ddpo_trainer)
    assert callable(getattr(MemoryTracker(), "log_images"))


def test_completion_only_collator_names_a_missing_pad_token(tokenizer):
    tokenizer.pad_token = None
    collator = DataCollatorForCompletionOnlyLM("Answer:", tokenizer=tokenizer)
    ids = tokenizer("Question: a\nAnswer: b", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        collator([{"input_ids": ids}, {"input_ids": ids[:-1]}])


def test_reward_collator_names_a_missing_pad_token(tokenizer):
    """TRL 0.11's reward_modeling.py on a tokenizer without a pad token: TRL says so; so does rlhf_core."""
    from rlhf_core import RewardDataCollatorWithPadding

    tokenizer.pad_token = None
    collator = RewardDataCollatorWithPadding(tokenizer)
    rows = [{"input_ids_chosen": [5, 6, 7], "attention_mask_chosen": [1, 1, 1], "input_ids_rejected": [5, 6],
             "attention_mask_rejected": [1, 1]}] * 2
    with pytest.raises(ValueError, match="no pad token.*tokenizer.pad_token = tokenizer.eos_token"):
        collator(rows)


def test_generate_refuses_rows_that_are_not_tensors(tokenizer):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer)
    with pytest.raises(ValueError, match=r"query_tensor\[0\] is a list.*set_format\(type='torch'\)"):
        trainer.generate([[5, 6, 7], [8, 9]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"query_tensor\[1\] must be 1-d"):
        trainer.generate([torch.tensor([5, 6]), torch.tensor([[5, 6]])], max_new_tokens=2)


def test_sentiment_pipeline_accepts_return_all_scores(tokenizer):
    """TRL 0.11's PPO clients read ``pipe(texts, return_all_scores=True)[i][1]["score"]``: every label, label order."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, pipeline

    from rlhf_core import transformers_compat

    transformers_compat.install()
    torch.manual_seed(0)
    model = GPT2ForSequenceClassification(GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=len(tokenizer), num_labels=2, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)).eval()
    pipe = pipeline("sentiment-analysis", model=model, tokenizer=tokenizer, device="cpu")
    texts = ["a film", "a good film"]
    with pytest.warns(FutureWarning, match="return_all_scores.*top_k=None"):
        old = pipe(texts, return_all_scores=True, function_to_apply="none")
    with torch.no_grad():
        logits = [model(**tokenizer(t, return_tensors="pt")).logits[0] for t in texts]  # (2,) per text
    assert [[d["label"] for d in row] for row in old] == [["LABEL_0", "LABEL_1"]] * 2  # label order, not sorted
    for row, logit in zip(old, logits):
        # the same forward on one row vs a batch: equal to float32 rounding (batched kernels sum in another order)
        assert [d["score"] for d in row] == pytest.approx(logit.tolist(), abs=1e-5)
    assert isinstance(pipe(texts, function_to_apply="none")[0], dict)  # a call without it is untouched


def test_kto_config_maps_warmup_ratio(tmp_path):
    """TRL 0.11's kto.py passes --warmup_ratio through transformers' own HfArgumentParser: KTOConfig takes it."""
    from transformers import HfArgumentParser

    from rlhf_core import KTOConfig
    from rlhf_core.trainers.base import portable_training_args

    with pytest.warns(FutureWarning, match="warmup_ratio.*warmup_steps=0.1"):
        (config,) = HfArgumentParser(KTOConfig).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--warmup_ratio", "0.1"])
    assert config.warmup_steps == 0.1
    assert "warmup_ratio" not in portable_training_args(config)  # training_args.json keeps its bytes
    with pytest.raises(ValueError, match="set warmup_steps only"):
        KTOConfig(output_dir=str(tmp_path), warmup_ratio=0.1, warmup_steps=5)


def test_kto_trainer_takes_trl_0_11_tokenizer_keyword(tokenizer, tmp_path):
    from datasets import Dataset

    from rlhf_core import KTOConfig, KTOTrainer

    rows = Dataset.from_dict({"prompt": ["a film", "the plot"], "completion": [" good", " bad"], "label": [True, False]})
    args = KTOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                     use_cpu=True, save_strategy="no", max_length=16)
    with pytest.warns(FutureWarning, match="processing_class"):
        trainer = KTOTrainer(tiny_causal_lm(tokenizer), args=args, train_dataset=rows, tokenizer=tokenizer)
    assert trainer.processing_class is tokenizer
    with pytest.raises(ValueError, match="two tokenizers"):
        KTOTrainer(tiny_causal_lm(tokenizer), args=args, train_dataset=rows, tokenizer=tokenizer,
                   processing_class=copy_of(tokenizer))


def copy_of(tokenizer):
    import copy

    return copy.deepcopy(tokenizer)
