"""Stage ``label``: preference data for DPO and KTO on a verifiable task, from verifier-labelled samples of the SFT
policy.

``label.samples_per_problem`` completions of each of the first ``label.num_problems`` training problems
(``data/prompts_train.jsonl``) are sampled from SFT through the sampler ``evaluate`` uses
(``rlhf_core.evaluation.sample_responses``, seeded by ``label.seed``) and judged by the verifier
(``rlhf_core.rewards.verify`` against each problem's ``solution``). The pairing rule is
``tasks/stages/common/verified_pairs.py``. Output ``data/labelled/`` (DVC-cached):

- ``preferences.jsonl``: ``{prompt, chosen, rejected, problem_id}`` (a conversational prompt as SFT's chat template
  renders it), a correct completion over an incorrect one of the same problem (``dpo``'s data under a verifiable task);
- ``ratings.jsonl``: ``{prompt, completion, label, problem_id}``, every distinct completion, label = correct
  (``kto``'s data);
- ``verdicts.jsonl``: every sample's ``{problem_id, sample, completion, answer, correct}``.

Under the sentiment task the stage writes placeholders, as a disabled stage does (its row serves the verifiable
tasks only), and ``dpo``/``kto`` train on prepare's gold-labelled data as before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.data import read_jsonl, write_jsonl
from rlhf_core.evaluation import sample_responses
from rlhf_core.rewards import verify
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.chat_prompts import render_queries
from tasks.stages.common.problems import solutions_of
from tasks.stages.common.scoring import load_policy, load_tokenizer
from tasks.stages.common.verified_pairs import preference_pairs, ratings, split_by_verdict
from tasks.store.outputs import atomic_dir

TASKS_SERVED = ("arithmetic", "problems")
"""The verifiable tasks: under another the stage writes placeholders."""
FILES = ("preferences.jsonl", "ratings.jsonl", "verdicts.jsonl")
"""The files of ``data/labelled/``."""


@dataclass(frozen=True)
class LabelParams:
    """Verifier-labelled samples of the SFT policy on the training problems: DPO pairs and KTO ratings."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("num_problems", "samples_per_problem", "max_new_tokens", "batch_size", "max_pairs_per_problem"))
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    num_problems: int
    """The first this many training problems are sampled (all of them when there are fewer)."""
    samples_per_problem: int
    """Completions sampled from SFT per problem (a problem gives pairs when some are correct and some not)."""
    max_new_tokens: int
    """Tokens sampled per completion."""
    batch_size: int
    """Generation batch size."""
    max_pairs_per_problem: int
    """At most this many DPO pairs per problem (the rule: tasks/stages/common/verified_pairs.py)."""
    seed: int
    """Sampling seed."""

    def problems(self, name: str) -> list[str]:
        """Two samples at least, or no problem could hold a correct and an incorrect one."""
        return [] if self.samples_per_problem >= 2 else [
            f"{name}.samples_per_problem must be >= 2 (a pair needs a correct and an incorrect sample)"]


COLUMNS = ("correct_samples", "problems")
"""plots/label.csv: how many problems have 0, 1, ... ``samples_per_problem`` correct samples."""
PLOT = dict(template="bars", title="Training problems by correct SFT samples (verifier)", x="correct_samples",
            y="problems")
"""DVC's options of ``plots/label.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def label_rows(rows: list[dict], solutions: list[str], completions: list[list[str]],
               max_pairs: int) -> tuple[dict[str, list[dict]], list[int]]:
    """The three files' rows (by file name) and each problem's count of correct samples, from the problems ``rows``,
    their ``solutions`` and each one's sampled ``completions``."""
    out: dict[str, list[dict]] = {name: [] for name in FILES}
    correct_counts = []
    for i, (row, solution, samples) in enumerate(zip(rows, solutions, completions)):
        problem_id = str(row.get("id", i))
        verdicts = [verify(c, solution) for c in samples]
        out["verdicts.jsonl"] += [{"problem_id": problem_id, "sample": s, "completion": c, "answer": v.answer,
                                   "correct": v.correct} for s, (c, v) in enumerate(zip(samples, verdicts))]
        labelled = split_by_verdict(samples, [v.correct for v in verdicts])
        out["preferences.jsonl"] += preference_pairs(row["query"], labelled, max_pairs, problem_id=problem_id)
        out["ratings.jsonl"] += ratings(row["query"], labelled, problem_id=problem_id)
        correct_counts.append(sum(bool(v.correct) for v in verdicts))
    return out, correct_counts


def summary_metrics(files: dict[str, list[dict]], correct_counts: list[int], n: int) -> dict[str, float | int]:
    """``metrics/label.json``: what was sampled and what it gave."""
    return {"problems": len(correct_counts), "samples": n * len(correct_counts),
            "correct_rate": round(sum(correct_counts) / max(n * len(correct_counts), 1), 6),
            "problems_with_both": sum(0 < c < n for c in correct_counts),
            "problems_all_correct": sum(c == n for c in correct_counts),
            "problems_none_correct": sum(c == 0 for c in correct_counts),
            "pairs": len(files["preferences.jsonl"]), "ratings": len(files["ratings.jsonl"]),
            "desirable": sum(r["label"] for r in files["ratings.jsonl"])}


def body(ctx: StageContext) -> StageResult:
    """Sample, verify and write ``data/labelled/`` (see the module docstring)."""
    p, log = ctx.section, get_logger()
    rows = read_jsonl(ctx.dep("prompts_train"))[: p.num_problems]
    if not rows:
        raise ValueError(f"{ctx.io.deps['prompts_train']}: no training problems to sample")
    solutions = solutions_of(rows, ctx.io.deps["prompts_train"])  # checked before the model is loaded
    tokenizer, policy = load_tokenizer(ctx.dep("sft")), load_policy(ctx.dep("sft"))
    n = p.samples_per_problem
    queries = render_queries(tokenizer, [r["query"] for r in rows], ctx.io.deps["prompts_train"])  # a chat: templated
    samples = sample_responses(policy, tokenizer, [q for q in queries for _ in range(n)], p.max_new_tokens,
                               p.batch_size, p.seed)
    completions = [samples.responses[i * n:(i + 1) * n] for i in range(len(rows))]
    files, correct_counts = label_rows([{**r, "query": q} for r, q in zip(rows, queries)], solutions, completions,
                                       p.max_pairs_per_problem)
    with atomic_dir(ctx.out("labelled")) as tmp:
        for name, records in files.items():
            write_jsonl(records, tmp / name)
    metrics = summary_metrics(files, correct_counts, n)
    ctx.run.log_dataset(ctx.dep("prompts_train"), "prompts_train")
    ctx.run.log_table("labelled_pairs", files["preferences.jsonl"][:32])
    log.info("label: %s", ", ".join(f"{k}={v}" for k, v in metrics.items()))
    if not metrics["pairs"]:
        log.warning("label: no problem has both a correct and an incorrect sample; dpo has no pairs to train on "
                    "(more label.samples_per_problem or label.num_problems, or a different SFT)")
    histogram = Counter(correct_counts)
    curve = [{"correct_samples": c, "problems": histogram[c]} for c in range(n + 1)]
    return StageResult(metrics, curve)


__all__ = ["COLUMNS", "FILES", "LabelParams", "PLOT", "TASKS_SERVED", "body", "label_rows", "summary_metrics"]
