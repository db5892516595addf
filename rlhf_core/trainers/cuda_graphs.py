"""CUDA graphs of the decoding loop's token step: the thin CUDA-only layer over ``decode.StepRunner``.

A decode step of a small model is dozens of short kernels per layer; launched one by one from Python the GPU
waits on the host most of the time (the first GPU profile: idle ~85% of a ``generate`` call). ``token_step`` has
fixed shapes and keeps every value it needs in tensors, so it is recorded once and replayed as one graph launch per
token. Everything the step computes is covered on the CPU (tests/test_decode.py runs the same step eagerly, and
through ``StepRunner`` with a stand-in backend that replays the function itself); this file only records it.

``RLHF_CORE_CUDA_GRAPHS=0`` turns recording off (the loop then runs the same step eagerly).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch


def graphs_enabled(device: torch.device) -> bool:
    """Record token steps on this device: a CUDA device, unless ``RLHF_CORE_CUDA_GRAPHS=0``."""
    return torch.device(device).type == "cuda" and os.environ.get("RLHF_CORE_CUDA_GRAPHS", "1") != "0"


def uncached_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Inside an autocast region on ``device_type``: the same autocast with its weight-cast cache off; else nothing.

    Autocast keeps the bf16 cast of each fp32 weight for the rest of its region, and frees the casts when the
    region exits. A graph captured while that cache is live reads the cached casts' memory, not the weights: after
    the region, replays would read freed (reused) memory, and even inside it they would miss weight updates. With
    the cache off the capture records the casts themselves (one more read of each weight per step).
    """
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False)


class CudaGraphs:
    """``decode.GraphBackend`` on CUDA: warm-up steps on a side stream, then one recorded step."""

    # Real steps run eagerly before recording (lazy kernel/workspace set-up happens outside the capture).
    warmup_steps = 2
    device_type = "cuda"  # whose autocast state the capture reads (``uncached_autocast``)

    @contextlib.contextmanager
    def warmup(self) -> Iterator[None]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream().wait_stream(stream)

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Capture ``step`` (nothing runs while capturing) and return the replay of the graph."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), uncached_autocast(self.device_type):
            step()
        return graph.replay
