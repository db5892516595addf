"""The classic TRL 0.11 surface: configs (SFTConfig, DPOConfig), TRL's public paths, helpers tests and
subclasses use, and the small behaviours TRL 0.11's own tests pin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

import pytest
from datasets import Dataset
from transformers import TrainingArguments

from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.collators import ConstantLengthDataset
from rlhf_core.trainers.preference.dpo import (
    DPOConfig,
    DPOTrainer,
    FDivergenceType,
    _build_tokenized_answer,
    _truncate_tokens,
)
from rlhf_core.trainers.sft import SFTConfig, SFTTrainer

REPO = Path(__file__).resolve().parents[1]
DPO_ROWS = {"prompt": ["The film was", "The story is"], "chosen": [" great", " lovely"], "rejected": [" bad", " dull"]}
TEXTS = {"text": ["This movie was great.", "The plot is boring.", "A good film.", "I hated it."]}


def cpu_args(config_class, tmp_path, **fields):
    """A TRL-style config that reports nowhere, on the CPU."""
    return config_class(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", **fields)


# ---- SFTConfig ---------------------------------------------------------------------------------


def test_sft_reads_its_options_from_sft_config(tokenizer, tmp_path):
    args = cpu_args(SFTConfig, tmp_path, dataset_text_field="text", packing=True, max_seq_length=8,
                    num_of_sequences=4, chars_per_token=2.0)
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, tokenizer=tokenizer,
                         train_dataset=Dataset.from_dict(TEXTS))
    assert trainer.max_seq_length == 8 and trainer.packing is True
    packed = trainer.train_dataset
    assert isinstance(packed, ConstantLengthDataset)
    assert (packed.seq_length, packed.num_of_sequences, packed.chars_per_token) == (8, 4, 2.0)
    assert all(block["input_ids"].shape == (8,) for block in packed)


def test_sft_keyword_overrides_config_with_a_warning(tokenizer, tmp_path):
    args = cpu_args(SFTConfig, tmp_path, dataset_text_field="text", max_seq_length=8)
    with pytest.warns(UserWarning, match="max_seq_length=6 passed to the trainer overrides SFTConfig.max_seq_length=8"):
        trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, tokenizer=tokenizer,
                             train_dataset=Dataset.from_dict(TEXTS), max_seq_length=6)
    assert trainer.max_seq_length == 6
    assert max(len(row) for row in trainer.train_dataset["input_ids"]) == 6


def test_sft_skip_prepare_dataset_hands_the_dataset_over(tokenizer, tmp_path):
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 1]], "text": ["x"]})
    args = cpu_args(SFTConfig, tmp_path, dataset_text_field="text", dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, tokenizer=tokenizer, train_dataset=dataset)
    assert trainer.train_dataset.column_names == ["input_ids", "attention_mask", "text"]


def test_sft_config_refuses_liger(tmp_path):
    with pytest.raises(ValueError, match="use_liger"):
        cpu_args(SFTConfig, tmp_path, use_liger=True)


def test_constant_length_dataset_len_is_the_number_of_texts(tokenizer):
    packed = ConstantLengthDataset(tokenizer, Dataset.from_dict(TEXTS), dataset_text_field="text", seq_length=4)
    assert len(packed) == 4


# ---- DPOConfig -----------------------------------------------------------------------------------


def dpo_trainer(tokenizer, tmp_path, args, **kwargs) -> DPOTrainer:
    return DPOTrainer(model=tiny_causal_lm(tokenizer), args=args, tokenizer=tokenizer,
                      train_dataset=Dataset.from_dict(DPO_ROWS), **kwargs)


def test_dpo_reads_its_options_from_dpo_config(tokenizer, tmp_path):
    args = cpu_args(DPOConfig, tmp_path, beta=0.3, loss_type="ipo", max_length=16, max_prompt_length=4,
                    truncation_mode="keep_start", label_pad_token_id=-7)
    trainer = dpo_trainer(tokenizer, tmp_path, args)
    assert (trainer.beta, trainer.loss_type, trainer.max_length, trainer.max_prompt_length) == (0.3, "ipo", 16, 4)
    assert trainer.truncation_mode == "keep_start" and trainer.label_pad_token_id == -7
    labels = trainer.train_dataset[0]["chosen_labels"]
    n_prompt = len(trainer.train_dataset[0]["prompt_input_ids"])
    assert labels[:n_prompt] == [-7] * n_prompt


def test_dpo_padding_value_defaults(tokenizer, tmp_path):
    """The spec's keyword default is 0; DPOConfig's default (None) means the tokenizer's pad token."""
    plain = dpo_trainer(tokenizer, tmp_path, cpu_args(TrainingArguments, tmp_path))
    assert plain.padding_value == 0
    configured = dpo_trainer(tokenizer, tmp_path, cpu_args(DPOConfig, tmp_path))
    assert configured.padding_value == tokenizer.pad_token_id != 0
    explicit = dpo_trainer(tokenizer, tmp_path, cpu_args(DPOConfig, tmp_path, padding_value=5))
    assert explicit.padding_value == 5


