"""The typed batches where rollout and learning meet.

``ModelBatch`` holds padded model inputs plus where each response sits in them. PPO: ``RolloutForward`` holds
what the rollout's forward passes give, ``Experience`` everything a step computes from one batch before the
optimisation epochs, ``FirstMinibatch`` the first mini-batch whose forward the rollout runs. GRPO and RLOO:
``Rollout`` holds one scored generation batch. Every field has a shape: ``B`` batch, ``b`` mini-batch, ``T``
padded model sequence, ``A`` padded response length, ``V`` vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from rlhf_core.core import position_ids_from_attention_mask


@dataclass(kw_only=True)
class HostLayout:
    """Where a batch's real tokens and scored positions are, held on the host (numpy).

    The forward's shape decisions (which padding columns to drop, whether to pack, which positions get
    logits) read these, never the device tensors: on a GPU a Python decision on a tensor value would wait for
    every queued kernel, once per mini-batch.
    """

    masks: dict[str, np.ndarray]
    """The batch's attention masks by model-input name (``attention_mask``, ``decoder_attention_mask``): (B, T) bool."""
    response_index: np.ndarray
    """(B, A) int64: ``ModelBatch.response_index`` on the host."""

    @classmethod
    def of(cls, model_inputs: dict[str, torch.Tensor], response_index: torch.Tensor) -> "HostLayout":
        """Copy the masks and the index to the host (one device read; done when a batch is built)."""
        masks = {key: model_inputs[key].bool().cpu().numpy() for key in _PADDED_GROUPS if key in model_inputs}
        return cls(masks=masks, response_index=response_index.cpu().numpy().astype(np.int64))

    def rows(self, index: np.ndarray) -> "HostLayout":
        return HostLayout(masks={key: mask[index] for key, mask in self.masks.items()},
                          response_index=self.response_index[index])


def host_rows(index: torch.Tensor | np.ndarray) -> np.ndarray:
    """Row numbers held on the host (a CPU tensor, a list or an array) as an int64 array."""
    if isinstance(index, torch.Tensor):
        index = index.cpu().numpy()
    return np.asarray(index, dtype=np.int64)


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``, copied without waiting for the device's queued work."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(device, non_blocking=True)


