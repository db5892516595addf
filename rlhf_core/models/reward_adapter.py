"""A PEFT reward adapter beside the policy adapter (TRL 0.11's ``reward_adapter=``).

One base model carries two LoRA adapters: the trainable policy adapter and a frozen reward-model adapter
saved from a ``PeftModel`` of a sequence classifier (``task_type="SEQ_CLS"``), whose file also holds the
classifier's ``score`` head. Scoring switches the base model to the reward adapter, reads the last hidden
state through that head, and switches back: a reward model that costs no second copy of the base weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

# Name fragments of a sequence classifier's head inside a saved adapter.
SCORE_MODULE_NAMES = ("score", "classifier")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def read_adapter_state(adapter_dir: str) -> dict[str, torch.Tensor]:
    """The tensors of a local adapter checkpoint (safetensors, else a ``.bin`` read with ``weights_only``)."""
    for filename in ADAPTER_WEIGHT_FILES:
        path = os.path.join(adapter_dir, filename)
        if not os.path.isfile(path):
            continue
        if filename.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"reward_adapter={adapter_dir!r}: no {' or '.join(ADAPTER_WEIGHT_FILES)} in that folder")


def score_head_from_adapter(state: dict[str, torch.Tensor], source: str) -> nn.Linear:
    """The reward head (K outputs) stored in an adapter checkpoint, as a frozen ``nn.Linear(H, K)``."""
    for module in SCORE_MODULE_NAMES:
        tensors = {key.rsplit(".", 1)[-1]: value for key, value in state.items() if f".{module}." in f".{key}"}
        if "weight" in tensors:
            break
    else:
        raise ValueError(f"reward_adapter={source!r} holds no score head ({' / '.join(SCORE_MODULE_NAMES)} weights)")
    num_labels, hidden = tensors["weight"].shape  # (K, H)
    head = nn.Linear(hidden, num_labels, bias="bias" in tensors)
    head.load_state_dict(tensors)
    head.requires_grad_(False)
    return head


def load_reward_adapter(peft_model: Any, adapter_dir: str, adapter_name: str) -> nn.Linear:
    """Add ``adapter_dir`` to ``peft_model`` as a frozen adapter ``adapter_name``; return its score head."""
    if not os.path.isdir(adapter_dir):
        raise ValueError(f"reward_adapter={adapter_dir!r} must be a local folder saved by PeftModel.save_pretrained")
    peft_model.load_adapter(adapter_dir, adapter_name, is_trainable=False)
    head = score_head_from_adapter(read_adapter_state(adapter_dir), adapter_dir)
    return head.to(next(peft_model.parameters()).device)