def test_dpo_model_init_builds_the_policy(tokenizer, tmp_path):
    built = []

    def model_init():
        built.append(tiny_causal_lm(tokenizer, seed=3))
        return built[-1]

    trainer = DPOTrainer(model_init=model_init, args=cpu_args(DPOConfig, tmp_path), tokenizer=tokenizer,
                         train_dataset=Dataset.from_dict(DPO_ROWS))
    assert len(built) == 1 and trainer.model is built[0]
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model


def test_dpo_without_model_or_model_init_names_both(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="model_init"):
        DPOTrainer(args=cpu_args(DPOConfig, tmp_path), tokenizer=tokenizer, train_dataset=Dataset.from_dict(DPO_ROWS))


@pytest.mark.parametrize(
    ("field", "value"),
    [("model_adapter_name", "train"), ("ref_adapter_name", "reference")],  # RPO, TR-DPO, enc-dec: test_dpo_extensions
)
def test_dpo_config_refuses_what_rlhf_core_does_not_implement(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"DPOConfig.{field}="):
        cpu_args(DPOConfig, tmp_path, **{field: value})


def test_f_divergence_type_values_and_string_form(tmp_path):
    assert [t.value for t in FDivergenceType] == ["reverse_kl", "js_divergence", "alpha_divergence"]
    assert cpu_args(DPOConfig, tmp_path, f_divergence_type="reverse_kl").f_divergence_type is FDivergenceType.REVERSE_KL


# ---- TRL 0.11 DPO helpers -------------------------------------------------------------------------


class MergingTokenizer:
    """Characters are tokens, except that "ab" is one token (id 99): "a" + "b" merge across the boundary."""

    def __call__(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text[i:i + 2] == "ab":
                ids.append(99)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}


def test_build_tokenized_answer_splits_the_joint_encoding():
    result = _build_tokenized_answer("xy", "zw", tokenizer=MergingTokenizer())
    assert result == {"prompt_input_ids": [120, 121], "prompt_attention_mask": [1, 1],
                      "input_ids": [122, 119], "attention_mask": [1, 1]}


def test_build_tokenized_answer_moves_a_merged_token_to_the_answer():
    # "xa" alone is [120, 97]; "xa" + "bc" is [120, 99, 99]: the merged "ab" token starts the answer.
    result = _build_tokenized_answer("xa", "bc", tokenizer=MergingTokenizer())
    assert result["prompt_input_ids"] == [120]
    assert result["input_ids"] == [99, 99]
    assert result["prompt_input_ids"] + result["input_ids"] == MergingTokenizer()("xabc")["input_ids"]


def test_build_tokenized_answer_with_a_processor():
    def processor(text, images=None, add_special_tokens=True):
        ids = [[ord(c) for c in text]]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(1, len(text), dtype=torch.long),
                "pixel_values": torch.zeros(1, 3, 2, 2)}

    result = _build_tokenized_answer("ab", "c", processor=processor)
    assert result["prompt_input_ids"] == [97, 98] and result["input_ids"] == [99]
    assert result["prompt_pixel_values"].shape == (3, 2, 2)


def test_truncate_tokens_keep_end_and_response_cut():
    args = SimpleNamespace(max_length=20, max_prompt_length=10, truncation_mode="keep_end")
    row = lambda n_prompt, response: {  # noqa: E731
        "prompt_input_ids": list(range(n_prompt)), "prompt_attention_mask": [1] * n_prompt,
        "input_ids": response, "attention_mask": [1] * len(response),
    }
    chosen, rejected = [row(15, list(range(100, 110)))], [row(15, list(range(200, 213)))]
    prompt = [{"prompt_input_ids": list(range(15)), "prompt_attention_mask": [1] * 15}]
    _truncate_tokens(chosen, rejected, prompt, args)
    assert prompt[0]["prompt_input_ids"] == chosen[0]["prompt_input_ids"] == list(range(5, 15))
    assert chosen[0]["input_ids"] == list(range(100, 110))  # 10 + 13 > 20: cut to 20 - 10 = 10
    assert rejected[0]["input_ids"] == list(range(200, 210)) and rejected[0]["attention_mask"] == [1] * 10


