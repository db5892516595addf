"""The one block a pipeline run ends with: results table, the MLflow run's address, the next commands.

``results_table`` is the plain-text table of ``metrics/evaluate.json`` (one row per policy, the champion
marked); ``end_block`` puts it together with the link and the commands; ``report`` is the same story as the
markdown of the flow run's Prefect artifact. All pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

COLUMNS = (("gold_reward", "gold reward", 3), ("rm_reward", "RM score", 3), ("kl", "KL", 2),
           ("perplexity", "perplexity", 2), ("win_rate", "win rate", 3))
"""(metric key in evaluate.json, column header, decimals), in display order."""

def next_commands(folder: str = ".", model_name: str = "rlhf-policy") -> tuple[tuple[str, str], ...]:
    """The end block's "Next:" lines of the pipeline in ``folder`` (``.``: the repository root's; a task folder such
    as ``pipelines/arithmetic``: the same views, of that task)."""
    task = "" if folder == "." else f" TASK={Path(folder).name}"
    # DVC's commands read every dvc.yaml of the repository: the target keeps them to this pipeline's (in a fresh
    # clone the other task's outputs, never pulled or run there, would be listed as deleted)
    target = " dvc.yaml" if folder == "." else f" {folder}/dvc.yaml"
    return (
        ("make mlflow-ui", f"MLflow UI on http://127.0.0.1:5000: training runs, policies side by side, {model_name}"),
        (f"make metrics{task}", "the metrics of this workspace, in 120 columns (`dvc metrics show`: one wide row per "
                                "file)"),
        (".venv/bin/dvc plots show" + target, "the plots as offline HTML (dvc_plots/index.html)"),
        (".venv/bin/dvc status" + target, "which stages are stale"),
        ("make prefect-ui", "Prefect UI on http://127.0.0.1:4200 (flow runs, logs, artifacts)"),
    )


NEXT_COMMANDS = next_commands()
"""(command as it runs from the project root with or without the venv activated, what it shows)."""


def _cell(value: object, decimals: int) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.{decimals}f}"


def results_table(results: Mapping[str, Mapping[str, float]], champion: str | None = None) -> str:
    """Aligned text table of ``results`` (policy -> metric -> value); the ``champion`` row ends in ``<- champion``.

    Columns are ``COLUMNS`` that any policy has, then any other metric in the file's order."""
    if not results:
        return "(no evaluation results: metrics/evaluate.json is missing or empty)"
    present = [key for row in results.values() for key in row]
    known = [(k, h, d) for k, h, d in COLUMNS if k in present]
    extra = [(k, k, 3) for k in dict.fromkeys(present) if k not in {c[0] for c in COLUMNS}]
    columns = known + extra
    header = ["policy", *(h for _, h, _ in columns)]
    rows = [[policy, *(_cell(row.get(k), d) for k, _, d in columns)] for policy, row in results.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    out = [line(header), "  ".join("-" * w for w in widths)]
    for policy, cells in zip(results, rows):
        out.append(line(cells) + ("  <- champion" if policy == champion else ""))
    return "\n".join(out)


def champion_of(decision: Mapping[str, object]) -> str | None:
    """The policy that is champion after the registry step: made so in this run, or (already registered) still
    holding the alias; None when the registry kept another version or did nothing."""
    if decision.get("is_champion") or (decision.get("registered") and decision.get("decision") == "promote"):
        return str(decision.get("policy"))
    return None


def end_block(results: Mapping[str, Mapping[str, float]], ran: list[str], decision: Mapping[str, object],
              run_url: str | None, noop: bool = False, folder: str = ".", model_name: str = "rlhf-policy") -> str:
    """The block printed once at the end of ``python -m flows.pipeline`` (and so of ``make run``); ``noop``: the
    run trained and registered nothing, so its MLflow run was not kept (no link); ``folder``, ``model_name``: the
    task folder's pipeline and registered model the "Next:" lines name."""
    champion = champion_of(decision)
    lines = ["", "=" * 72, f"RLHF pipeline: stages run: {', '.join(ran) or 'none (everything up to date)'}",
             f"registry: {decision.get('reason') or 'not run'}", "", results_table(results, champion), ""]
    if champion is None and decision.get("policy"):
        lines[-1:] = [f"(registry kept the previous champion; challenger was {decision.get('policy')})", ""]
    if run_url:
        lines.append(f"MLflow run: {run_url}")
    elif noop:
        lines.append("MLflow run: none kept (nothing ran; the latest runs are in `make mlflow-ui`)")
    else:
        lines.append("MLflow run: none (tracking store unavailable; stages spooled, upload with "
                     "`make tracking-upload`)")
    if run_url:
        lines.append("            (start the UI first: make mlflow-ui)")
    lines += ["", "Next:"]
    commands = next_commands(folder, model_name)
    width = max(len(c) for c, _ in commands)
    lines += [f"  {command.ljust(width)}   # {what}" for command, what in commands]
    lines.append("=" * 72)
    return "\n".join(lines)


def report(summary: Mapping[str, object], results: Mapping[str, Mapping[str, float]], run_url: str | None) -> str:
    """The pipeline summary as markdown (the flow run's Prefect artifact): stages, registry, MLflow run, results."""
    parent = summary["mlflow_run"]
    link = (f"[{parent}]({run_url})" if parent
            else "none (nothing ran, or the tracking server was unreachable: then `make tracking-upload`)")
    lines = ["## RLHF pipeline", "", f"- stages run: {', '.join(summary['ran']) or 'none'}",
             f"- skipped (up to date): {', '.join(summary['skipped']) or 'none'}",
             f"- registry: {summary['registry'].get('reason')}",
             f"- MLflow parent run: {link}", ""]
    if results:
        keys = list(next(iter(results.values())))
        lines += ["| policy | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        lines += [f"| {p} | " + " | ".join(str(v[k]) for k in keys) + " |" for p, v in results.items()]
    return "\n".join(lines)


__all__ = ["COLUMNS", "NEXT_COMMANDS", "next_commands", "champion_of", "end_block", "report", "results_table"]
