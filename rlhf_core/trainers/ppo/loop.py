"""The classic PPO run loop as a library function: batches from the trainer's own dataloader -> generate ->
score -> ``step`` -> ``log_stats``, with periodic and on-request checkpoints and exact resume.

    result = run_ppo(trainer, reward_fn, total_steps=20, generation_kwargs={"max_new_tokens": 20, ...},
                     checkpoint_dir=".checkpoints/ppo-x", save_every=5, should_stop=stop.requested_fn)

``trainer`` must have been built with a dataset whose rows hold the query text (``query_key``) and its token
ids (``ids_key``). Under a launcher the dataloader is prepared by accelerate, so every process reads its own
shard: each step trains on ``batch_size x num_processes`` rollouts. The dataloader position, the RNGs and the
curve so far are part of every checkpoint, so a resumed run ends with the same model as a straight one (in one
process; with several, the sampling RNG restored is rank 0's).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf_core import checkpointing as ckpt
from rlhf_core.core import set_seed

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
"""``(query_texts, response_texts) -> one float score per pair``."""


@dataclass
class PPORunResult:
    """What ``run_ppo`` returns: one metrics row per step of the whole run (resumed steps included)."""

    curve: list[dict[str, float]] = field(default_factory=list)
    """Rows ``{"step", "reward_mean", "kl", "kl_coef"}``: reward mean over all processes' rollouts."""
    resumed_at: int | None = None
    """The step the run continued from when it loaded ``checkpoint_dir``; None for a fresh run."""


def run_ppo(
    trainer,
    reward_fn: RewardFn,
    *,
    total_steps: int,
    generation_kwargs: dict[str, Any],
    query_key: str = "query",
    ids_key: str = "input_ids",
    checkpoint_dir: str | Path | None = None,
    save_every: int = 0,
    should_stop: Callable[[], bool] | None = None,
    stop_reason: Callable[[], str | None] | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    on_resume: Callable[[int, Path], None] | None = None,
) -> PPORunResult:
    """Train ``trainer`` for ``total_steps`` PPO steps; resume from ``checkpoint_dir`` when it holds a checkpoint.

    ``save_every`` > 0 writes ``checkpoint_dir`` every that many steps (a hard kill loses at most that many);
    ``should_stop()`` true on any process after a step saves it and raises ``checkpointing.Preempted``.
    ``on_step(row)`` sees each step's metrics row (progress logs); ``on_resume(step, path)`` is called once when
    the run continues from a checkpoint. The checkpoint is left in place: delete it once the outputs are written.
    """
    _check_loop_arguments(trainer, total_steps, save_every, checkpoint_dir, should_stop)
    result = PPORunResult()
    start = _resume(trainer, checkpoint_dir, result)
    if result.resumed_at is not None and on_resume is not None:
        on_resume(start, Path(checkpoint_dir))
    rank = trainer.accelerator.process_index
    if rank:  # independent sampling per process (the data shards already differ)
        set_seed(trainer.config.seed + rank)
    batches = _endless(trainer.dataloader)
    for step in range(start, total_steps):
        row = _one_step(trainer, next(batches), reward_fn, generation_kwargs, query_key, ids_key, step)
        result.curve.append(row)
        if on_step is not None:
            on_step(row)
        if step + 1 == total_steps:
            break
        if _any_process(trainer, should_stop() if should_stop is not None else False):
            _save(trainer, checkpoint_dir, step + 1, result.curve)
            raise ckpt.Preempted(checkpoint_dir, step + 1, stop_reason() if stop_reason is not None else None)
        if save_every and (step + 1) % save_every == 0:
            _save(trainer, checkpoint_dir, step + 1, result.curve)
    return result


def _check_loop_arguments(trainer, total_steps, save_every, checkpoint_dir, should_stop) -> None:
    if trainer.dataloader is None:
        raise ValueError("run_ppo needs a PPOTrainer built with a dataset (its dataloader supplies the queries)")
    if len(trainer.dataloader) == 0:
        raise ValueError(f"the dataset has fewer rows than one batch (batch_size={trainer.config.batch_size} per "
                         f"process x {trainer.accelerator.num_processes} processes)")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if save_every < 0:
        raise ValueError(f"save_every must be >= 0 (0: no periodic checkpoints), got {save_every}")
    if (save_every or should_stop is not None) and checkpoint_dir is None:
        raise ValueError("save_every and should_stop need a checkpoint_dir to save into")


def _resume(trainer, checkpoint_dir, result: PPORunResult) -> int:
    """Load ``checkpoint_dir`` if it holds a complete checkpoint; the step to continue from (0 when fresh)."""
    if checkpoint_dir is None:
        return 0
    with trainer.accelerator.main_process_first():  # rank 0 recovers a half-swapped directory first
        found = ckpt.resumable_checkpoint(checkpoint_dir)
    if not found:
        return 0
    extra = trainer.load_state(str(found))
    result.curve = list(extra["curve"])
    result.resumed_at = int(extra["next_step"])
    return result.resumed_at


def _endless(loader) -> Iterator[Any]:
    """The dataloader's batches, epoch after epoch (one loop per epoch, so its position is exact)."""
    while True:
        yield from loader


def _one_step(trainer, batch, reward_fn: RewardFn, generation_kwargs, query_key, ids_key, step) -> dict[str, float]:
    """Generate for the batch's queries, score them, ``step`` and ``log_stats``; the step's metrics row."""
    query_texts = list(batch[query_key])
    queries = [torch.as_tensor(ids, dtype=torch.long) for ids in batch[ids_key]]
    responses = trainer.generate(queries, return_prompt=False, batch_size=len(queries), **generation_kwargs)
    response_texts = trainer.tokenizer.batch_decode(responses, skip_special_tokens=True)
    scores = [float(s) for s in reward_fn(query_texts, response_texts)]
    if len(scores) != len(queries):
        raise ValueError(f"reward_fn returned {len(scores)} scores for {len(queries)} query/response pairs")
    rewards = [torch.tensor(s, dtype=torch.float32) for s in scores]
    stats = trainer.step(queries, responses, rewards)
    trainer.log_stats(stats, {"query": query_texts, "response": response_texts}, rewards)
    return {"step": step, "reward_mean": _mean_over_processes(trainer, scores), "kl": float(stats["objective/kl"]),
            "kl_coef": float(stats["objective/kl_coef"])}


def _save(trainer, checkpoint_dir, next_step: int, curve: list[dict[str, float]]) -> None:
    trainer.save_state(str(checkpoint_dir), extra={"next_step": next_step, "curve": curve})


def _any_process(trainer, flag: bool) -> bool:
    """True if ``flag`` is true on any process (a collective: every process calls it at the same step)."""
    if trainer.accelerator.num_processes == 1:
        return bool(flag)
    value = torch.tensor(float(flag), device=trainer.accelerator.device)
    return bool(trainer.accelerator.reduce(value, "max") > 0)


def _mean_over_processes(trainer, values: list[float]) -> float:
    """Mean of ``values`` pooled over all processes; ``statistics.fmean`` in one process."""
    if trainer.accelerator.num_processes == 1:
        return statistics.fmean(values)
    total = torch.tensor([sum(values), float(len(values))], dtype=torch.float64, device=trainer.accelerator.device)
    total = trainer.accelerator.reduce(total, "sum")
    return float(total[0] / total[1])
