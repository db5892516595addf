"""``evaluate`` for a verifiable task (``arithmetic``, ``problems``): ``task.samples_per_problem`` samples of every
held-out problem from SFT and each trained policy, judged by the verifier.

Per policy (``metrics/evaluate.json``): ``pass@1`` (the mean of c/n), unbiased ``pass@k`` and ``maj@k`` for each k
of ``task.pass_k``, ``format_error_rate``, ``mean_length`` (completion tokens) and ``kl`` to SFT
(``rlhf_core.evaluation.verify_samples``, ``kl_to_reference``). The verdict of every sample is the stage's
versioned output (``data/evaluate_prompts.csv``, DVC-cached): one row per policy, problem and sample with the
completion, the answer as written, and whether it is correct and well formatted; MLflow gets the same rows as
sample tables. Sampling is seeded (``evaluate.seed``): every policy meets the same random stream.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from rlhf_core.data import read_jsonl
from rlhf_core.evaluation import kl_to_reference, sample_responses, verify_samples
from tasks.process.logs import get_logger
from tasks.spec.stage import StageContext, StageResult
from tasks.spec.task import task_of
from tasks.stages.common.chat_prompts import render_queries
from tasks.stages.common.problems import solutions_of
from tasks.stages.common.scoring import (FRONTIER_COLUMNS, SCORED_KEY, content_md5, frontier_rows, load_policy,
                                         load_tokenizer, read_windows)
from tasks.store.outputs import write_atomic
from tasks.store.placeholders import is_placeholder

VERDICT_COLUMNS = ("policy", "problem_id", "sample", "solution", "answer", "correct", "format_ok", "length",
                   "completion")
"""``data/evaluate_prompts.csv`` for a verifiable task: one row per policy, problem and sample."""


def write_verdicts(path: Path, rows: list[dict]) -> None:
    """The verdict rows as CSV with every field quoted: a sampled completion may hold any character (a carriage
    return, a quote), and a quoted field keeps it exactly for ``csv.DictReader``."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(VERDICT_COLUMNS), quoting=csv.QUOTE_ALL, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, buf.getvalue())


def problem_pass(verdicts: list[dict]) -> dict[str, dict[str, float]]:
    """policy -> problem id -> c/n (that problem's pass@1: the share of its samples judged correct), problems in
    the order the verdict rows first name them: what the registry's paired test over problems compares."""
    counts: dict[str, dict[str, list[int]]] = {}
    for row in verdicts:
        c_n = counts.setdefault(row["policy"], {}).setdefault(str(row["problem_id"]), [0, 0])
        c_n[0] += str(row["correct"]) in ("True", "true", "1")
        c_n[1] += 1
    return {policy: {problem: c / n for problem, (c, n) in problems.items()} for policy, problems in counts.items()}


def read_problem_pass(path: Path) -> dict[str, dict[str, float]]:
    """:func:`problem_pass` of a verdict file :func:`write_verdicts` wrote (empty when there is none)."""
    if not path.is_file():
        return {}
    with path.open(newline="", encoding="utf-8") as f:
        return problem_pass(list(csv.DictReader(f)))


def score_policy_samples(policy: Any, reference: Any, tokenizer: Any, rows: list[dict], solutions: list[str],
                         n: int, ks: list[int], p: Any) -> tuple[dict[str, float], list[dict]]:
    """One policy's metrics and verdict rows on the problems ``rows`` (n samples each)."""
    prompts = render_queries(tokenizer, [r["query"] for r in rows], "the evaluation problems")  # a chat: templated
    samples = sample_responses(policy, tokenizer, [q for q in prompts for _ in range(n)], p.max_new_tokens,
                               p.batch_size, p.seed)
    groups = range(len(prompts))
    report = verify_samples([str(r.get("id", i)) for i, r in enumerate(rows)], solutions,
                            [samples.responses[i * n:(i + 1) * n] for i in groups],
                            [[len(ids) for ids in samples.response_ids[i * n:(i + 1) * n]] for i in groups], ks)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    kl = 0.0 if policy is reference else kl_to_reference(policy, reference, samples, pad_id, p.batch_size)
    metrics = {k: round(v, 6) for k, v in report.metrics.items()} | {"kl": round(kl, 6)}
    return metrics, report.verdicts


def body(ctx: StageContext) -> StageResult:
    """Score SFT and every trained policy on the held-out problems (see the module docstring). The verifier is the
    gold judge here: evaluate's bar chart draws each policy's pass@1 as its gold reward, and the frontier plots it
    against KL to SFT, with the windows of the stages that sample along training (one verified sample per problem:
    ``tasks/stages/common/samples.py``)."""
    task, p, run, log = task_of(ctx.params), ctx.section, ctx.run, get_logger()
    rows = read_jsonl(ctx.dep("prompts_eval"))[: p.num_prompts]
    solutions = solutions_of(rows, ctx.io.deps["prompts_eval"])  # checked before any model is loaded
    dirs = {name: d for name, d in ctx.io.group("policy").items() if name == "sft" or not is_placeholder(ctx.root / d)}
    scored = {name: content_md5(ctx.root / d) for name, d in dirs.items()}
    tokenizer = load_tokenizer(ctx.root / dirs["sft"])
    reference = load_policy(ctx.root / dirs["sft"])
    results, verdicts = {}, []
    for name, directory in dirs.items():
        policy = reference if name == "sft" else load_policy(ctx.root / directory)
        results[name], rows_of_policy = score_policy_samples(policy, reference, tokenizer, rows, solutions,
                                                             task.samples_per_problem, list(task.pass_k), p)
        verdicts += [{"policy": name, **row} for row in rows_of_policy]
        log.info("evaluate %s: %s", name, ", ".join(f"{k}={v}" for k, v in results[name].items()))
        run.log_metrics({f"{name}/{k}": v for k, v in results[name].items()})
        run.log_table(f"verdicts_{name}", [{k: row[k] for k in ("problem_id", "completion", "answer", "correct")}
                                           for row in rows_of_policy][: 4 * max(p.num_samples, 1)])
    write_verdicts(ctx.out("prompt_scores"), verdicts)
    record = {**results, SCORED_KEY: {"policies": scored, "evaluation_set": content_md5(ctx.dep("prompts_eval"))}}
    summary = {f"{n}_pass@1_gain": round(results[n]["pass@1"] - results["sft"]["pass@1"], 4) for n in results
               if n != "sft"}
    windows = {s: read_windows(ctx.root / f) for s, f in ctx.io.group("windows").items() if s in dirs}
    final = {n: {"kl": r["kl"], "gold_reward": r["pass@1"]} for n, r in results.items()}  # the verifier: gold
    bars = [{"policy": n, **final[n]} for n in results]  # evaluate's bar chart of gold reward: here pass@1
    return StageResult(record, bars,
                       plots={"frontier": (FRONTIER_COLUMNS, frontier_rows(final, windows))}, summary=summary)


__all__ = ["VERDICT_COLUMNS", "body", "problem_pass", "read_problem_pass", "score_policy_samples", "write_verdicts"]
