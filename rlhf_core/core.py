"""Pure tensor helpers: the classic ``trl.core`` surface, plus the shared sequence helpers.

Every function here is pure: tensors in, tensors out, no config objects, no I/O, no ``.item()``,
no in-place edits of inputs. Shapes: ``B`` batch, ``T`` sequence, ``A`` response tokens, ``V`` vocab.
Masks are 1 for a real token and 0 for padding.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

# Value used to pad ragged stats when they are stacked (classic TRL uses the same sentinel).
WANDB_PADDING = -1

MAX_ABS_REWARD = 1e6
"""Largest accepted ``|reward|`` (PPO's scores, GRPO's and RLOO's rewards). Every trainer squares its rewards (PPO's
score scaling, whitening, value loss and gradient norm; the group statistics and loss of GRPO and RLOO): a finite
reward of 3e38 overflowed float32 and every update was skipped as non-finite. A million keeps those squares far
below float32's 3.4e38 while leaving room for any reward scale in use (reward models give single digits); rescale a
larger reward before training."""


# --------------------------------------------------------------------------------------------
# log-probabilities and entropy
# --------------------------------------------------------------------------------------------


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor | None, gather: bool = True) -> torch.Tensor:
    """Log-probabilities of ``labels`` under ``logits`` (B, T, V) -> (B, T), in fp32 (fp64 stays fp64).

    With ``gather=False`` the full log-softmax (B, T, V) is returned and ``labels`` is ignored.
    """
    logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (B, T, V), >= fp32
    if not gather:
        return logp
    return torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits`` (..., V) -> (...), in fp32.

    H = log s - sum_v e_v x_v / s with x = logits - max, e = exp(x), s = sum_v e_v: the same quantity as
    TRL's ``logsumexp(l) - sum(softmax(l) * l)``, with one exp pass instead of two (a third faster on a (b, A, V)
    PPO mini-batch) and no cancellation between two terms of the logits' magnitude (tests/test_core.py).
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., V), <= 0
    exp = shifted.exp()
    total = exp.sum(dim=-1)  # (...), >= 1
    return total.log() - (exp * shifted).sum(dim=-1) / total


# Most bytes of fp32 logits one chunk of ``token_logprobs``/``rowwise_logit_stats`` holds (256 MiB): a GPT-2-vocabulary
# row is 0.2 MB, a Qwen2 one 0.6 MB, so a chunk is ~400-1300 rows: few kernel launches, and never the whole (N, V)
# in fp32 (Qwen2-0.5B's 64 x 256 response tokens would be 10 GB).
LOGIT_CHUNK_BYTES = 2**28


def logit_chunk_rows(vocab: int, chunk_bytes: int | None = None) -> int:
    """Rows of fp32 logits of width ``vocab`` that fit in ``chunk_bytes`` (default ``LOGIT_CHUNK_BYTES``; at least one)."""
    return max(1, (chunk_bytes or LOGIT_CHUNK_BYTES) // (4 * max(vocab, 1)))


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits[rows])[tokens]`` chunk by chunk; the backward recomputes each chunk's log-softmax.

    Only the logits (in their own dtype, already held for the LM head's backward) and the index tensors are
    saved: the fp32 log-softmax of every row, which autograd would save, never exists at once. Each chunk runs
    the same kernels as the unchunked ops (``log_softmax`` on the upcast rows, the gather's ``scatter_add`` into
    zeros, ``_log_softmax_backward_data``, the cast back), row by row on the same values, so the results are
    the same numbers as ``logprobs_from_logits`` on the gathered rows, bit for bit (tests/test_core.py).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = logits.new_empty(rows.shape, dtype=dtype)  # (M,)
        for start in range(0, rows.shape[0], chunk_rows):
            end = start + chunk_rows
            logp = F.log_softmax(logits.index_select(0, rows[start:end]).to(dtype), dim=-1)  # (c, V)
            out[start:end] = logp.gather(-1, tokens[start:end, None])[:, 0]
        ctx.save_for_backward(logits, rows, tokens)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, rows, tokens = ctx.saved_tensors
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad_logits = torch.zeros_like(logits)  # (N, V): rows never scored get no gradient
        for start in range(0, rows.shape[0], ctx.chunk_rows):
            end = start + ctx.chunk_rows
            index = rows[start:end]
            logp = F.log_softmax(logits.index_select(0, index).to(dtype), dim=-1)  # (c, V), recomputed
            grad_logp = torch.zeros_like(logp).scatter_add_(-1, tokens[start:end, None], grad[start:end, None])
            grad_rows = torch._log_softmax_backward_data(grad_logp, logp, -1, dtype)  # (c, V)
            grad_logits.index_add_(0, index, grad_rows.to(logits.dtype))
        return grad_logits, None, None, None


def token_logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                   chunk_rows: int | None = None) -> torch.Tensor:
    """Log-prob of ``tokens`` (M,) under the rows ``rows`` (M,) of ``logits`` (N, V) -> (M,), in fp32 (fp64 stays).

    The same numbers as ``logprobs_from_logits(logits[rows], tokens)``, computed ``chunk_rows`` rows at a time
    (default: ``logit_chunk_rows(V)``) in the forward and the backward, so bf16 logits are never copied to fp32
    whole. A row may be listed more than once: its gradients add up (in the logits' dtype; a padding slot that
    repeats a row with no gradient, as the trainers' do, leaves the sum exact).
    """
    return _TokenLogprobs.apply(logits, rows, tokens, chunk_rows or logit_chunk_rows(logits.shape[-1]))


@torch.no_grad()
def rowwise_logit_stats(logits: torch.Tensor, rows: torch.Tensor, entropy: bool = True, mean: bool = False,
                        chunk_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Detached fp32 statistics of the rows ``rows`` (M,) of ``logits`` (N, V), chunk by chunk: ``entropy`` (M,)
    (``entropy_from_logits``) and the ``mean`` logit over the vocabulary (M,), each when asked."""
    chunk_rows = chunk_rows or logit_chunk_rows(logits.shape[-1])
    dtype = torch.promote_types(logits.dtype, torch.float32)
    names = [name for name, wanted in (("entropy", entropy), ("mean", mean)) if wanted]
    out = {name: logits.new_empty(rows.shape, dtype=dtype) for name in names}
    for start in range(0, rows.shape[0], chunk_rows):
        chunk = logits.index_select(0, rows[start:start + chunk_rows])  # (c, V) in the logits' dtype
        if entropy:
            out["entropy"][start:start + chunk_rows] = entropy_from_logits(chunk)
        if mean:
            out["mean"][start:start + chunk_rows] = chunk.to(dtype).mean(-1)
    return out


def shifted_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each token given its prefix: logits (B, T, V), ids (B, T) -> (B, T-1).

    Position ``t`` of the result scores token ``t+1``: the causal-LM shift written once.
    """
    return logprobs_from_logits(logits[:, :-1, :], input_ids[:, 1:])  # (B, T-1)


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Sum (or mean) of per-token log-probs over the masked tokens: (B, A), (B, A) -> (B,).

    The one helper for "log-probability of a response" (DPO, evaluation, PPO stats).
    """
    mask = mask.to(token_logprobs.dtype)
    total = (token_logprobs * mask).sum(-1)  # (B,)
    if average:
        return total / mask.sum(-1).clamp(min=1)
    return total


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real (mask = 1) token in each row, whatever the padding side: (B, T) -> (B,).

    Rows with no real token get index 0.
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)  # (T,)
    return (attention_mask.bool() * positions).amax(dim=-1)  # (B,)