def test_truncate_tokens_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="truncation_mode"):
        _truncate_tokens([], [], [], SimpleNamespace(max_length=4, max_prompt_length=2, truncation_mode="middle"))


# ---- value-head and DDPO details ------------------------------------------------------------------


def test_lm_head_namings_find_the_output_projection(tokenizer):
    from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead

    assert "lm_head" in AutoModelForCausalLMWithValueHead.lm_head_namings
    assert "lm_head" in AutoModelForSeq2SeqLMWithValueHead.lm_head_namings
    model = AutoModelForCausalLMWithValueHead(tiny_causal_lm(tokenizer))
    assert any(hasattr(model.pretrained_model, name) for name in model.lm_head_namings)


def test_ddpo_config_accepts_mixed_precision_none():
    from rlhf_core.ddpo import DDPOConfig

    assert DDPOConfig(mixed_precision=None).mixed_precision == "no"
    with pytest.raises(ValueError, match="mixed_precision"):
        DDPOConfig(mixed_precision="fp8")


# ---- TRL's public paths --------------------------------------------------------------------------


def test_trl_paths_have_rlhf_core_equivalents():
    import rlhf_core
    import rlhf_core.trainer as trainer
    from rlhf_core import models
    from rlhf_core.trainer import dpo_trainer, utils

    assert trainer.SFTConfig is rlhf_core.SFTConfig is SFTConfig
    assert trainer.DPOTrainer is rlhf_core.DPOTrainer and trainer.FDivergenceType is FDivergenceType
    assert trainer.DDPOConfig is rlhf_core.DDPOConfig and trainer.compute_accuracy is rlhf_core.compute_accuracy
    assert dpo_trainer._build_tokenized_answer is _build_tokenized_answer
    assert utils.ConstantLengthDataset is ConstantLengthDataset
    assert models.AutoModelForCausalLMWithValueHead is rlhf_core.AutoModelForCausalLMWithValueHead
    assert models.create_reference_model is rlhf_core.create_reference_model
    assert rlhf_core.is_liger_kernel_available() is False

# Every public name of the trainers, at every TRL path it could be imported from before the trainers moved into
# packages (issue 25; listed from the tree before the move): rlhf_core, rlhf_core.trainer and the trl.trainer
# module mirrors, whose star-imports also carried the names their modules import.
TRL_PATH_NAMES: dict[str, tuple[str, ...]] = {
    "rlhf_core": (
        "ConstantLengthDataset", "DPOConfig", "DPODataCollatorWithPadding", "DPOTrainer",
        "DataCollatorForCompletionOnlyLM", "FDivergenceType", "GRPOConfig", "GRPOTrainer", "KTOConfig",
        "KTOTrainer", "PPOConfig", "PPOTrainer", "RLOOConfig", "RLOOTrainer", "RewardConfig",
        "RewardDataCollatorWithPadding", "RewardTrainer", "SFTConfig", "SFTTrainer", "compute_accuracy",
    ),
    "rlhf_core.trainer": (
        "ConstantLengthDataset", "DPOConfig", "DPODataCollatorWithPadding", "DPOTrainer",
        "DataCollatorForCompletionOnlyLM", "FDivergenceType", "GRPOConfig", "GRPOTrainer", "KTOConfig",
        "KTOTrainer", "PPOConfig", "PPOTrainer", "RLOOConfig", "RLOOTrainer", "RewardConfig",
        "RewardDataCollatorWithPadding", "RewardTrainer", "SFTConfig", "SFTTrainer", "compute_accuracy",
    ),
    "rlhf_core.trainer.dpo_config": (
        "DPOConfig", "FDivergenceType",
    ),
    "rlhf_core.trainer.dpo_trainer": (
        "DPOConfig", "DPODataCollatorWithPadding", "DPOTrainer", "FDivergenceType", "RlhfTrainerMixin",
        "StoredMetricsMixin", "TrackingOptions", "_build_tokenized_answer", "_truncate_tokens", "check_tracking",
        "checked_init_kwargs", "concatenate_pairs", "default_training_args", "disable_dropout_in_model",
        "keyword_defaults", "load_model", "merge_config_fields", "pad_right", "pad_to_length",
        "resolve_processing_class", "response_logprobs", "tokenize_dpo_row", "truncate_prompt_and_responses",
        "wrap_peft",
    ),
    "rlhf_core.trainer.ppo_config": (
        "PPOConfig",
    ),
    "rlhf_core.trainer.ppo_trainer": (
        "Experience", "MasterWeights", "ModelBatch", "PPOConfig", "PPOTrainer", "build_causal_batch",
        "build_seq2seq_batch", "check_generation_lengths", "check_sequence_lengths", "check_step_inputs",
        "generate_batched", "generate_single", "pack_rows", "pad_id_of", "phase_timer", "position_limit",
        "should_pack", "unpack_slots",
    ),
    "rlhf_core.trainer.reward_config": (
        "RewardConfig",
    ),
    "rlhf_core.trainer.reward_trainer": (
        "RewardConfig", "RewardDataCollatorWithPadding", "RewardTrainer", "RlhfTrainerMixin", "TrackingOptions",
        "check_tracking", "compute_accuracy", "default_training_args", "load_model", "prepare_reward_dataset",
        "resolve_processing_class", "tokenize_pair", "wrap_peft",
    ),
    "rlhf_core.trainer.sft_config": (
        "SFTConfig",
    ),
    "rlhf_core.trainer.sft_trainer": (
        "ConstantLengthDataset", "DataCollatorForCompletionOnlyLM", "RlhfTrainerMixin", "SFTConfig", "SFTTrainer",
        "TrackingOptions", "chat_formatting_func", "check_tracking", "checked_init_kwargs",
        "default_training_args", "format_batch", "keyword_defaults", "load_model", "load_tokenizer_for",
        "merge_config_fields", "resolve_processing_class", "tokenize_texts", "wrap_peft",
    ),
    "rlhf_core.trainer.utils": (
        "ConstantLengthDataset", "DPODataCollatorWithPadding", "DataCollatorForCompletionOnlyLM",
        "RewardDataCollatorWithPadding", "check_features", "check_finite_number", "check_margin", "check_mask_row",
        "check_token_row", "pad_to_length",
    ),
}


