"""The input checks of ``PPOTrainer.step`` (and ``generate``): bad input gets a ``ValueError`` naming the argument
and index, before any weight, optimizer state or KL coefficient changes.

Pure functions of the inputs plus the few model facts they need (vocabulary size, position limit, whether the
model is an encoder-decoder); the trainer looks those up once per step.
"""

from __future__ import annotations

import numpy as np
import torch

from rlhf_core.core import MAX_ABS_REWARD

_TOKEN_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)

MAX_ABS_SCORE = MAX_ABS_REWARD
"""Largest accepted ``|score|``: the one reward bound of every trainer (``rlhf_core.core.MAX_ABS_REWARD``)."""


def check_step_inputs(batch_size: int, queries, responses, scores, response_masks=None, *, vocab: int | None,
                      device, is_encoder_decoder: bool = False):
    """Check the step inputs and move them to ``device``: (queries, responses, scores (B,), response_masks).

    Accepted as classic TRL accepts them: lists (or tuples) of 1-d token tensors; scores as numbers, 0-d or
    one-element 1-d tensors (``requires_grad`` is dropped: a score is a constant of the update).
    """
    for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{name} must be a list of tensors, got {type(value).__name__}")
        if len(value) != batch_size:
            raise ValueError(f"Batch size ({batch_size}) does not match number of examples - but got {len(value)} for: {name}")
    if response_masks is not None and len(response_masks) != batch_size:
        raise ValueError(f"response_masks has {len(response_masks)} entries, expected batch_size={batch_size}")
    for name, value in (("queries", queries), ("responses", responses), ("scores", scores)):
        check_movable(value, name, device)
    queries = [check_token_tensor(q, "queries", i, vocab, is_encoder_decoder).to(device) for i, q in enumerate(queries)]
    responses = [check_token_tensor(r, "responses", i, vocab, is_encoder_decoder).to(device) for i, r in enumerate(responses)]
    scores = torch.stack([check_score(s, i) for i, s in enumerate(scores)]).to(device)  # (B,)
    if response_masks is not None:
        response_masks = [check_response_mask(m, r, i).to(device) for i, (m, r) in enumerate(zip(response_masks, responses))]
    return queries, responses, scores, response_masks


def check_movable(tensors, name: str, device) -> None:
    """Tensors on another device than the model's are moved there (as classic TRL does); a tensor on the ``meta``
    device holds no values to move, so it is refused naming the argument, the index and both devices."""
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            raise ValueError(f"{name}[{i}] is on device meta, the model on {torch.device(device)}: a meta tensor holds "
                             "no values to move; pass tensors with data (any other device is moved to the model's)")


