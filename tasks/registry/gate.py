"""Registry step: register the evaluated policy as an MLflow Model and move the champion alias by the rule.

After ``evaluate``: the best candidate policy (``registry.candidates``, by ``registry.metric``) is logged as the
project's MLflow Model of a policy version (``tasks/registry/policy_pyfunc.py``: the plain causal LM, its tokenizer and model
card as artifacts of a pyfunc with a signature and pinned requirements, which answers with them and records each
answer as a trace: ``mlflow models serve -m models:/rlhf-policy@champion`` and
``mlflow.pyfunc.load_model("models:/rlhf-policy@champion")`` both do) and registered as a new version of
``registry.model_name`` with the alias ``challenger``.

- **Lineage.** Each version is tagged with the git commit, the DVC hashes of its weights and data (dvc.lock),
  the evaluation set's hash and the MLflow run of the evaluation that scored it; and with the human feedback that
  taught it (``feedback.*`` tags; the batches' traces and judgements in ``feedback_lineage.json`` of its run:
  ``tasks/feedback/lineage.py``). Weights whose hash differs from
  the one ``evaluate`` scored (``metrics/evaluate.json`` -> ``scored``) are refused.
- **Same data only.** ``champion`` moves only when :func:`decide` says so, on numbers measured on the same
  evaluation set: a champion scored on another set is re-scored on this one first (its weights loaded from the
  registry, scored by ``tasks.stages.common.scoring.rescore``). The decision and the numbers behind it are tags on the version.
- **Larger than the noise.** A win must also pass a paired bootstrap test over the evaluation prompts
  (``registry.significance``): the challenger's and the champion's per-prompt values of ``registry.metric``
  on the same prompts (``data/evaluate_prompts.csv``, or the champion re-scored when its weights are not among
  the evaluated ones). Differences of a few thousandths on a few hundred prompts do not promote.
- **The task's metric.** The sentiment task decides on ``registry.metric`` (the gold reward by default) over prompts;
  a verifiable task (arithmetic, problems) on ``pass@1`` over problems: each problem's c/n, read from evaluate's
  verdict file (``data/evaluate_prompts.csv``, one row per sample), compared by the same paired bootstrap. The
  version's tags (``decided_by``, ``test.unit``), its description and the step's record name the metric.
- **Idempotent.** A version is identified by (weights hash, evaluation set hash) and is ``registry.state=pending``
  until the aliases its decision asks for are set. Running again (a Prefect retry after a failed alias call)
  completes a pending version instead of registering another one; a complete one is left alone. Weights already
  registered under another evaluation set re-use the same logged MLflow Model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.metadata import version as installed_version
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from rlhf_core.evaluation import PairedTest, PromptScores, paired_bootstrap, win_rate
from rlhf_core.tracking import redact
from tasks.feedback.lineage import LINEAGE_FILE, feedback_lineage, feedback_tags
from tasks.process.distributed import require_single_process
from tasks.process.logs import get_logger
from tasks.spec.params import METRIC_KEYS, PARAMS_FILE, VERIFIED_METRICS, Params, PathsParams, RegistryParams, as_dict
from tasks.store.mlflow_runs import metric_of_key, mlflow_key, mlflow_setup, store_problem
from tasks.store.provenance import git_commit, input_hashes
from tasks.stages.common.scoring import (EVALUATE, SCORED_KEY, EvaluationSet, content_md5, evaluation_file, load_evaluation_set,
                           load_policy, load_tokenizer, policy_results, read_prompt_scores, rescore)
from tasks.spec.stage import metrics_file
from tasks.stages.common.problems import solutions_of
from tasks.stages.common.verified_eval import problem_pass, read_problem_pass, score_policy_samples
from tasks.stages import BY_NAME, LAUNCHABLE, load_params, stage_files
from tasks.store.stage_run import stage_run

CHAMPION, CHALLENGER = "champion", "challenger"
PENDING, COMPLETE = "pending", "complete"
REQUIREMENTS = ("mlflow", "transformers", "tokenizers", "torch", "safetensors", "accelerate")
"""Packages the served model needs; pinned to the versions installed here (offline, MLflow cannot infer them)."""


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


class WeightsMismatchError(ValueError):
    """The weights on disk are not the ones ``evaluate`` scored."""


def pick_challenger(results: dict[str, dict[str, float]], rule: RegistryParams) -> str:
    """The candidate policy with the highest ``rule.metric`` (ties: the first listed); candidates that were not
    evaluated (their stage is disabled) do not compete."""
    present = [name for name in rule.candidates if name in results]
    if not present:
        raise ValueError(f"registry.candidates {rule.candidates}: none was evaluated (all disabled?)")
    return max(present, key=lambda name: (results[name][rule.metric], -rule.candidates.index(name)))


def decide(challenger: dict[str, float], champion: dict[str, float] | None, rule: RegistryParams,
           test: PairedTest | None = None) -> Decision:
    """The registry rule: the challenger replaces the champion only if it stays within ``max_kl`` of the
    SFT reference, beats the champion's ``metric`` by at least ``min_improvement``, and the paired test over the
    evaluation prompts (``test``, challenger minus champion) gives a p-value below ``significance``.

    Both dicts must be scores on the same evaluation set (the caller re-scores the champion when not)."""
    m, unit = rule.metric, paired_unit(rule)
    if challenger["kl"] > rule.max_kl:
        return Decision(False, f"challenger KL {challenger['kl']:.3f} exceeds registry.max_kl {rule.max_kl}")
    if champion is None:
        return Decision(True, f"no champion yet; challenger {m}={challenger[m]:.4f}")
    kl_change = kl_versus_champion(challenger, champion, rule)
    if "kl" in champion and challenger["kl"] - champion["kl"] > rule.max_kl_increase:
        return Decision(False, f"{kl_change} exceeds registry.max_kl_increase {rule.max_kl_increase}")
    gain = challenger[m] - champion[m]
    versus = f"{m} {challenger[m]:.4f} vs champion {champion[m]:.4f}: gain {gain:+.4f}; {kl_change}"
    if gain < rule.min_improvement:
        return Decision(False, f"{versus} < min_improvement {rule.min_improvement}")
    if test is None:
        raise ValueError("decide: a challenger that beats the champion needs the paired test over the prompts")
    noise = f"paired test over {test.n} {unit}: p={test.p_value:.4f}, 95% CI [{test.low:+.4f}, {test.high:+.4f}]"
    if test.p_value >= rule.significance:
        return Decision(False, f"{versus}, but not beyond the evaluation's noise ({noise} >= significance "
                               f"{rule.significance})")
    return Decision(True, f"{versus} (>= min_improvement {rule.min_improvement}; {noise} < significance "
                          f"{rule.significance})")


def kl_versus_champion(challenger: dict[str, float], champion: dict[str, float], rule: RegistryParams) -> str:
    """The KL change the gate reports: the challenger's KL to the SFT reference against the champion's."""
    if "kl" not in champion:
        return f"KL {challenger['kl']:.3f} (the champion's KL is not recorded)"
    change = challenger["kl"] - champion["kl"]
    return f"KL {challenger['kl']:.3f} vs champion {champion['kl']:.3f}: {change:+.3f} (limit +{rule.max_kl_increase:g})"


def paired_unit(rule: RegistryParams) -> str:
    """What the paired test resamples: ``problems`` for a verifiable task's ``pass@1``, else ``prompts``."""
    return "problems" if rule.metric in VERIFIED_METRICS else "prompts"