def test_every_trainer_name_still_imports_from_every_trl_path_as_one_object():
    import importlib

    from rlhf_core._lazy import PUBLIC

    found: dict[str, set[int]] = {}
    for path, names in TRL_PATH_NAMES.items():
        module = importlib.import_module(path)
        for name in names:
            namespace: dict = {}
            exec(f"from {path} import {name}", namespace)  # as a script writes it (lazy packages included)
            value = namespace[name]
            # defined by the trainers, or below them (pad_id_of: the pad-token rules in rlhf_core/models/padding.py)
            assert value.__module__.startswith(("rlhf_core.trainers.", "rlhf_core.models.")), (path, name,
                                                                                            value.__module__)
            found.setdefault(name, set()).add(id(value))
        if hasattr(module, "__all__"):  # ``from rlhf_core import *`` brings them too
            assert set(names) <= set(module.__all__), path
    assert {name for name, ids in found.items() if len(ids) > 1} == set()  # one object whatever the path
    for module, names in PUBLIC.items():  # the lazy table points at modules that define its names
        assert all(hasattr(importlib.import_module(module), name) for name in names), module


def test_the_trl_shim_aliases_rlhf_core_modules():
    """bench/trl_tests/shim: ``trl`` and ``trl.X`` are the rlhf_core module objects themselves."""
    code = (
        "import trl, rlhf_core, rlhf_core.trainers.preference.dpo as d\n"
        "from trl.trainer.dpo_trainer import _build_tokenized_answer\n"
        "from trl.core import masked_mean\n"
        "import trl.trainer.dpo_trainer as t\n"
        "assert trl is rlhf_core and _build_tokenized_answer is d._build_tokenized_answer\n"
        "import rlhf_core.core as c; assert masked_mean is c.masked_mean\n"
        "import rlhf_core.trainer.dpo_trainer as r; assert t is r\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'bench' / 'trl_tests' / 'shim'}{os.pathsep}{REPO}"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


# ---- PEFT reward adapter beside the policy --------------------------------------------------------


def test_reward_adapter_scores_with_the_saved_reward_model(tokenizer, tmp_path):
    """compute_reward_score runs the base model through the frozen reward adapter and its score head: the
    same scores as the saved reward model itself; the policy adapter is active again afterwards."""
    from peft import LoraConfig, get_peft_model

    from rlhf_core.models.tiny import tiny_reward_model
    from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead

    reward = get_peft_model(tiny_reward_model(tokenizer, seed=0),
                            LoraConfig(r=4, lora_alpha=8, task_type="SEQ_CLS", init_lora_weights=False))
    reward.eval()
    reward.save_pretrained(tmp_path / "rm")
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    expected = reward(input_ids=ids).logits  # (2, 1): the score at the last token

    policy = get_peft_model(tiny_causal_lm(tokenizer, seed=0), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(policy, reward_adapter=str(tmp_path / "rm"))
    model.train()
    scores = model.compute_reward_score(ids)  # (2, 4, 1)
    assert scores.shape == (2, 4, 1)
    assert torch.allclose(scores[:, -1, :], expected, atol=1e-5)
    assert model.pretrained_model.active_adapter == "default" and model.pretrained_model.training
    assert not model.score.weight.requires_grad
    assert "score.weight" not in model.state_dict()


def test_reward_adapter_needs_a_peft_policy(tokenizer, tmp_path):
    from rlhf_core.models.value_head import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead

    with pytest.raises(ValueError, match="PEFT policy"):
        AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer), reward_adapter=str(tmp_path))
    with pytest.raises(ValueError, match="supports_rm_adapter=False"):
        AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer), reward_adapter=str(tmp_path))


