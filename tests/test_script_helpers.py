"""TRL's script helper layer at TRL's paths: TrlParser (YAML + CLI, legacy transformers options), ModelConfig,
the PEFT / quantization / device-map helpers, script arguments, dataset mixtures and setup_chat_format."""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest

from rlhf_core import ModelConfig, ScriptArguments, SFTConfig, TrlParser
from rlhf_core.scripts import legacy_args, model_helpers
from rlhf_core.scripts.dataset_mixture import DatasetConfig, DatasetMixtureConfig, get_dataset, mixture_sizes


@pytest.mark.parametrize("path, names", [
    ("rlhf_core", ["ModelConfig", "TrlParser", "get_peft_config", "get_quantization_config", "get_kbit_device_map",
                   "ScriptArguments", "DatasetMixtureConfig", "get_dataset", "setup_chat_format",
                   "SFTScriptArguments", "DPOScriptArguments", "init_zero_verbose"]),
    ("rlhf_core.commands.cli_utils", ["TrlParser", "SFTScriptArguments", "DPOScriptArguments",
                                      "RewardScriptArguments", "init_zero_verbose"]),
    ("rlhf_core.trainer.utils", ["SIMPLE_CHAT_TEMPLATE", "SIMPLE_SFT_CHAT_TEMPLATE", "SIMPLE_QUERY_CHAT_TEMPLATE",
                                 "get_peft_config", "get_quantization_config", "get_kbit_device_map"]),
    ("rlhf_core.trainer.model_config", ["ModelConfig"]),
    ("rlhf_core.trainer", ["ModelConfig", "get_peft_config"]),
    ("rlhf_core.scripts.utils", ["TrlParser", "ScriptArguments", "DatasetConfig", "DatasetMixtureConfig",
                                 "get_dataset"]),
    ("rlhf_core.models.utils", ["setup_chat_format", "SUPPORTED_ARCHITECTURES"]),
])
def test_helpers_importable_at_trl_paths(path, names):
    module = importlib.import_module(path)
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{path} lacks {missing}"
    # one object under every path, not copies
    assert getattr(importlib.import_module("rlhf_core.scripts"), "TrlParser") is TrlParser


def test_trl_parser_yaml_then_cli(tmp_path, monkeypatch):
    """defaults < YAML < command line; `env:` goes to the environment; both constructor forms."""
    monkeypatch.delenv("RLHF_TEST_VAR", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text("env:\n  RLHF_TEST_VAR: hello\nmodel_name_or_path: from-yaml\nlora_r: 4\n"
                      "dataset_name: yaml-ds\nlearning_rate: 0.5\n")
    parser = TrlParser(dataclass_types=[ScriptArguments, SFTConfig, ModelConfig])
    script, training, model = parser.parse_args_and_config(
        ["--config", str(config), "--output_dir", str(tmp_path / "o"), "--lora_r", "8"])
    assert (model.model_name_or_path, model.lora_r, model.lora_alpha) == ("from-yaml", 8, 32)
    assert script.dataset_name == "yaml-ds" and training.learning_rate == 0.5
    assert os.environ["RLHF_TEST_VAR"] == "hello"
    # TRL 0.11's form reads sys.argv
    monkeypatch.setattr(sys, "argv", ["x.py", "--config", str(config), "--output_dir", str(tmp_path / "o")])
    from rlhf_core.commands.cli_utils import SFTScriptArguments

    script, training, model = TrlParser((SFTScriptArguments, SFTConfig, ModelConfig)).parse_args_and_config()
    assert model.lora_r == 4 and script.dataset_name == "yaml-ds"
    assert training.gradient_checkpointing_kwargs == {"use_reentrant": False}  # TRL 0.11's post-processing


def test_trl_parser_refuses_unknown_yaml_keys(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: m\nnot_an_option: 1\n")
    with pytest.raises(ValueError, match="not_an_option"):
        TrlParser([ModelConfig]).parse_args_and_config(["--config", str(config)])
    model, rest = TrlParser([ModelConfig]).parse_args_and_config(["--config", str(config)],
                                                                 return_remaining_strings=True)
    assert model.model_name_or_path == "m" and rest == ["--not_an_option", "1"]


def test_legacy_transformers_options_mapped_with_a_warning(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("evaluation_strategy: steps\neval_steps: 3\n")
    with pytest.warns(FutureWarning, match="warmup_ratio.*warmup_steps"):
        (training,) = TrlParser([SFTConfig]).parse_args_and_config(
            ["--config", str(config), "--output_dir", str(tmp_path), "--warmup_ratio=0.25", "--no_cuda",
             "--group_by_length", "--overwrite_output_dir"])
    assert training.warmup_steps == 0.25 and training.use_cpu is True
    assert training.eval_strategy == "steps" and training.train_sampling_strategy == "group_by_length"


def test_legacy_option_without_mapping_says_what_to_write():
    with pytest.raises(ValueError, match="split_batches.*accelerator_config"):
        legacy_args.map_argv(["--split_batches", "True"], known=set())
    # a script's own field of that name is left alone
    assert legacy_args.map_argv(["--warmup_ratio", "0.1"], known={"warmup_ratio"}) == ["--warmup_ratio", "0.1"]


def test_model_config_fields_and_rules():
    config = ModelConfig(model_name_or_path="m", torch_dtype="float32", lora_target_modules=["c_attn"])
    assert config.dtype == "float32" and config.lora_target_modules == "c_attn"  # one-element list unwrapped
    assert ModelConfig(dtype="bfloat16").torch_dtype == "bfloat16"
    with pytest.raises(ValueError, match="load_in_8bit and load_in_4bit"):
        ModelConfig(load_in_8bit=True, load_in_4bit=True)
    with pytest.raises(ValueError, match="torch_dtype='float32' and dtype='bfloat16'"):
        ModelConfig(torch_dtype="float32", dtype="bfloat16")


def test_get_peft_config_builds_the_lora_config():
    from peft import LoraConfig

    assert model_helpers.get_peft_config(ModelConfig()) is None
    lora = model_helpers.get_peft_config(ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                                     lora_target_modules=["c_attn", "c_proj"], use_rslora=True,
                                                     lora_task_type="SEQ_CLS", lora_modules_to_save=["score"]))
    assert isinstance(lora, LoraConfig)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, lora.bias, lora.task_type) == (4, 8, 0.0, "none", "SEQ_CLS")
    assert set(lora.target_modules) == {"c_attn", "c_proj"} and lora.use_rslora and lora.modules_to_save == ["score"]


def test_get_quantization_config(monkeypatch):
    from transformers import BitsAndBytesConfig

    assert model_helpers.get_quantization_config(ModelConfig()) is None
    monkeypatch.setattr(model_helpers, "is_bitsandbytes_available", lambda: False)
    with pytest.raises(ValueError, match="--load_in_4bit.*bitsandbytes"):
        model_helpers.get_quantization_config(ModelConfig(load_in_4bit=True))
    monkeypatch.setattr(model_helpers, "is_bitsandbytes_available", lambda: True)
    four = model_helpers.get_quantization_config(ModelConfig(load_in_4bit=True, dtype="bfloat16",
                                                             use_bnb_nested_quant=True, bnb_4bit_quant_type="fp4"))
    assert isinstance(four, BitsAndBytesConfig) and four.load_in_4bit and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_quant_type == "fp4" and str(four.bnb_4bit_compute_dtype) == "torch.bfloat16"
    assert model_helpers.get_quantization_config(ModelConfig(load_in_8bit=True)).load_in_8bit


def test_get_kbit_device_map_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert model_helpers.get_kbit_device_map() is None


def test_dataset_mixture(tmp_path):
    for name, n in (("a", 6), ("b", 2)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i}", "x": i}) + "\n"
                                                        for i in range(n)))
    mixture = DatasetMixtureConfig(datasets=[
        {"path": "json", "data_files": str(tmp_path / "a.jsonl"), "columns": ["text"], "fraction": 0.5},
        DatasetConfig(path="json", data_files=str(tmp_path / "b.jsonl"), columns=["text"], fraction=0.5)])
    train = get_dataset(mixture)["train"]
    # equal shares, b has 2 rows: 2 + 2, nothing repeated
    assert train["text"] == ["a0", "a1", "b0", "b1"] and train.column_names == ["text"]
    assert mixture_sizes([6, 2], [3.0, 1.0]) == [6, 2] and mixture_sizes([6, 6], [1.0, 1.0]) == [6, 6]
    with pytest.raises(ValueError, match="every dataset or on none"):
        DatasetMixtureConfig(datasets=[{"path": "json", "fraction": 0.5}, {"path": "json"}])