def problem_values(policy_pass: dict[str, float], problems: list[str], where: str) -> list[float]:
    """One policy's c/n of each of ``problems``, in that order (a ``ValueError`` naming ``where`` when one is
    missing: the two sides of the paired test must be the same problems)."""
    missing = [q for q in problems if q not in policy_pass]
    if missing or len(policy_pass) != len(problems):
        raise ValueError(f"{where}: the policies were not scored on the same problems (first missing: "
                         f"{missing[:1] or sorted(set(policy_pass) - set(problems))[:1]}): run the evaluate stage again")
    return [policy_pass[q] for q in problems]


def prompt_values(metric: str, scores: PromptScores, sft_gold: list[float]) -> list[float]:
    """The per-prompt values whose mean is ``metric`` (``registry.metric``): gold or reward-model score, or for
    ``win_rate`` 1 / 0.5 / 0 as the policy's sample beats, ties or loses to SFT's on that prompt."""
    if metric == "gold_reward":
        return list(scores.gold)
    if metric == "rm_reward":
        return list(scores.rm)
    if metric == "win_rate":
        return [win_rate([g], [b]) for g, b in zip(scores.gold, sft_gold)]
    raise ValueError(f"registry.metric {metric!r} has no per-prompt values")


def paired_test(challenger: list[float], champion: list[float], rule: RegistryParams) -> PairedTest:
    """Challenger minus champion, unit by unit (prompt, or problem for ``pass@1``), on ``rule.metric``
    (``paired_bootstrap``)."""
    return paired_bootstrap(challenger, champion, samples=rule.bootstrap_samples, seed=rule.seed)


