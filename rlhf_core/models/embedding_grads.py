"""Tied input/output embeddings: accumulate the input side's gradient sparsely (speed; same gradient).

GPT-2-style models share one (V, H) matrix between the token embedding and the LM head. Autograd then
receives two gradients for it per backward: the head's (dense, V x H) and the embedding lookup's. The lookup's
is dense by default: a fresh zero (V, H) tensor with a few rows filled, then added to the head's into a third
(V, H) tensor. On GPT-2 small that is ~460 MB of memory traffic into freshly faulted pages per backward
(profiled: `aten::add` of two (50257, 768) tensors 585 ms and its `fill_` 98 ms of a 2.97 s forward + backward,
bench/analysis.md). Asked for a sparse gradient, the lookup yields only its rows, which autograd adds into the
head's dense gradient: the weight's gradient is the same sum (dense), without the two temporaries.

Only for a tied pair whose weight is trained: an untied embedding alone would get a sparse gradient that
most optimizers refuse.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn


def tied_input_embedding(model: Any) -> nn.Embedding | None:
    """The trained ``nn.Embedding`` whose weight is also the LM head's, under DDP and value-head wrappers."""
    inner = getattr(model, "module", model)  # DDP / accelerate wrapper
    lm = getattr(inner, "pretrained_model", inner)  # value-head wrapper
    if not hasattr(lm, "get_input_embeddings") or not hasattr(lm, "get_output_embeddings"):
        return None
    embedding, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or head is None or getattr(head, "weight", None) is not embedding.weight:
        return None
    return embedding if embedding.weight.requires_grad else None


@contextlib.contextmanager
def sparse_tied_embedding_grad(model: Any) -> Iterator[None]:
    """Forward passes inside the block record a sparse lookup gradient for a tied, trained embedding.

    The flag is read when the lookup runs, so the backward may happen after the block; it is restored after.
    The forward must use the LM head (it does whenever log-probs are computed), so the sum stays dense.
    CPU weights only: what it saves is freshly faulted host pages; a GPU's dense lookup gradient is one kernel into
    memory its caching allocator already holds, and the sparse tensor's extra operations would only add launches.
    """
    embedding = tied_input_embedding(model)
    if embedding is None or embedding.weight.device.type != "cpu":
        yield
        return
    previous, embedding.sparse = embedding.sparse, True
    try:
        yield
    finally:
        embedding.sparse = previous
