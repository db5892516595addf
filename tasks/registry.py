"""Registry step: register the evaluated policy in MLflow and move the champion alias by the rule.

After ``evaluate``: the best candidate policy (``registry.candidates``, by ``registry.metric``) is logged
and registered as a new version of ``registry.model_name`` with the alias ``challenger``. The alias
``champion`` moves to it only when :func:`decide` says so; the decision and its reason are recorded as
tags on the version and on the registry run. Running again for the same evaluation registers nothing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.distributed import require_single_process
from tasks.logs import get_logger
from tasks.params import METRIC_KEYS, PARAMS_FILE, RegistryParams, load_params
from tasks.stage_run import stage_run

CHAMPION, CHALLENGER = "champion", "challenger"


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def pick_challenger(results: dict[str, dict[str, float]], rule: RegistryParams) -> str:
    """The candidate policy with the highest ``rule.metric`` (ties: the first listed); candidates that were not
    evaluated (their stage is disabled) do not compete."""
    present = [name for name in rule.candidates if name in results]
    if not present:
        raise ValueError(f"registry.candidates {rule.candidates}: none was evaluated (all disabled?)")
    return max(present, key=lambda name: (results[name][rule.metric], -rule.candidates.index(name)))


def decide(challenger: dict[str, float], champion: dict[str, float] | None, rule: RegistryParams) -> Decision:
    """The registry rule: the challenger replaces the champion only if it stays within ``max_kl`` of the
    SFT reference and beats the champion's ``metric`` by at least ``min_improvement``."""
    m = rule.metric
    if challenger["kl"] > rule.max_kl:
        return Decision(False, f"challenger KL {challenger['kl']:.3f} exceeds registry.max_kl {rule.max_kl}")
    if champion is None:
        return Decision(True, f"no champion yet; challenger {m}={challenger[m]:.4f}")
    if m not in champion:
        return Decision(True, f"champion has no recorded {m}; challenger {m}={challenger[m]:.4f}")
    gain = challenger[m] - champion[m]
    if gain >= rule.min_improvement:
        return Decision(True, f"{m} {challenger[m]:.4f} beats champion {champion[m]:.4f} by {gain:+.4f} "
                              f"(>= min_improvement {rule.min_improvement})")
    return Decision(False, f"{m} {challenger[m]:.4f} vs champion {champion[m]:.4f}: gain {gain:+.4f} "
                           f"< min_improvement {rule.min_improvement}")


def _champion_metrics(client, name: str) -> tuple[str | None, dict[str, float] | None]:
    from mlflow.exceptions import MlflowException

    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None, None
    metrics = {k: float(version.tags[f"metric.{k}"]) for k in METRIC_KEYS if f"metric.{k}" in version.tags}
    return version.version, metrics


def _versions_with_hash(client, name: str, evaluation_hash: str) -> list:
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return []
    return [v for v in versions if v.tags.get("evaluation_md5") == evaluation_hash]


@task(name="registry", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def registry_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Register the evaluated challenger; move ``champion`` if it wins. Returns the decision record."""
    require_single_process("registry", "`python -m flows.pipeline` (it runs the registry step after evaluate)")
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tasks.mlflow_runs import mlflow_setup, tracking_reachable, tracking_uri

    root = Path(root).resolve()
    params = load_params(root / PARAMS_FILE)
    rule, paths = params.registry, params.paths
    log = get_logger()
    if not tracking_reachable(root):  # the registry lives on the server: nothing to spool, run it again later
        log.warning("registry: tracking server %s unreachable; nothing registered. Run `python -m flows.pipeline` "
                    "again when it is back (trained stages are not re-run).", tracking_uri(root))
        return {"registered": False, "reason": "tracking server unreachable"}
    evaluation_path = root / paths.metrics / "evaluate.json"
    if not evaluation_path.exists():
        raise FileNotFoundError(f"{evaluation_path}: run the evaluate stage before the registry step")
    raw = evaluation_path.read_bytes()
    results = json.loads(raw)
    # the evaluation and the rule identify a registration: same both -> already done
    evaluation_hash = hashlib.md5(raw + json.dumps(rule.__dict__, sort_keys=True).encode()).hexdigest()
    mlflow_setup(root)
    client = MlflowClient()
    done = _versions_with_hash(client, rule.model_name, evaluation_hash)
    if done:
        v = done[0]
        log.info("registry: evaluation %s already registered as %s v%s; nothing to do", evaluation_hash[:8],
                 rule.model_name, v.version)
        return {"registered": False, "version": v.version, "decision": v.tags.get("decision"),
                "reason": "already registered for this evaluation"}

    name = pick_challenger(results, rule)
    challenger = results[name]
    champion_version, champion = _champion_metrics(client, rule.model_name)
    decision = decide(challenger, champion, rule)
    deps = [f"{paths.metrics}/evaluate.json", f"{paths.models}/{name}"]
    with stage_run("registry", root, rule, deps, parent_run_id) as run:
        mlflow.log_artifacts(str(root / paths.models / name), artifact_path="policy")
        mlflow.log_dict(results, "evaluate.json")
        try:
            client.create_registered_model(rule.model_name, description="RLHF policies evaluated by the pipeline")
        except MlflowException:
            pass  # exists
        tags = {"policy": name, "evaluation_md5": evaluation_hash, "decision": "promote" if decision.promote else "keep",
                "reason": decision.reason, **{f"metric.{k}": str(v) for k, v in challenger.items()}}
        version = client.create_model_version(rule.model_name, source=mlflow.get_artifact_uri("policy"),
                                              run_id=run.run_id, tags=tags,
                                              description=f"{name} policy; {decision.reason}")
        client.set_registered_model_alias(rule.model_name, CHALLENGER, version.version)
        if decision.promote:
            client.set_registered_model_alias(rule.model_name, CHAMPION, version.version)
        mlflow.set_tags({"registry.decision": tags["decision"], "registry.reason": decision.reason,
                         "registry.version": version.version, "registry.previous_champion": champion_version or "none"})
        record = {"registered": True, "model": rule.model_name, "version": version.version, "policy": name,
                  "decision": tags["decision"], "reason": decision.reason,
                  "previous_champion": champion_version, f"challenger_{rule.metric}": challenger[rule.metric]}
        run.summary.update(record)
    log.info("registry: %s v%s (%s) -> %s: %s", rule.model_name, version.version, name, tags["decision"], decision.reason)
    return record