def pinned_requirements() -> list[str]:
    """``name==version`` of each package in :data:`REQUIREMENTS` (local labels such as ``+cpu`` dropped)."""
    return [f"{name}=={installed_version(name).split('+')[0]}" for name in REQUIREMENTS]


# --------------------------------------------------------------------------------------------
# reading the registry
# --------------------------------------------------------------------------------------------


def _alias_version(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException  # mlflow: only when the registry step runs

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None


def _versions(client, name: str, tags: dict[str, str]) -> list:
    """Versions of ``name`` whose tags include ``tags``, oldest first."""
    from mlflow.exceptions import MlflowException  # mlflow: only when the registry step runs

    try:
        found = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return []
    return sorted((v for v in found if all(v.tags.get(k) == val for k, val in tags.items())),
                  key=lambda v: int(v.version))


def _metrics_from_tags(tags: dict[str, str], prefix: str = "metric.") -> dict[str, float]:
    """Every ``<prefix><metric>`` tag as a number (the sentiment task's METRIC_KEYS, or a verifiable task's pass@k)."""
    return {metric_of_key(k.removeprefix(prefix)): float(v) for k, v in tags.items() if k.startswith(prefix)}


def metric_keys(metrics: dict) -> list[str]:
    """The metrics in display order: METRIC_KEYS' first (the sentiment task's), then the others as recorded."""
    return [*(k for k in METRIC_KEYS if k in metrics), *(k for k in metrics if k not in METRIC_KEYS)]


def _evaluation_run_id(client, experiment_id: str, evaluation_md5: str, policy: str, weights_md5: str) -> str:
    """The latest finished ``evaluate`` run that scored these weights on this set ("unknown" if none)."""
    runs = client.search_runs([experiment_id], filter_string=(
        f"tags.`rlhf.stage` = 'evaluate' and tags.`evaluation.set_md5` = '{evaluation_md5}' "
        f"and tags.`evaluation.scored.{policy}` = '{weights_md5}' and attributes.status = 'FINISHED'"),
        order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else "unknown"


def _run_link(experiment_id: str, lineage: dict[str, str]) -> str:
    run_id = lineage["evaluation.run_id"]
    return f"[{run_id[:8]}](#/experiments/{experiment_id}/runs/{run_id})" if run_id != "unknown" else "unknown"


def _data_hashes(root: Path, paths: PathsParams, policy: str) -> dict[str, str]:
    """DVC hash (dvc.lock's, else computed) of every input of the policy's stage and of the evaluation."""
    deps = [*BY_NAME[policy].io(paths).deps.values(), *BY_NAME[EVALUATE].io(paths).deps.values()]
    return input_hashes(root, list(dict.fromkeys(deps)))


def current_evaluation_set(root: Path, params: Params) -> EvaluationSet:
    """The evaluation set of the project in ``root`` as its evaluate stage would score against it now."""
    return load_evaluation_set(root, params.evaluate, BY_NAME[EVALUATE].io(params.paths).deps)


def _model_dir(root: Path, paths: PathsParams, policy: str) -> Path:
    """The weights directory of ``policy`` (``models/<policy>``: its stage's output)."""
    return root / BY_NAME[policy].io(paths).outs["model"]


# --------------------------------------------------------------------------------------------
# the champion's numbers on this evaluation set
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Champion:
    """The version holding ``champion``, scored on the challenger's evaluation set."""

    version: object
    """The MLflow ``ModelVersion``."""
    metrics: dict[str, float]
    """Its metrics on that set."""
    values: list[float]
    """Its value of ``registry.metric`` per prompt (per problem for ``pass@1``) of that set, in the challenger's
    order (for the paired test)."""
    rescored: bool
    """Whether it was scored now (else its scores come from this evaluation, which scored the same weights)."""


def _champion_on(client, params: Params, root: Path, challenger: "Challenger") -> Champion | None:
    """The champion (None when there is none yet) with its metrics and per-prompt scores on the challenger's
    evaluation set: read from this evaluation when it scored the champion's weights, else re-scored now."""
    rule = params.registry
    champion = _alias_version(client, rule.model_name, CHAMPION)
    if champion is None:
        return None
    evaluation_md5 = challenger.evaluation_md5
    if champion.tags.get("evaluation.set_md5") == evaluation_md5:
        metrics = _metrics_from_tags(champion.tags)
        same = [n for n, md5 in challenger.evaluated.items() if md5 == champion.tags.get("lineage.weights_md5")]
        if rule.metric in metrics and "kl" in metrics and same and same[0] in challenger.values:
            return Champion(champion, metrics, challenger.values[same[0]], False)
    from tasks.serving.answer import load_weights  # mlflow: only when the registry step runs

    get_logger().info("registry: champion v%s (scored on evaluation set %s) is not among the policies this evaluation "
                      "scored: re-scoring it on set %s", champion.version,
                      champion.tags.get("evaluation.set_md5", "(none recorded)")[:8], evaluation_md5[:8])
    uri = f"models:/{rule.model_name}/{champion.version}"
    try:
        model, _ = load_weights(uri)
    except Exception as error:  # noqa: BLE001 - named and re-raised: never compared blindly
        raise RuntimeError(f"registry: champion {uri} cannot be loaded to re-score it on the current evaluation "
                           f"set ({error}); move or delete the alias `{CHAMPION}` of {rule.model_name}") from error
    if rule.metric in VERIFIED_METRICS:
        metrics, values = _rescore_problems(model, root, params, challenger)
        return Champion(champion, metrics, values, True)
    evaluation = current_evaluation_set(root, params)
    _same_set(evaluation_md5, evaluation.md5)
    metrics, scores = rescore(model, evaluation)
    return Champion(champion, metrics, prompt_values(rule.metric, scores, challenger.prompt_scores["sft"].gold), True)


def _same_set(recorded: str, now: str) -> None:
    if recorded != now:
        raise RuntimeError(f"the evaluation set changed since evaluate ran ({recorded[:8]} in evaluate.json, "
                           f"{now[:8]} now): run the evaluate stage again")


def _rescore_problems(model, root: Path, params: Params, challenger: "Challenger") -> tuple[dict, list[float]]:
    """The champion on a verifiable task's evaluation problems, sampled and judged as evaluate does (its seed, n and
    ks): its metrics and its c/n per problem in the challenger's order."""
    io, p = BY_NAME[EVALUATE].io(params.paths), params.evaluate
    _same_set(challenger.evaluation_md5, content_md5(root / io.deps["prompts_eval"]))
    rows = read_jsonl(root / io.deps["prompts_eval"])[: p.num_prompts]
    sft = root / BY_NAME["sft"].io(params.paths).outs["model"]
    tokenizer, reference = load_tokenizer(sft), load_policy(sft)
    metrics, verdicts = score_policy_samples(model, reference, tokenizer, rows, solutions_of(rows, io.deps["prompts_eval"]),
                                             params.task.samples_per_problem, list(params.task.pass_k), p)
    rates = problem_pass([{"policy": "champion", **row} for row in verdicts])["champion"]
    return metrics, problem_values(rates, challenger.units, "the champion re-scored")


# --------------------------------------------------------------------------------------------
# writing the registry
# --------------------------------------------------------------------------------------------


def _model_card(policy: str, weights: Path, lineage: dict[str, str]):
    """The Hugging Face ``ModelCard`` logged with the model: the stage's README.md plus where the weights come
    from (per-evaluation decisions live on the registered versions: one model may be registered several times)."""
    from huggingface_hub import ModelCard  # huggingface_hub: only when a model is logged

    card_file = weights / "README.md"
    text = card_file.read_text(encoding="utf-8") if card_file.exists() else (
        f"---\nlibrary_name: rlhf_core\n---\n# rlhf-{policy}\n")
    text += "\n## Registry\n\n| tag | value |\n|---|---|\n" + "".join(
        f"| {k} | {str(v).replace('|', '/')} |\n" for k, v in lineage.items()
        if k.startswith(("lineage.", "dvc.")))
    return ModelCard(text)


def _log_model(rule: RegistryParams, policy: str, weights: Path, card) -> tuple[str, str]:
    """Log the policy as the project's MLflow Model of a version (``tasks/registry/policy_pyfunc.py``); (model uri, model id)."""
    from tasks.registry.policy_pyfunc import log_policy_model  # mlflow and transformers: only when a model is logged

    return log_policy_model(policy, weights, card, rule.model_name, pinned_requirements())


def _link_logged_model(client, version) -> None:
    """Record the version on its MLflow Model (what ``mlflow.register_model`` does: the UI then shows the
    model as registered, with a link to the version). Safe to repeat."""
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_VERSIONS  # mlflow: only when the registry step runs

    model_id = version.source.removeprefix("models:/")
    links = json.loads(client.get_logged_model(model_id).tags.get(MLFLOW_MODEL_VERSIONS) or "[]")
    entry = {"name": version.name, "version": int(version.version)}
    if entry not in links:
        client.set_logged_model_tags(model_id, {MLFLOW_MODEL_VERSIONS: json.dumps([*links, entry])})


def _complete(client, rule: RegistryParams, version) -> None:
    """Link the MLflow Model, set the aliases the version's recorded decision asks for, then mark the version
    complete (each step safe to repeat)."""
    _link_logged_model(client, version)
    client.set_registered_model_alias(rule.model_name, CHALLENGER, version.version)
    if version.tags.get("decision") == "promote":
        client.set_registered_model_alias(rule.model_name, CHAMPION, version.version)
    client.set_model_version_tag(rule.model_name, version.version, "registry.state", COMPLETE)


def describe(policy: str, decision: Decision, rule: RegistryParams, challenger: dict[str, float],
             champion: Champion | None, test: PairedTest | None, lineage: dict[str, str],
             evaluation_link: str) -> str:
    """The version's description (markdown, what the MLflow UI shows first): the decision, the numbers behind
    it side by side (the paired test's row included), and where the weights, data and evaluation come from."""
    verdict = "promoted to champion" if decision.promote else "kept as challenger (champion unchanged)"
    lines = [f"{policy}: {verdict}. {decision.reason}.", ""]  # plain: the versions list shows it as text
    if champion is not None:
        how = "re-scored now on this evaluation set" if champion.rescored else "as scored on this evaluation set"
        lines += [f"| metric | this version | champion v{champion.version.version} ({how}) |", "|---|---|---|"]
        lines += [f"| {'**' + k + '**' if k == rule.metric else k} | {challenger[k]} | {champion.metrics.get(k, '-')} |"
                  for k in metric_keys(challenger)]
        if test is not None:
            lines.append(f"| paired test ({rule.metric}, {test.n} {paired_unit(rule)}) | gain {test.gain:+.4f}, 95% CI "
                         f"[{test.low:+.4f}, {test.high:+.4f}] | p = {test.p_value:.4f} (significance "
                         f"{rule.significance}) |")
    else:
        lines += ["| metric | this version |", "|---|---|"] + [f"| {k} | {challenger[k]} |"
                                                               for k in metric_keys(challenger)]
    lines += ["", f"Rule: `{rule.metric}` must beat the champion by `min_improvement={rule.min_improvement}` on the "
                  f"same evaluation set, with a paired bootstrap p-value over its {paired_unit(rule)} below "
                  f"`significance={rule.significance}` and `kl <= {rule.max_kl}`.", "",
              f"Lineage: git `{lineage['lineage.git_commit'][:12]}`; weights `{lineage['lineage.weights_md5']}`; "
              f"evaluation set `{lineage['evaluation.set_md5']}`; evaluation run {evaluation_link}. "
              "DVC hashes of the data: the `dvc.*` tags. Model card: `policy/README.md` in the Source Model's artifacts; "
              f"serve with `mlflow models serve -m models:/{rule.model_name}@champion --env-manager local` (a trace "
              "per answer), or load the weights with `tasks.serving.answer.load_weights`."]
    return "\n".join(lines)


def _record(rule: RegistryParams, version, registered: bool, reason: str | None = None) -> dict:
    tags = version.tags
    previous = tags.get("champion.version")
    record = {"registered": registered, "model": rule.model_name, "version": int(version.version),
              "policy": tags.get("policy"), "decision": tags.get("decision"), "reason": reason or tags.get("reason"),
              "decided_by": rule.metric,
              "previous_champion": int(previous) if previous else None,
              f"challenger_{rule.metric}": float(tags.get(f"metric.{mlflow_key(rule.metric)}", "nan"))}
    if not registered:  # the version's decision is an earlier run's: this run decided and registered nothing
        record["earlier_decision"], record["decision"] = record["decision"], "none"
    return record



# --------------------------------------------------------------------------------------------
# the registry step, in named steps
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Challenger:
    """The evaluated policy to register, as ``evaluate`` scored it."""

    name: str
    """The policy (stage) name, e.g. ``ppo``: the best of ``registry.candidates`` by ``registry.metric``."""
    weights: Path
    """Its weights directory (``paths.models``/name)."""
    weights_md5: str
    """Content hash of the weights, equal to the one ``evaluate`` scored."""
    evaluation_md5: str
    """Hash of the evaluation set it was scored on."""
    metrics: dict[str, float]
    """Its metrics on that evaluation set (``metrics/evaluate.json``)."""
    evaluated: dict[str, str]
    """Every policy that evaluation scored (``sft`` included) -> the content hash of the weights it scored."""
    prompt_scores: dict[str, PromptScores]
    """Their per-prompt scores (``data/evaluate_prompts.csv``; the sentiment task only, else empty)."""
    values: dict[str, list[float]]
    """Each of them: its value of ``registry.metric`` per evaluation unit (prompt; problem for ``pass@1``), in
    ``units``' order: one side of the paired test."""
    units: list[str]
    """The units, in that order: prompt indices, or problem ids."""


def _load_challenger(root: Path, rule: RegistryParams, paths: PathsParams) -> Challenger:
    """Read ``metrics/evaluate.json`` and the per-prompt scores, pick the challenger and check its weights are
    the ones evaluate scored."""
    evaluation_path = evaluation_file(root, paths)
    if not evaluation_path.exists():
        raise FileNotFoundError(f"{evaluation_path}: run the evaluate stage before the registry step")
    evaluation = json.loads(evaluation_path.read_text())
    scored = evaluation.get(SCORED_KEY)
    if not scored:
        raise ValueError(f"{evaluation_path}: no `{SCORED_KEY}` hashes (written by an older evaluate): run the "
                         "evaluate stage again before the registry step")
    results = policy_results(evaluation)
    name = pick_challenger(results, rule)
    weights = _model_dir(root, paths, name)
    weights_md5 = content_md5(weights)
    if weights_md5 != scored["policies"].get(name):
        raise WeightsMismatchError(
            f"{weights}: its content hash {weights_md5} is not the {scored['policies'].get(name)} that evaluate "
            f"scored ({evaluation_path}); nothing registered. Run the evaluate stage again (`python -m flows.pipeline`)")
    prompts_path = root / BY_NAME[EVALUATE].io(paths).outs["prompt_scores"]
    if rule.metric in VERIFIED_METRICS:
        values, units = _problem_values(prompts_path, name)
        prompt_scores = {}
    else:
        prompt_scores = read_prompt_scores(prompts_path)
        if not {name, "sft"} <= set(prompt_scores):
            raise ValueError(f"{prompts_path}: no per-prompt scores of {name} and sft (missing, or written by an older "
                             "evaluate): run the evaluate stage again before the registry step")
        sft_gold = prompt_scores["sft"].gold
        values = {n: prompt_values(rule.metric, s, sft_gold) for n, s in prompt_scores.items()}
        units = [str(i) for i in range(len(sft_gold))]
    return Challenger(name, weights, weights_md5, scored["evaluation_set"], results[name], scored["policies"],
                      prompt_scores, values, units)


def _problem_values(verdicts: Path, name: str) -> tuple[dict[str, list[float]], list[str]]:
    """Every evaluated policy's c/n per problem from evaluate's verdict file, in the challenger's problem order."""
    rates = read_problem_pass(verdicts)
    if name not in rates:
        raise ValueError(f"{verdicts}: no verdicts of {name} (missing, or written by an older evaluate): run the "
                         "evaluate stage again before the registry step")
    units = list(rates[name])
    return {policy: problem_values(r, units, f"{verdicts} ({policy})") for policy, r in rates.items()}, units


def _finish_earlier_attempt(client, rule: RegistryParams, challenger: Challenger) -> dict | None:
    """The record of the version already registered for these weights on this evaluation set (completing it
    first when an earlier attempt stopped half-way), or None when there is none."""
    existing = _versions(client, rule.model_name, {"lineage.weights_md5": challenger.weights_md5,
                                                     "evaluation.set_md5": challenger.evaluation_md5})
    if not existing:
        return None
    log, version = get_logger(), existing[-1]
    if version.tags.get("registry.state") != COMPLETE:
        log.warning("registry: %s v%s was created but not completed (decision %s): completing it",
                    rule.model_name, version.version, version.tags.get("decision"))
        _complete(client, rule, version)
        return _record(rule, client.get_model_version(rule.model_name, version.version), True)
    log.info("registry: %s weights %s on evaluation set %s already registered as v%s; nothing to do",
             challenger.name, challenger.weights_md5[:8], challenger.evaluation_md5[:8], version.version)
    record = _record(rule, version, False, "already registered for this evaluation")
    record["is_champion"] = _holds_champion(client, rule, version)  # (the end block marks it)
    return record


def _holds_champion(client, rule: RegistryParams, version) -> bool:
    """Whether ``version`` holds the ``champion`` alias now."""
    from mlflow.exceptions import MlflowException  # mlflow: only when the registry step runs

    try:
        return client.get_model_version_by_alias(rule.model_name, "champion").version == version.version
    except MlflowException:  # no champion yet
        return False


def _lineage(client, root: Path, paths, experiment_id: str, challenger: Challenger) -> dict[str, str]:
    """Lineage tags: git commit, weights and evaluation-set hashes, the evaluation run, DVC hashes of the data."""
    c = challenger
    return {"lineage.git_commit": git_commit(root), "lineage.weights_md5": c.weights_md5,
            "evaluation.set_md5": c.evaluation_md5,
            "evaluation.run_id": _evaluation_run_id(client, experiment_id, c.evaluation_md5, c.name, c.weights_md5),
            **{f"dvc.{k}": v for k, v in _data_hashes(root, paths, c.name).items()}}


def _decision_tags(challenger: Challenger, decision: Decision, rule: RegistryParams, champion: Champion | None,
                   test: PairedTest | None) -> dict[str, str]:
    """Decision tags: policy, promote/keep and why, the rule, both sides' metrics and the paired test."""
    tags = {"policy": challenger.name, "decision": "promote" if decision.promote else "keep", "decided_by": rule.metric,
            "reason": decision.reason, "rule": json.dumps(as_dict(rule), sort_keys=True),
            **{f"metric.{mlflow_key(k)}": str(v) for k, v in challenger.metrics.items()}}
    if champion is not None:
        tags.update({"champion.version": champion.version.version, "champion.rescored": str(champion.rescored).lower(),
                     **{f"champion.metric.{mlflow_key(k)}": str(v) for k, v in champion.metrics.items()}})
    if test is not None:
        tags.update({"test.kind": "paired_bootstrap", "test.metric": rule.metric, "test.prompts": str(test.n),
                     "test.unit": paired_unit(rule),
                     "test.gain": f"{test.gain:.6f}", "test.ci95_low": f"{test.low:.6f}",
                     "test.ci95_high": f"{test.high:.6f}", "test.p_value": f"{test.p_value:.6f}",
                     "test.significance": str(rule.significance)})
    return tags


def _model_source(client, rule: RegistryParams, challenger: Challenger, lineage: dict[str, str]) -> tuple[str, str]:
    """(model uri, model id) to register: the policy MLflow Model logged for the same weights on another evaluation
    set when there is one, else a newly logged one (a transformers-flavour model of an older version is not re-used:
    it would record no traces when served)."""
    from tasks.registry.policy_pyfunc import is_policy_model  # mlflow: only when the registry step runs

    same_weights = _versions(client, rule.model_name, {"lineage.weights_md5": challenger.weights_md5})
    reusable = [v.source for v in same_weights if v.source.startswith("models:/m-")
                and is_policy_model(client, v.source.removeprefix("models:/"))]
    if reusable:  # scored on another set: re-use
        return reusable[-1], reusable[-1].removeprefix("models:/")
    card = _model_card(challenger.name, challenger.weights, lineage)
    return _log_model(rule, challenger.name, challenger.weights, card)


def _register_version(client, rule: RegistryParams, run_id: str | None, source: str, model_id: str,
                      tags: dict[str, str], description: str):
    """Create the registered model if needed and a new ``pending`` version; set its aliases; mark it complete."""
    from mlflow.exceptions import MlflowException  # mlflow: only when the registry step runs

    try:
        client.create_registered_model(rule.model_name, description="RLHF policies evaluated by the pipeline; "
                                       "`champion` = the current best, `challenger` = the latest registered")
    except MlflowException:
        pass  # exists
    version = client.create_model_version(rule.model_name, source=source, run_id=run_id or None, model_id=model_id,
                                          tags={**tags, "registry.state": PENDING}, description=description)
    _complete(client, rule, version)
    return version


def _tag_run(client, run, decision_tags: dict[str, str], decision: Decision, version, champion_version) -> None:
    """Tag the registry's MLflow run (when there is one) with the outcome, and put it in the stage summary."""
    run_tags = {"registry.decision": decision_tags["decision"], "registry.reason": decision.reason,
                "registry.version": version.version,
                "registry.previous_champion": champion_version.version if champion_version else "none",
                **{f"registry.{k}": v for k, v in decision_tags.items() if k.startswith("test.")}}
    for key, value in run_tags.items() if run.run_id else ():
        client.set_tag(run.run_id, key, value)
    run.summary.update(run_tags)


@task(name="registry", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE)
def registry_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Register the evaluated challenger; move ``champion`` if it wins. Returns the decision record."""
    require_single_process("registry", LAUNCHABLE, "`python -m flows.pipeline` (it runs the registry step after "
                           "evaluate)")
    from mlflow import MlflowClient  # mlflow: only when the step runs

    root = Path(root).resolve()
    params = load_params(root / PARAMS_FILE)
    rule, paths = params.registry, params.paths
    problem = store_problem(root)
    if problem:  # the registry lives in the store: nothing to spool, run it again later
        get_logger().warning("registry: nothing registered: %s. Run `python -m flows.pipeline` again when the store "
                             "is back (trained stages are not re-run).", redact(problem))
        return {"registered": False, "reason": "tracking store unavailable"}
    challenger = _load_challenger(root, rule, paths)
    experiment_id = mlflow_setup(root)
    client = MlflowClient()
    done = _finish_earlier_attempt(client, rule, challenger)
    if done is not None:
        return done
    champion = _champion_on(client, params, root, challenger)
    test = None if champion is None else paired_test(challenger.values[challenger.name], champion.values, rule)
    decision = decide(challenger.metrics, champion.metrics if champion else None, rule, test)
    lineage = _lineage(client, root, paths, experiment_id, challenger)
    feedback = feedback_lineage(root, paths, stage_files(paths), challenger.name)  # the batches, traces and judgements that taught it
    decision_tags = _decision_tags(challenger, decision, rule, champion, test)
    deps = [metrics_file(paths, EVALUATE), BY_NAME[challenger.name].io(paths).outs["model"]]
    with stage_run("registry", root, rule, deps, parent_run_id) as run:
        source, model_id = _model_source(client, rule, challenger, lineage)
        description = describe(challenger.name, decision, rule, challenger.metrics, champion, test, lineage,
                               _run_link(experiment_id, lineage))
        version = _register_version(client, rule, run.run_id, source, model_id,
                                    {**lineage, **feedback_tags(feedback), **decision_tags}, description)
        if run.run_id:
            client.log_dict(run.run_id, feedback, LINEAGE_FILE)
        _tag_run(client, run, decision_tags, decision, version, champion.version if champion else None)
    record = _record(rule, client.get_model_version(rule.model_name, version.version), True)
    get_logger().info("registry: %s v%s (%s) -> %s: %s", rule.model_name, version.version, challenger.name,
                      record["decision"], decision.reason)
    return record
