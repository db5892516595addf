"""Stage ``evaluate``: compare SFT and every enabled policy (ppo, dpo, grpo, rloo, kto) on held-out prompts.

A disabled policy stage's placeholder (``tasks.policy.is_placeholder``) is skipped: it has no entry in the results.

Per policy: mean gold-judge sentiment (VADER compound, -1..1), mean learned-reward score, KL to the SFT
reference, perplexity on held-out text, win rate against SFT under the gold judge. Writes
``metrics/evaluate.json`` (one object per policy: gold_reward, rm_reward, kl, perplexity, win_rate; what
``dvc metrics show/diff`` read), ``plots/evaluate.csv``, and logs before/after sample tables and a chart.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from rlhf_core.data import read_jsonl
from tasks.distributed import require_single_process
from tasks.logs import get_logger
from tasks.outputs import write_csv, write_json
from tasks.params import METRIC_KEYS, POLICY_STAGES, load_stage
from tasks.policy import is_placeholder
from tasks.stage_run import stage_run


def _chart(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, key in zip(axes, ("gold_reward", "kl", "win_rate")):
        ax.bar(list(results), [results[p][key] for p in results], color=["#888", "#2a7", "#27a"])
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_task(root: str = ".", parent_run_id: str | None = None) -> dict:
    """Evaluate every policy; returns the content of metrics/evaluate.json."""
    import tempfile

    require_single_process("evaluate")  # not a training stage: one process (see tasks/distributed.py)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.evaluation import evaluate_policy
    from rlhf_core.rewards import GoldJudge, RewardModelScorer

    root, params, p, io = load_stage(root, "evaluate")
    paths = params.paths
    prompts_path, heldout_path, sft_dir, rm_dir, *policy_dirs = io["deps"]  # then models/<stage> per POLICY_STAGES
    trained = {s: d for s, d in zip(POLICY_STAGES, policy_dirs) if not is_placeholder(root / d)}
    names = ("sft", *trained)  # the policies of this run, in order
    log = get_logger()
    prompts = [r["query"] for r in read_jsonl(root / prompts_path)][: p.num_prompts]
    heldout = [r["text"] for r in read_jsonl(root / heldout_path)]
    if not prompts or not heldout:
        raise ValueError(f"{prompts_path} / {heldout_path}: need held-out prompts and texts")

    with stage_run("evaluate", root, p, io["deps"], parent_run_id) as run:
        tokenizer = AutoTokenizer.from_pretrained(root / sft_dir, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        reference = AutoModelForCausalLM.from_pretrained(root / sft_dir)
        policies = {"sft": reference, **{s: AutoModelForCausalLM.from_pretrained(root / d) for s, d in trained.items()}}
        log.info("evaluate: %s (disabled, skipped: %s)", ", ".join(names),
                 ", ".join(s for s in POLICY_STAGES if s not in trained) or "none")
        gold, learned = GoldJudge(), RewardModelScorer(str(root / rm_dir), batch_size=p.batch_size)
        run.log_dataset(root / prompts_path, "prompts_eval", context="eval")
        run.log_dataset(root / heldout_path, "heldout", context="eval")
        results, samples, gold_scores = {}, {}, {}
        for name in names:
            metrics, samples[name], gold_scores[name] = evaluate_policy(
                policies[name], reference, tokenizer, prompts, heldout, gold, learned,
                baseline_gold=gold_scores.get("sft"), max_new_tokens=p.max_new_tokens, batch_size=p.batch_size,
                seed=p.seed)
            results[name] = {k: round(float(metrics[k]), 4) for k in METRIC_KEYS}
            log.info("evaluate %s: %s", name, ", ".join(f"{k}={v}" for k, v in results[name].items()))
            run.log_metrics({f"{name}/{k}": v for k, v in results[name].items()})
        write_json(root / paths.metrics / "evaluate.json", results)
        write_csv(root / paths.plots / "evaluate.csv", [{"policy": n, **results[n]} for n in names],
                  ["policy", *METRIC_KEYS])
        # before/after: the same prompt, the SFT response, then each optimised policy's
        rows = [{"prompt": prompts[i],
                 **{f"{n}_response": samples[n].responses[i] for n in names},
                 **{f"{n}_gold": round(gold_scores[n][i], 3) for n in names}} for i in range(min(p.num_samples, len(prompts)))]
        run.log_table("before_after", rows)
        for n in names:
            run.log_table(f"samples_{n}", [{"query": q, "response": r, "gold": round(g, 3)} for q, r, g in
                                           zip(samples[n].prompts, samples[n].responses, gold_scores[n])][: 4 * p.num_samples])
        with tempfile.TemporaryDirectory() as tmp:
            _chart(results, Path(tmp) / "evaluate.png")
            run.log_artifact(Path(tmp) / "evaluate.png", artifact_path="plots")
        for n in trained:
            run.summary[f"{n}_gold_gain"] = round(results[n]["gold_reward"] - results["sft"]["gold_reward"], 4)
        run.summary.update({f"{n}.{k}": v for n in names for k, v in results[n].items()})
    return results
