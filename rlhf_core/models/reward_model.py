"""Scalar rewards from a sequence-classification reward model, read at each sequence's last real token."""

from __future__ import annotations

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from rlhf_core.core import gather_last_token, position_ids_from_attention_mask
from rlhf_core.models.peft_support import is_peft_model


def sequence_rewards(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Reward (B,) of each sequence: the first output of ``sequence_scores``."""
    return sequence_scores(model, input_ids, attention_mask)[:, 0]  # (B,)


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scores (B, K) of each sequence (K = ``config.num_labels``): the score head at its last real token,
    whatever the padding side.

    Sequence classifiers with a token-level ``score`` head (GPT-2, Llama, ...) are run as backbone + head so
    the score is read with ``gather_last_token``; other models fall back to their pooled logits (B, K).

    ``model`` may be a parallel wrapper (DDP, FSDP, DeepSpeed: what ``Trainer`` hands ``compute_loss`` under
    ``accelerate launch``). Calling its submodules directly would bypass the wrapper's forward (no gradient
    sync), and treating the wrapper as a plain model would take the pooled-logits fallback (another reward
    with left padding). So the wrapper's own forward runs, with the same position ids, and the head's token
    scores are captured with a forward hook: the same rewards as the unwrapped model.
    """
    unwrapped = extract_model_from_parallel(model)
    inner = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
    backbone = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    head = getattr(inner, "score", None)
    if backbone is None or head is None or backbone is inner:
        return model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, K)
    position_ids = position_ids_from_attention_mask(attention_mask)  # (B, T)
    if unwrapped is model:
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        token_scores = head(hidden.last_hidden_state)  # (B, T, K)
    else:  # wrapped: the full forward through the wrapper (needs config.pad_token_id for B > 1, like any HF classifier)
        captured: list[torch.Tensor] = []
        handle = head.register_forward_hook(lambda _module, _args, output: captured.append(output))
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        finally:
            handle.remove()
        token_scores = captured[-1]  # (B, T, K)
    return gather_last_token(token_scores, attention_mask)  # (B, K)