def test_setup_chat_format(tokenizer):
    from rlhf_core import setup_chat_format
    from rlhf_core.models.tiny import tiny_causal_lm

    model = tiny_causal_lm(tokenizer)
    tokenizer.chat_template = None
    before = len(tokenizer)
    model, tokenizer = setup_chat_format(model, tokenizer, resize_to_multiple_of=8)
    assert len(tokenizer) == before + 2 and model.get_input_embeddings().weight.shape[0] % 8 == 0
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="already has a chat template"):
        setup_chat_format(model, tokenizer)


def test_trust_remote_code_in_both_eras(tmp_path):
    """TRL 0.11's ModelConfig and TRL 1.x's trainer configs both carry trust_remote_code: one option fills both,
    and transformers' own parser takes the pair as TRL 0.11's kto.py builds it."""
    from transformers import HfArgumentParser

    from rlhf_core import KTOConfig

    training, model = TrlParser([KTOConfig, ModelConfig]).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--trust_remote_code", "--model_name_or_path", "m"])
    assert training.trust_remote_code is True and model.trust_remote_code is True
    # TRL 0.11 scripts pair ModelConfig with configs that lack the option: the parser declares it for them
    (training, model) = TrlParser([SFTConfig, ModelConfig]).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--trust_remote_code", "true"])
    assert model.trust_remote_code is True
    assert TrlParser([ModelConfig]).parse_args_and_config([])[0].trust_remote_code is False
    HfArgumentParser((KTOConfig, ModelConfig))  # no conflicting --trust_remote_code
    assert ModelConfig(trust_remote_code=True).trust_remote_code is True and not ModelConfig().trust_remote_code


def test_extras_dataset_formatting(tokenizer):
    from datasets import Dataset

    from rlhf_core.extras.dataset_formatting import (conversations_formatting_function,
                                                     get_formatting_func_from_dataset)
    from rlhf_core.models.chat_format import SIMPLE_CHAT_TEMPLATE

    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    render = conversations_formatting_function(tokenizer, "messages")
    assert render({"messages": chat}) == "User: hi\n\nAssistant: yo\n\n"
    assert render({"messages": [chat, chat[:1]]}) == ["User: hi\n\nAssistant: yo\n\n", "User: hi\n\n"]
    pairs = Dataset.from_dict({"prompt": ["hi"], "completion": ["yo"]})
    assert get_formatting_func_from_dataset(pairs, tokenizer)(pairs[0]) == "User: hi\n\nAssistant: yo\n\n"
    assert get_formatting_func_from_dataset(Dataset.from_dict({"text": ["a"]}), tokenizer) is None
