"""Stage ``rloo``: RLOOTrainer (TRL 1.16 API) on the training prompts against the learned reward model (or the gold
judge: ``rloo.reward: gold``), KL to the SFT reference; writes ``models/rloo``, ``metrics/rloo.json``, ``plots/rloo.csv``.

Off when ``rloo.enabled`` is false (placeholder outputs, see tasks/policy.py). The run is shared with the other
online method: ``tasks.policy.online_policy_stage``.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.policy import online_policy_stage


@task(name="rloo", cache_policy=NO_CACHE)  # training: no retries
def rloo_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Train ``models/rloo``; returns the metrics written to metrics/rloo.json (``{"enabled": false}`` when off)."""
    return online_policy_stage("rloo", root, parent_run_id)