def check_token_tensor(tensor, name: str, i: int, vocab: int | None, is_encoder_decoder: bool = False) -> torch.Tensor:
    """One query or response: a non-empty 1-d integer tensor of ids in ``[0, vocab)``; returned as long."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}[{i}] must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{name}[{i}] must be 1-d (seq_len,), got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _TOKEN_DTYPES:
        raise ValueError(f"{name}[{i}] must hold integer token ids, got dtype {tensor.dtype}")
    min_len = 2 if (name == "responses" and is_encoder_decoder) else 1
    if len(tensor) < min_len:
        raise ValueError(f"{name}[{i}] is empty: every query and response needs at least one token")
    if vocab is not None and (int(tensor.min()) < 0 or int(tensor.max()) >= vocab):
        raise ValueError(f"{name}[{i}] holds token ids outside [0, {vocab})")
    return tensor.long()


def check_score(score, i: int) -> torch.Tensor:
    """One score: a finite number, 0-d or one-element 1-d tensor; returned as a detached float 0-d tensor."""
    if not isinstance(score, (torch.Tensor, int, float, np.number)) or isinstance(score, bool):
        raise ValueError(f"scores[{i}] must be a number or a scalar tensor, got {type(score).__name__}")
    score = torch.as_tensor(score) if not isinstance(score, torch.Tensor) else score.detach()
    if score.dim() > 1 or score.numel() != 1:
        raise ValueError(f"scores[{i}] must be a scalar (0-d or one-element 1-d tensor), got shape {tuple(score.shape)}")
    if not torch.is_floating_point(score) and score.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"scores[{i}] must be numeric, got dtype {score.dtype}")
    score = score.reshape(()).float()
    if not torch.isfinite(score):
        raise ValueError(f"scores[{i}] is not finite ({float(score)}): fix the reward function before stepping")
    if abs(float(score)) > MAX_ABS_SCORE:
        raise ValueError(f"scores[{i}] is {float(score):.6g}, beyond the bound |score| <= {MAX_ABS_SCORE:.0e} "
                         "(PPO squares rewards and would overflow float32): rescale the reward before stepping")
    return score


def check_response_mask(mask, response: torch.Tensor, i: int) -> torch.Tensor:
    """One response mask: shaped like its response, only 0s and 1s, at least one 1."""
    if not isinstance(mask, torch.Tensor) or mask.shape != response.shape:
        raise ValueError(f"response_masks[{i}] must be a tensor shaped like responses[{i}] {tuple(response.shape)}")
    values = mask.detach().float()
    bad = ~((values == 0) | (values == 1))  # NaN compares false to both
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise ValueError(f"response_masks[{i}][{j}] is {float(values[j])}: a response mask holds only 0 and 1")
    if not bool(values.any()):
        raise ValueError(f"response_masks[{i}] is all zeros: at least one response token must be trained on")
    return mask.detach()


def position_limit(pretrained_model) -> int | None:
    """The model's maximum number of positions (``n_positions`` / ``max_position_embeddings``), if it has one."""
    config = getattr(pretrained_model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_sequence_lengths(queries, responses, limit: int | None, is_encoder_decoder: bool = False) -> None:
    """Raise ``ValueError`` when a query + response (or either, for an encoder-decoder) exceeds ``limit``."""
    if limit is None:
        return
    for i, (query, response) in enumerate(zip(queries, responses)):
        lengths = (len(query), len(response)) if is_encoder_decoder else (len(query) + len(response),)
        if max(lengths) > limit:
            raise ValueError(f"queries[{i}] + responses[{i}] ({len(query)} + {len(response)} tokens) are longer "
                             f"than the model's {limit} positions: truncate the query or lower max_new_tokens")


def check_generation_lengths(queries, max_new_tokens: int | None, limit: int | None,
                             is_encoder_decoder: bool = False) -> None:
    """Raise ``ValueError`` when a query plus ``max_new_tokens`` cannot fit in the model's ``limit`` positions."""
    if limit is None:
        return
    new = int(max_new_tokens or 0)
    for i, query in enumerate(queries):
        needed = max(len(query), new) if is_encoder_decoder else len(query) + new
        if needed > limit:
            raise ValueError(f"query_tensor[{i}] ({len(query)} tokens) + max_new_tokens ({new}) is longer than the "
                             f"model's {limit} positions: truncate the query or lower max_new_tokens")


NOT_TENSOR_HINT = ("a datasets.Dataset gives its columns as Python lists unless it was given "
                   "dataset.set_format(type='torch') (TRL's examples call it after tokenising); or pass torch.tensor(ids)")


def check_generate_queries(query_tensor) -> None:
    """``generate``'s queries are a 1-d token tensor or a list of them; anything else (lists of ints from a dataset
    never set to torch format) is refused here, by index, instead of failing inside the model's ``generate``."""
    if isinstance(query_tensor, torch.Tensor):
        return
    if not isinstance(query_tensor, (list, tuple)):
        raise ValueError(f"generate: query_tensor must be a 1-d torch.Tensor or a list of them, got "
                         f"{type(query_tensor).__name__}; {NOT_TENSOR_HINT}")
    for i, query in enumerate(query_tensor):
        if not isinstance(query, torch.Tensor):
            raise ValueError(f"generate: query_tensor[{i}] is a {type(query).__name__}, not a 1-d torch.Tensor; "
                             f"{NOT_TENSOR_HINT}")
        if query.dim() != 1:
            raise ValueError(f"generate: query_tensor[{i}] must be 1-d (seq_len,), got shape {tuple(query.shape)}")
