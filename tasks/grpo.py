"""Stage ``grpo``: GRPOTrainer (TRL 1.16 API) on the training prompts against the learned reward model (or the gold
judge: ``grpo.reward: gold``), KL to the SFT reference; writes ``models/grpo``, ``metrics/grpo.json``, ``plots/grpo.csv``.

Off when ``grpo.enabled`` is false (placeholder outputs, see tasks/policy.py). The run is shared with the other
online method: ``tasks.policy.online_policy_stage``.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.policy import online_policy_stage


@task(name="grpo", cache_policy=NO_CACHE)  # training: no retries
def grpo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/grpo``; returns the metrics written to metrics/grpo.json (``{"enabled": false}`` when off)."""
    return online_policy_stage("grpo", root, parent_run_id)