@dataclass(kw_only=True)  # built by keyword only: same-shape tensors cannot be swapped silently
class ModelBatch:
    """Padded model inputs for B query/response pairs, and the response positions inside them."""

    model_inputs: dict[str, torch.Tensor]
    """Keyword arguments of the model's forward: ids, attention masks, position ids; each (B, T)."""
    response_index: torch.Tensor
    """(B, A) long: the position whose logits score response slot a. For a causal LM the position before the
    token (column t scores token t+1: a column of the shifted log-prob array (B, T-1))."""
    response_tokens: torch.Tensor
    """(B, A) long: the token of response slot a (any valid id on padding slots)."""
    response_mask: torch.Tensor
    """(B, A) float: 1 on a real (and not user-masked) response token, 0 on padding."""
    token_ids_key: str
    """Which model input holds the scored tokens: ``input_ids`` or ``decoder_input_ids``."""
    host: HostLayout | None = None
    """The masks and ``response_index`` on the host; None: copied from the device when first needed."""

    def layout(self) -> HostLayout:
        """``host``, copied from the device tensors the first time if the batch was built without it."""
        if self.host is None:
            self.host = HostLayout.of(self.model_inputs, self.response_index)
        return self.host

    def rows(self, index: torch.Tensor | np.ndarray) -> "ModelBatch":
        """The sub-batch of the given rows (``index``: a host array or tensor of row numbers)."""
        host_index = host_rows(index)
        device_index = to_device(host_index, self.response_index.device)
        return replace(
            self,
            model_inputs={key: value[device_index] for key, value in self.model_inputs.items()},
            response_index=self.response_index[device_index],
            response_tokens=self.response_tokens[device_index],
            response_mask=self.response_mask[device_index],
            host=self.layout().rows(host_index),
        )

    def trimmed(self) -> "ModelBatch":
        """The same rows without the columns that are padding in every row (speed; same values).

        A sub-batch is padded to the width of the whole batch; a forward pass over columns that no row
        attends to is wasted work. Real tokens keep their position ids, so their outputs are unchanged.
        Decided on the host layout: no device read.
        """
        layout = self.layout()
        inputs, masks = dict(self.model_inputs), dict(layout.masks)
        index, host_index = self.response_index, layout.response_index
        for mask_key, keys in _PADDED_GROUPS.items():
            if mask_key not in masks:
                continue
            real = masks[mask_key].any(0)  # (T,) columns some row attends to
            if real.all():
                continue
            first, last = int(real.argmax()), len(real) - int(real[::-1].argmax())
            for key in keys:
                if key in inputs:
                    inputs[key] = inputs[key][:, first:last]
            masks[mask_key] = masks[mask_key][:, first:last]
            if self.token_ids_key in keys:
                # Padded response slots are clamped to the last scorable column, as when the batch was built.
                top = max(last - first - 2, 0)
                index, host_index = (index - first).clamp(0, top), np.clip(host_index - first, 0, top)
        return replace(self, model_inputs=inputs, response_index=index,
                       host=HostLayout(masks=masks, response_index=host_index))

    def scatter_to_sequence(self, values: torch.Tensor, width: int | None = None) -> torch.Tensor:
        """Response-token values (B, A) or (B, A, V) placed in classic TRL's padded layout (B, T-1[, V]).

        Column t of the result belongs to token t+1 of the padded sequence (``width`` defaults to T-1 of
        ``token_ids_key``); everything but the response tokens the mask keeps is 0.
        """
        if width is None:
            width = self.model_inputs[self.token_ids_key].shape[1] - 1
        mask = self.response_mask.to(values.dtype)  # (B, A)
        index = self.response_index  # (B, A)
        if values.dim() == 3:
            mask, index = mask[..., None], index[..., None].expand(-1, -1, values.shape[-1])  # (B, A, V)
        out = values.new_zeros((values.shape[0], width, *values.shape[2:]))  # (B, T-1[, V])
        # Padding slots were clamped onto the last column: adding their zeros leaves it unchanged.
        return out.scatter_add(1, index, values * mask)

    def __len__(self) -> int:
        return self.response_index.shape[0]


# Model inputs that share a padding layout, keyed by the attention mask that says which columns are real.
_PADDED_GROUPS = {
    "attention_mask": ("input_ids", "attention_mask", "position_ids"),
    "decoder_attention_mask": ("decoder_input_ids", "decoder_attention_mask"),
}


@dataclass(kw_only=True)  # same-shape tensors: by keyword only
class RolloutForward:
    """What PPO's forward passes over the rollout give (no gradients): the inputs of rewards and advantages."""

    logprobs: torch.Tensor
    """(B, A) policy log-prob of each response token at rollout time (the "old" log-probs)."""
    values: torch.Tensor
    """(B, A) value-head prediction before each response token, zeroed on padding."""
    ref_logprobs: torch.Tensor
    """(B, A) reference-model log-prob of each response token."""
    full_logprobs: torch.Tensor | None = None
    """(B, A, V) the policy's log-softmax over the vocabulary; only for ``kl_penalty="full"``, else None."""
    ref_full_logprobs: torch.Tensor | None = None
    """(B, A, V) the reference's log-softmax over the vocabulary; only for ``kl_penalty="full"``, else None."""


@dataclass(kw_only=True)
class FirstMinibatch:
    """PPO's first mini-batch of a step, drawn before the rollout so that the rollout can run its policy
    forward with gradients and the first update reuse it (one policy forward fewer per step)."""

    order: torch.Tensor
    """(B,) long: the first epoch's row order, a permutation of the batch's rows."""
    rows: torch.Tensor
    """(b,) long: the first mini-batch's rows, the head of ``order``."""
    forward: Any = None
    """Those rows' policy forward with gradients (a ``forward.ResponseForward``: log-probs, values and entropy
    (b, A)). Set by the rollout; None before, and again once the first update has taken it (``take_forward``)."""

    def take_forward(self) -> Any:
        """Hand the kept forward over, once: afterwards this object holds no graph."""
        forward, self.forward = self.forward, None
        return forward


