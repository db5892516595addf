"""Turn a ``ModelConfig`` into what ``from_pretrained`` and the trainers take: a peft ``LoraConfig``, a
bitsandbytes ``BitsAndBytesConfig`` and the k-bit device map (``trl.get_peft_config`` and friends)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from rlhf_core.import_utils import is_peft_available
from rlhf_core.scripts.model_config import ModelConfig


def get_peft_config(model_config: ModelConfig) -> Any:
    """The ``peft.LoraConfig`` the options describe, or None without ``use_peft``."""
    if not model_config.use_peft:
        return None
    if not is_peft_available():
        raise ValueError("use_peft=True needs the peft package: pip install peft")
    from peft import LoraConfig  # optional dependency, only when an adapter is asked for

    return LoraConfig(
        task_type=model_config.lora_task_type, r=model_config.lora_r, lora_alpha=model_config.lora_alpha,
        lora_dropout=model_config.lora_dropout, target_modules=model_config.lora_target_modules,
        target_parameters=model_config.lora_target_parameters, modules_to_save=model_config.lora_modules_to_save,
        bias="none", use_rslora=model_config.use_rslora, use_dora=model_config.use_dora)


def is_bitsandbytes_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


def get_quantization_config(model_config: ModelConfig) -> Any:
    """The ``BitsAndBytesConfig`` for ``load_in_4bit`` / ``load_in_8bit``, or None when neither is set.

    Without the bitsandbytes package this refuses by name (transformers would fail later, inside
    ``from_pretrained``, with no word of which option asked for it)."""
    option = "load_in_4bit" if model_config.load_in_4bit else "load_in_8bit" if model_config.load_in_8bit else None
    if option is None:
        return None
    if not is_bitsandbytes_available():
        raise ValueError(f"--{option} quantizes the base model with bitsandbytes, which is not installed "
                         f"(pip install bitsandbytes; it needs a CUDA GPU); drop --{option} to train unquantized")
    from transformers import BitsAndBytesConfig  # heavy; only when quantization is asked for

    if option == "load_in_8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    # the compute dtype follows the load dtype, as TRL does, so the dequantized GEMMs match the weights
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=model_config.dtype,
        bnb_4bit_quant_type=model_config.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_config.use_bnb_nested_quant,
        bnb_4bit_quant_storage=model_config.bnb_4bit_quant_storage or model_config.dtype)


def get_kbit_device_map() -> dict[str, Any] | None:
    """Place a quantized model whole on this process's accelerator (``{"": index}``); None on a CPU."""
    from accelerate import PartialState  # heavy; only when a quantized model is placed

    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return {"": f"xpu:{PartialState().local_process_index}"}
    if torch.cuda.is_available():
        return {"": PartialState().local_process_index}
    return None
