"""``dvc.yaml``, rendered from the stage table: nobody edits it by hand.

Each stage's entry comes from its row (``tasks/stages/__init__.py``): the command every stage runs
(``python -m flows.stage <name>``), its code deps (its body, the wrapper, and every project module they import, found
by the import walk of ``tasks/spec/import_walk.py``, but those that only report), its data deps and outs, its params
(every key of its section, then what it reads elsewhere), its metrics file and its plots with DVC's options (the
``PLOT`` of its module). ``tests/test_params.py`` compares the rendering with the committed file.

    python -m tasks.run.dvc_yaml           # write dvc.yaml
    python -m tasks.run.dvc_yaml --check   # exit 1 and say so when dvc.yaml differs from the rendering
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import yaml

from rlhf_core._lazy import PUBLIC
from tasks.spec.import_walk import ImportGraph
from tasks.spec.params import PARAMS_FILE, PathsParams
from tasks.spec.stage import Stage
from tasks.stages import STAGES, load_params

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = "tasks/run/stage_task.py"
"""The one wrapper that runs every stage (reads params, writes what the body returns): code of every stage."""
TABLE = "tasks.stages"
"""The stage table: it names every stage's body, so the walk of one stage's code stops there."""
REPORTING_ONLY = frozenset({
    "rlhf_core/tracking.py", "rlhf_core/wandb_tracker.py", "tasks/process/logs.py", "tasks/store/mlflow_runs.py",
    "tasks/process/prefect_context.py", "tasks/store/provenance.py", "tasks/store/stage_run.py"})
"""Imported by the stage code but only report elsewhere (MLflow, Prefect, logs): they cannot change a stage's outputs,
so a change to them re-runs nothing."""
HEADER = """\
# Rendered from the stage table (tasks/stages/__init__.py) by `python -m tasks.run.dvc_yaml`: do not edit by hand.
# Stages: prepare -> sft -> reward_model -> ppo, dpo, grpo, rloo, kto -> evaluate; then ddpo (independent).
# A policy stage (and ddpo) whose params.yaml section says enabled: false still runs, writing a placeholder in
# models/<stage> and {"enabled": false} in metrics/<stage>.json, so `dvc status` is clean after every run.
# Each cmd runs the stage the pipeline flow runs (python -m flows.pipeline), through the same wrapper
# (tasks/run/stage_task.py). A stage's deps are its code (its body, the wrapper and every project module they
# import, but those that only report), then its data; its params are every key of its section, then the keys of
# other sections it reads (tasks/spec/stage.py:WINDOW_READS).
# metrics/ and plots/ are git-tracked (cache: false); data/ and models/ are DVC-cached.
# Run with the project's venv on PATH (make repro does), e.g. `. .venv/bin/activate && dvc repro`.
"""


CHARTS_COMMENT = "# Charts that combine columns or files (the per-stage plots above draw one column each).\n"


def import_graph(root: Path = ROOT) -> ImportGraph:
    """The walk over the project's library and pipeline (``rlhf_core``'s lazy exports followed)."""
    return ImportGraph(root, ("rlhf_core", "tasks"), {n: m for m, names in PUBLIC.items() for n in names})


def body_file(stage: Stage, root: Path = ROOT) -> str:
    """``tasks/stages/<stage>.py``: the module of the stage's body, as its row names it."""
    return Path(inspect.getsourcefile(stage.body)).resolve().relative_to(root.resolve()).as_posix()


def stage_code(stage: Stage, graph: ImportGraph, root: Path = ROOT) -> set[str]:
    """The project files a stage runs: its body's imports and the wrapper's, whose walk stops at the table (it
    names every body, but runs only this one)."""
    body = graph.closure(graph.module_of(root / body_file(stage, root)))
    wrapper = graph.closure(graph.module_of(root / WRAPPER), stop=frozenset({TABLE}))
    return graph.files(body | wrapper)


def code_deps(stage: Stage, graph: ImportGraph, root: Path = ROOT) -> list[str]:
    """Its body, the wrapper, then the rest of what they import (sorted), but the reporting-only modules."""
    first = [body_file(stage, root), WRAPPER]
    return first + sorted(stage_code(stage, graph, root) - REPORTING_ONLY - set(first))


def stage_entry(stage: Stage, paths: PathsParams, graph: ImportGraph, root: Path = ROOT) -> dict:
    io = stage.io(paths)
    entry = {"cmd": f"python -m flows.stage {stage.name}",
             "deps": code_deps(stage, graph, root) + list(io.deps.values()),
             "params": stage.param_keys()}
    if io.outs:
        entry["outs"] = list(io.outs.values())
    entry["metrics"] = [{io.metrics: {"cache": False}}]
    entry["plots"] = [{path: {"cache": False, **stage.plot_options(name)}} for name, path in io.plots.items()]
    return entry


def stage_charts(stage: Stage, paths: PathsParams) -> list[dict]:
    """The stage's charts for dvc.yaml's top-level ``plots``, their ``y`` naming plot files by path."""
    io = stage.io(paths)
    return [{title: {**{k: v for k, v in options.items() if k != "y"},
                     "y": {io.plots[name]: list(columns) for name, columns in options["y"].items()}}}
            for title, options in stage.charts.items()]


class _Dumper(yaml.SafeDumper):
    """Lists indented under their key, as DVC's own examples write them."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def render(root: Path = ROOT) -> str:
    """The text of ``dvc.yaml`` for the project at ``root`` (its params.yaml's paths section)."""
    paths = load_params(root / PARAMS_FILE).paths
    graph = import_graph(root)
    stages = {s.name: stage_entry(s, paths, graph, root) for s in STAGES}
    body = yaml.dump({"stages": stages}, Dumper=_Dumper, sort_keys=False, width=120, default_flow_style=False)
    charts = yaml.dump({"plots": [chart for s in STAGES for chart in stage_charts(s, paths)]}, Dumper=_Dumper,
                       sort_keys=False, width=120, default_flow_style=None)
    return HEADER + body + CHARTS_COMMENT + charts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.run.dvc_yaml", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when dvc.yaml differs from the rendering")
    args = parser.parse_args(argv)
    target, text = ROOT / "dvc.yaml", render()
    if args.check:
        if target.read_text() != text:
            print("dvc.yaml differs from the stage table's rendering: run `python -m tasks.run.dvc_yaml`",
                  file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {target.relative_to(ROOT)}: {len(STAGES)} stages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