@dataclass(kw_only=True)  # eight (B, A) tensors: by keyword only
class Experience:
    """What one PPO step computes before optimising: all tensors (B, A) and detached."""

    logprobs: torch.Tensor
    """Policy log-prob of each response token at rollout time (the "old" log-probs)."""
    ref_logprobs: torch.Tensor
    """Reference-model log-prob of each response token."""
    values: torch.Tensor
    """Value-head prediction before each response token, zeroed on padding."""
    rewards: torch.Tensor
    """Per-token reward: -kl_coef * KL, plus the score on the last real token."""
    non_score_rewards: torch.Tensor
    """The KL part of the reward alone."""
    kls: torch.Tensor
    """Per-token KL estimate (the configured ``kl_penalty``)."""
    advantages: torch.Tensor
    """Whitened GAE advantages."""
    returns: torch.Tensor
    """advantages (before whitening) + values: the value-head targets."""

    def rows(self, index: torch.Tensor | np.ndarray) -> "Experience":
        """The sub-batch of the given rows (``index``: a host array or tensor of row numbers)."""
        index = to_device(host_rows(index), self.logprobs.device)
        return Experience(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


@dataclass
class Rollout:
    """One generation batch (this process's share) after sampling and scoring: B prompt/completion pairs."""

    batch: ModelBatch
    """Prompt + completion, left-padded, with position ids; ``response_mask`` (B, A) is 0 on padding and on
    truncated completions when ``mask_truncated_completions``."""
    advantages: torch.Tensor
    """(B,) one advantage per completion (group-relative for GRPO, leave-one-out for RLOO)."""
    old_logprobs: torch.Tensor | None
    """(B, A) policy log-probs at sampling time; None when every update is on-policy (the ratio is then 1)."""
    ref_logprobs: torch.Tensor | None
    """(B, A) reference log-probs; None when ``beta == 0`` (no reference model exists)."""
    num_items: torch.Tensor
    """() real completion tokens of the whole generation batch over all processes (``dapo``'s normaliser)."""
    policy_forward: tuple[torch.Tensor, torch.Tensor] | None = None
    """The loss forward already run at sampling time: (B, A) log-probs with their graph and (B, A) entropy;
    None when ``compute_loss`` runs it (see ``OnlineRLTrainer._can_reuse_loss_forward``)."""

    def rows(self, index: torch.Tensor) -> "Rollout":
        """The sub-rollout of the given rows."""
        pick = (lambda t: None if t is None else t[index])
        forward = None if self.policy_forward is None else tuple(t[index] for t in self.policy_forward)
        return replace(self, batch=self.batch.rows(index), advantages=self.advantages[index],
                       old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
                       policy_forward=forward)

    def __len__(self) -> int:
        return len(self.advantages)


def _pad(sequences: list[torch.Tensor], value: int, left: bool) -> torch.Tensor:
    """Pad 1-d tensors to (B, max_len) on the left or the right."""
    if not left:
        return pad_sequence(sequences, batch_first=True, padding_value=value)
    flipped = [seq.flip(0) for seq in sequences]
    return pad_sequence(flipped, batch_first=True, padding_value=value).flip(1)


def _response_slots(starts: torch.Tensor, lengths: torch.Tensor, max_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index (B, A) of each response token in the shifted log-prob array, and the (B, A) padding mask."""
    offsets = torch.arange(int(lengths.max()), device=starts.device)  # (A,)
    mask = (offsets[None, :] < lengths[:, None]).float()  # (B, A)
    index = (starts[:, None] + offsets[None, :]).clamp(max=max_index)  # (B, A)
    return index, mask


def _apply_user_masks(mask: torch.Tensor, user_masks: list[torch.Tensor] | None) -> torch.Tensor:
    if user_masks is None:
        return mask
    padded = pad_sequence([m.float() for m in user_masks], batch_first=True, padding_value=0.0)  # (B, A)
    out = mask.clone()
    out[:, : padded.shape[1]] *= padded[:, : out.shape[1]]
    return out


def build_causal_batch(
    queries: list[torch.Tensor], responses: list[torch.Tensor], pad_token_id: int, left_pad: bool,
    response_masks: list[torch.Tensor] | None = None, collate=None,
) -> ModelBatch:
    """Concatenate each query and response, pad, and locate the response tokens.

    ``collate`` (classic TRL's ``training_data_collator``), if given, pads the rows
    ``{"input_ids", "attention_mask"}`` itself (any side, any width); the responses are located from
    its attention mask. Position ids count real tokens only, so padding leaves every sequence's
    positions as if it were alone in the batch.
    """
    device = queries[0].device
    sequences = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    if collate is None:
        input_ids = _pad(sequences, pad_token_id, left_pad)  # (B, T)
        attention_mask = _pad([torch.ones_like(s) for s in sequences], 0, left_pad)  # (B, T)
    else:
        padded = collate([{"input_ids": s, "attention_mask": torch.ones_like(s)} for s in sequences])
        input_ids = torch.as_tensor(padded["input_ids"]).to(device)  # (B, T)
        attention_mask = torch.as_tensor(padded["attention_mask"]).to(device)  # (B, T)
    query_lens = torch.tensor([len(q) for q in queries], device=device)
    pad_before = attention_mask.int().argmax(dim=1)  # (B,) first real column: the padding in front of the row
    # Shifted position t scores token t+1, so the first response token is scored at query_len - 1.
    starts = pad_before + query_lens - 1
    lengths = torch.tensor([len(r) for r in responses], device=device)
    index, mask = _response_slots(starts, lengths, input_ids.shape[1] - 2)
    model_inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_attention_mask(attention_mask),
    }
    return _model_batch(model_inputs, index, torch.gather(input_ids[:, 1:], 1, index),
                        _apply_user_masks(mask, response_masks), "input_ids")


def build_seq2seq_batch(
    queries: list[torch.Tensor], responses: list[torch.Tensor], pad_token_id: int, left_pad: bool,
    response_masks: list[torch.Tensor] | None = None,
) -> ModelBatch:
    """Encoder inputs from the queries, decoder inputs from the responses.

    A response starts with the decoder-start token (as ``generate`` returns it); every token after
    it is scored. The decoder side is always right-padded.
    """
    input_ids = _pad(queries, pad_token_id, left_pad)
    attention_mask = _pad([torch.ones_like(q) for q in queries], 0, left_pad)
    decoder_input_ids = _pad(responses, pad_token_id, left=False)
    decoder_attention_mask = _pad([torch.ones_like(r) for r in responses], 0, left=False)
    lengths = torch.tensor([len(r) - 1 for r in responses], device=input_ids.device)
    index, mask = _response_slots(torch.zeros_like(lengths), lengths, max(decoder_input_ids.shape[1] - 2, 0))
    model_inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "decoder_attention_mask": decoder_attention_mask,
    }
    user = None if response_masks is None else [m[1:] for m in response_masks]
    tokens = torch.gather(decoder_input_ids[:, 1:], 1, index)  # (B, A)
    return _model_batch(model_inputs, index, tokens, _apply_user_masks(mask, user), "decoder_input_ids")


def _model_batch(model_inputs: dict[str, torch.Tensor], index: torch.Tensor, tokens: torch.Tensor,
                 mask: torch.Tensor, token_ids_key: str) -> ModelBatch:
    """A ``ModelBatch`` with its host layout (one device read, here rather than in every forward)."""
    return ModelBatch(model_inputs=model_inputs, response_index=index, response_tokens=tokens, response_mask=mask,
                      token_ids_key=token_ids_key, host=HostLayout.of(model_inputs, index))