def gather_last_token(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The value at the last real token of each row: values (B, T) or (B, T, H), mask (B, T) -> (B,) or (B, H).

    The one helper for "the score at the last real token" (reward models, PPO's score placement).
    """
    index = last_token_index(attention_mask)  # (B,)
    rows = torch.arange(values.shape[0], device=values.device)
    return values[rows, index]


def position_ids_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count only real tokens, so left padding does not shift positions: (B, T) -> (B, T)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.clamp(min=0)


# --------------------------------------------------------------------------------------------
# masked statistics
# --------------------------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (all of them, or along ``axis``)."""
    mask = mask.to(values.dtype)
    if axis is not None:
        return (values * mask).sum(dim=axis) / mask.sum(dim=axis)
    return (values * mask).sum() / mask.sum()


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, check: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions; Bessel-corrected when ``unbiased``.

    An all-zero mask raises ``ValueError`` (classic TRL), which reads the mask on the host; ``check=False``
    returns NaN for it instead, for loops that must not wait for the device.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if check and count == 0:
            raise ValueError("masked_var got an all-zero mask: there is no value to take the variance of")
        # With a single value the spread is 0; Bessel's factor would divide by zero, so keep 0.
        variance = torch.where(count > 1, variance * (count / (count - 1)), variance)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``values`` with the mean and (unbiased) variance of its masked positions."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Standardise ``values`` with its mean and unbiased variance."""
    mean, var = torch.mean(values), torch.var(values)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor | float, tensor_max: torch.Tensor | float) -> torch.Tensor:
    """Element-wise clip of ``x`` to ``[tensor_min, tensor_max]`` (bounds may be tensors)."""
    tensor_min = torch.as_tensor(tensor_min, dtype=x.dtype, device=x.device)
    tensor_max = torch.as_tensor(tensor_max, dtype=x.dtype, device=x.device)
    return torch.max(torch.min(x, tensor_max), tensor_min)


# --------------------------------------------------------------------------------------------
# stats dictionaries
# --------------------------------------------------------------------------------------------


def flatten_dict(nested: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """Flatten nested dicts: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            name = f"{prefix}{sep}{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(name, value)
            else:
                flat[name] = value

    walk("", nested)
    return flat


def stack_dicts(stats_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of stats dicts key by key into (N, ...) tensors, padding ragged entries."""
    results = {}
    for key in stats_dicts[0]:
        rows = [torch.flatten(torch.as_tensor(d[key])) for d in stats_dicts]
        results[key] = pad_sequence(rows, batch_first=True, padding_value=WANDB_PADDING)
    return results


def stats_to_np(stats_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Detach tensors to numpy arrays (bf16 upcast to fp32); Python/NumPy scalars become floats."""
    converted: dict[str, Any] = {}
    for key, value in stats_dict.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype == torch.bfloat16:
                value = value.float()
            value = value.numpy()
        if np.isscalar(value) or (isinstance(value, np.ndarray) and value.ndim == 0):
            value = float(value)
        converted[key] = value
    return converted


def convert_to_scalar(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Turn one-element tensors and arrays into floats (what scalar-only trackers expect)."""
    out = {}
    for key, value in stats.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and tuple(value.shape) in ((), (1,)):
            value = float(value.item())
        out[key] = value
    return out


# --------------------------------------------------------------------------------------------
# sampling helpers
# --------------------------------------------------------------------------------------------


def set_seed(seed: int) -> None:
    """Seed ``random``, ``numpy`` and ``torch`` (all devices) for reproducible runs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


class LengthSampler:
    """Samples an integer uniformly from ``[min_value, max_value)`` (e.g. a response length)."""

    def __init__(self, min_value: int, max_value: int):
        if max_value <= min_value:
            raise ValueError(f"LengthSampler needs min_value < max_value, got {min_value} and {max_value}")
        self.values = list(range(min_value, max_value))

    def __call__(self) -> int:
        return int(np.random.choice(self.values))


def top_k_top_p_filtering(
    logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, filter_value: float = -float("inf")
) -> torch.Tensor:
    """Mask logits (B, V) outside the top-k and outside the top-p nucleus; returns a new tensor."""
    logits = logits.clone()
    top_k = int(top_k)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, filter_value)
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative > top_p
        remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()  # keep the first token above the threshold
        remove_sorted[..., 0] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, filter_value)
    return logits


@torch.no_grad()
def respond_to_batch(
    model: torch.nn.Module, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Sample ``txt_len`` tokens after each query (B, Tq) with a causal LM; returns (B, txt_len).

    The classic helper: no KV cache, no stopping on EOS. ``PPOTrainer.generate`` is the fast path.
    """
    input_ids = queries
    for _ in range(txt_len):
        logits = model(input_ids)[0][:, -1, :]  # (B, V)
        logits = top_k_top_p_filtering(logits.float(), top_k=top_k, top_p=top_p)
        next_token = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)  # (B, 1)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids[:, -txt_len:]


# The classic ``trl.core`` surface also carries the KL controllers and running moments.
from rlhf_core.kl_control import AdaptiveKLController, FixedKLController, RunningMoments  # noqa: E402,F401