# ---- smaller TRL 0.11 behaviours ------------------------------------------------------------------


def test_ddpo_trainer_loss_is_the_clipped_surrogate():
    from rlhf_core.ddpo.trainer import DDPOTrainer

    advantages, ratio = torch.tensor([-1.0, 2.0]), torch.tensor([1.0, 1.5])
    # (max(1, 1), max(-3, -2 * 1.2)) = (1, -2.4): mean -0.7
    loss = DDPOTrainer.loss(None, advantages, 0.2, ratio)
    assert loss.item() == pytest.approx(-0.7)


def test_trainers_tag_the_model_and_load_the_tokenizer_from_its_config(tokenizer, tmp_path):
    tiny_causal_lm(tokenizer).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")  # config._name_or_path is that folder
    trainer = SFTTrainer(model=model, args=cpu_args(SFTConfig, tmp_path / "out", dataset_text_field="text"),
                         train_dataset=Dataset.from_dict(TEXTS))
    assert trainer.processing_class.get_vocab() == tokenizer.get_vocab()
    assert trainer.model.model_tags == trainer._tag_names == ["trl", "sft"]


def test_sft_renders_a_conversational_dataset_with_the_chat_template(tokenizer, tmp_path):
    chat = tokenizer.__class__.from_pretrained(_saved(tokenizer, tmp_path))
    chat.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    rows = Dataset.from_dict({"messages": [[{"role": "user", "content": "a good film"}]]})
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=cpu_args(SFTConfig, tmp_path), tokenizer=chat,
                         train_dataset=rows)
    expected = chat("user: a good film\n", add_special_tokens=True)["input_ids"] + [chat.eos_token_id]
    assert trainer.train_dataset[0]["input_ids"] == expected


@pytest.mark.parametrize("column", ["conversations", None])
def test_sft_renders_conversations_and_prompt_completion_rows_with_the_chat_template(column, tokenizer, tmp_path):
    # TRL 0.11's get_formatting_func_from_dataset: a `conversations` column like `messages`; an instruction dataset
    # (exactly prompt and completion) as a user turn and the assistant's answer
    chat = tokenizer.__class__.from_pretrained(_saved(tokenizer, tmp_path))
    chat.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"  # + needs str
    answers = ["yes", "no, a dull one"]
    turns = [[{"role": "user", "content": "a good film"}, {"role": "assistant", "content": a}] for a in answers]
    rows = Dataset.from_dict({column: turns} if column else {"prompt": ["a good film"] * 2, "completion": answers})
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=cpu_args(SFTConfig, tmp_path), tokenizer=chat,
                         train_dataset=rows)
    for row, answer in zip(trainer.train_dataset, answers):
        text = f"user: a good film\nassistant: {answer}\n"
        assert row["input_ids"] == chat(text, add_special_tokens=True)["input_ids"] + [chat.eos_token_id]


def _saved(tokenizer, tmp_path) -> str:
    """A copy of the session tokenizer on disk (so a test can change it freely)."""
    tokenizer.save_pretrained(tmp_path / "tok")
    return str(tmp_path / "tok")


# ---- the tracking keywords every Trainer-based trainer takes ----------------------------------------


@pytest.mark.parametrize("name", ["SFTTrainer", "RewardTrainer", "DPOTrainer", "KTOTrainer", "GRPOTrainer",
                                  "RLOOTrainer"])
def test_a_misspelt_tracking_keyword_is_refused_before_anything_loads(name):
    """``**tracking`` (rlhf_core.trainers.base.TrackingOptions) names the bad key, before a model is loaded."""
    import rlhf_core

    with pytest.raises(TypeError, match=rf"{name}\(\) got unexpected keyword argument\(s\) 'log_wiht'"):
        getattr(rlhf_core, name)("no/such/model", log_wiht="memory")
