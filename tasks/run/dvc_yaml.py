"""``dvc.yaml``, rendered from the stage table: nobody edits it by hand.

Each stage's entry comes from its row (``tasks/stages/__init__.py``): the command every stage runs
(``python -m flows.stage <name>``), its code deps (its body, the wrapper, and every project module they import, found
by the import walk of ``tasks/spec/import_walk.py``, but those that only report), its data deps and outs, its params
(every key of its section, then what it reads elsewhere), its metrics file and its plots with DVC's options (the
``PLOT`` of its module). ``tests/test_params.py`` compares the rendering with the committed file.

    python -m tasks.run.dvc_yaml           # write dvc.yaml
    python -m tasks.run.dvc_yaml --check   # exit 1 and say so when dvc.yaml differs from the rendering
    python -m tasks.run.dvc_yaml --root pipelines/arithmetic   # a task folder's own dvc.yaml (--all: every one)

A task folder (``pipelines/<task>/``: its own params.yaml, dvc.yaml and dvc.lock; data/, models/, metrics/, plots/
under it) gets the same stages: DVC runs each command in the folder, which goes up to the repository root (where
``flows`` imports) and runs the stage with ``--root`` the folder; code deps point at the shared files up there.
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
TASK_FOLDERS = "pipelines"
"""Where the task folders live: ``pipelines/<task>/params.yaml`` each (the sentiment task is the repository root)."""
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
TASK_HEADER = """\
# The task folder {folder}: its params.yaml, this file, its dvc.lock and its outputs (paths relative to
# here). Each cmd goes up to the repository root and runs the stage with --root {folder}.
# Run it with `make run TASK=<task>`, or `dvc repro {folder}/dvc.yaml` from the repository root.
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


def task_roots(root: Path = ROOT) -> list[Path]:
    """Every task folder of the project: ``pipelines/<task>/`` holding a params.yaml, sorted."""
    return sorted(p.parent for p in (root / TASK_FOLDERS).glob(f"*/{PARAMS_FILE}"))


def stage_command(name: str, up: str, folder: str) -> str:
    """The stage's command: from a task folder, up to the repository root (``up``: ``../..``), then the stage with
    the folder as its root."""
    if folder == ".":
        return f"python -m flows.stage {name}"
    return f"cd {up} && python -m flows.stage {name} --root {folder}"


def stage_entry(stage: Stage, paths: PathsParams, graph: ImportGraph, root: Path = ROOT, task_root: Path | None = None
                ) -> dict:
    """One stage's dvc.yaml entry; ``task_root``: the task folder it is for (None: the repository root)."""
    io = stage.io(paths)
    folder = (task_root or root).resolve().relative_to(root.resolve()).as_posix()
    up = "/".join([".."] * (0 if folder == "." else len(folder.split("/"))))
    code = [f"{up}/{dep}" if up else dep for dep in code_deps(stage, graph, root)]
    entry = {"cmd": stage_command(stage.name, up, folder),
             "deps": code + list(io.deps.values()),
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


def render(root: Path = ROOT, task_root: Path | None = None) -> str:
    """The text of ``dvc.yaml`` for the project at ``root`` (its params.yaml's paths section), or for its task folder
    ``task_root`` (that folder's params.yaml)."""
    paths = load_params((task_root or root) / PARAMS_FILE).paths
    graph = import_graph(root)
    stages = {s.name: stage_entry(s, paths, graph, root, task_root) for s in STAGES}
    header = HEADER if task_root is None else HEADER + TASK_HEADER.format(
        folder=task_root.resolve().relative_to(root.resolve()).as_posix())
    body = yaml.dump({"stages": stages}, Dumper=_Dumper, sort_keys=False, width=120, default_flow_style=False)
    charts = yaml.dump({"plots": [chart for s in STAGES for chart in stage_charts(s, paths)]}, Dumper=_Dumper,
                       sort_keys=False, width=120, default_flow_style=None)
    return header + body + CHARTS_COMMENT + charts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.run.dvc_yaml", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when dvc.yaml differs from the rendering")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--root", default=None, help="a task folder (pipelines/<task>): render its dvc.yaml instead")
    where.add_argument("--all", action="store_true", help="the repository root's dvc.yaml and every task folder's")
    args = parser.parse_args(argv)
    folders = [None, *task_roots()] if args.all else [_task_root(args.root)] if args.root else [None]
    return max(_write_or_check(folder, args.check) for folder in folders)


def _task_root(text: str) -> Path | None:
    """``--root``'s folder (None: the repository root); exit 2 naming it when it has no params.yaml."""
    folder = (Path.cwd() / text).resolve()
    if folder == ROOT:
        return None
    if not (folder / PARAMS_FILE).is_file() or ROOT not in folder.parents:
        raise SystemExit(f"--root {text}: no {PARAMS_FILE} in a folder of the project {ROOT} (a task folder is "
                         f"{TASK_FOLDERS}/<task>/ holding its params.yaml)")
    return folder


def _write_or_check(task_root: Path | None, check: bool) -> int:
    target, text = (task_root or ROOT) / "dvc.yaml", render(ROOT, task_root)
    where = target.relative_to(ROOT)
    if check:
        if not target.is_file() or target.read_text() != text:
            flag = f" --root {where.parent}" if task_root else ""
            print(f"{where} differs from the stage table's rendering: run `python -m tasks.run.dvc_yaml{flag}`",
                  file=sys.stderr)
            return 1
        return 0
    target.write_text(text)
    print(f"wrote {where}: {len(STAGES)} stages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
