"""Which process of a launch this is, and the few collectives the stage tasks need under a launcher.

``accelerate launch`` / ``torchrun`` (and ``mpirun``) start one copy of ``python -m flows.stage <name>`` per
process. All copies train in lockstep; only the main process (global rank 0) writes the stage's outputs, its
MLflow run and its resumable state (``tasks.store.stage_run``, ``tasks.store.outputs`` ask :func:`is_main_process`).
Everything here is a no-op in a single process, so the single-process path of every stage is unchanged.

Rank and world size come from the launcher's environment (``tasks.process.ranks``, re-exported here), so they are
known before any process group exists. The collectives use accelerate's ``PartialState`` (the same process group the
trainers use; created on first use).
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from tasks.process.logs import get_logger
from tasks.process.ranks import RANK_ENV, WORLD_SIZE_ENV, is_main_process, process_rank, world_size

class LauncherError(RuntimeError):
    """A single-process stage (prepare, evaluate, registry, the pipeline flow) was started by a launcher."""


def require_single_process(what: str, launchable: Sequence[str], how: str | None = None) -> None:
    """Fail fast when ``what`` (a non-training stage or flow) was started by a launcher with several processes.

    ``launchable``: the stages that may run under a launcher (the stage table's ``LAUNCHABLE``), named in the
    message; ``how``: the single-process command to suggest (default ``python -m flows.stage <what>``).

    These stages have nothing to split over processes, and running them on rank 0 while the others exit 0 would
    hide a misrouted launch behind a success; a clear error costs one re-run without the launcher.
    """
    n = world_size()
    if n > 1:
        how = how or f"`python -m flows.stage {what}` (or `dvc repro {what}`)"
        raise LauncherError(
            f"{what}: started by a launcher with {n} processes (WORLD_SIZE={n}, this is rank {process_rank()}); "
            f"{what} runs in a single process. Run it without a launcher: {how}. Only the training stages "
            f"({', '.join(launchable)}) run under `accelerate launch` / `torchrun`.")


def _state():
    from accelerate import PartialState  # accelerate: only under a launcher

    return PartialState()


def barrier() -> None:
    """Wait until every process gets here (no-op in a single process)."""
    if world_size() > 1:
        _state().wait_for_everyone()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (e.g. recovers a checkpoint directory), then the others."""
    if world_size() == 1:
        yield
        return
    if not is_main_process():
        barrier()
    yield
    if is_main_process():
        barrier()


def _all_reduce(values: list[float], op: str, dtype: Any = None) -> list[float]:
    import torch  # torch.distributed: only under a launcher
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=dtype or torch.float64, device=_state().device)
    dist.all_reduce(tensor, op={"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op])
    return tensor.cpu().tolist()


def any_process(flag: bool) -> bool:
    """True if ``flag`` is true on any process (a collective: every process must call it at the same point).

    Used for stop requests: a SIGTERM that reached one rank stops every rank at the same step boundary."""
    if world_size() == 1:
        return bool(flag)
    return _all_reduce([1.0 if flag else 0.0], "max")[0] > 0.0


def mean_over_processes(values: Sequence[float]) -> float:
    """Mean of ``values`` pooled over all processes (a collective); ``statistics.fmean`` in a single process."""
    if world_size() == 1:
        return statistics.fmean(values)
    total, count = _all_reduce([float(sum(values)), float(len(values))], "sum")
    return total / count


def weights_fingerprint(model: Any) -> str:
    """sha256 of a module's state dict (names, dtypes, shapes and bytes, in name order)."""
    import torch  # torch: only when weights are compared (the stage wrapper imports this module)

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_replicas_identical(accelerator: Any, model: Any, stage: str) -> str | None:
    """Under data parallelism (DDP), check that every process ends with the same weights; returns the fingerprint.

    A collective. Skipped (None) in a single process and for sharded setups (DeepSpeed, FSDP, Megatron), whose
    processes hold different shards by design. Raises ``RuntimeError`` if the replicas differ.
    """
    if world_size() == 1 or getattr(accelerator, "num_processes", 1) <= 1:
        return None
    kind = str(getattr(accelerator, "distributed_type", "")).upper()
    if any(sharded in kind for sharded in ("DEEPSPEED", "FSDP", "MEGATRON", "XLA")):
        return None
    import torch  # (torch: only under a launcher)

    fingerprint = weights_fingerprint(model)
    head = int(fingerprint[:15], 16)  # 60 bits: fits an int64 with its negation
    high, neg_low = _all_reduce([head, -head], "max", dtype=torch.int64)
    if high != -neg_low:
        raise RuntimeError(f"{stage}: the {world_size()} processes ended with different weights (rank "
                           f"{process_rank()}: sha256 {fingerprint[:16]}); data-parallel training went out of sync")
    get_logger().info("%s: weights identical on all %d processes (sha256 %s)", stage, world_size(), fingerprint[:16])
    return fingerprint


def destroy_process_group() -> None:
    """Tear down the process group at the end of a launched stage (quiet exit; no-op if none)."""
    with contextlib.suppress(Exception):
        import torch.distributed as dist  # (torch: only under a launcher)

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


__all__ = [
    "LauncherError", "RANK_ENV", "WORLD_SIZE_ENV", "any_process", "barrier", "check_replicas_identical", "destroy_process_group",
    "is_main_process", "main_process_first", "mean_over_processes", "process_rank", "require_single_process",
    "weights_fingerprint", "world_size",
]
