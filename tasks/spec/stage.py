"""What a pipeline stage is: its row of the stage table (:class:`Stage`), the paths it reads and writes
(:class:`StageIO`), what its body is given (:class:`StageContext`) and what the body gives back (:class:`StageResult`).

The table of rows is ``tasks/stages/__init__.py``; the one wrapper that runs a row (params, a disabled stage, the
MLflow run, writing the result) is ``tasks/run/stage_task.py``. A body never writes its metrics or plots itself: it
returns them, and the wrapper writes them the same way for every stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.spec.params import PathsParams, StageParams, section_keys

WINDOW_READS = ("evaluate.max_new_tokens", "evaluate.seed", "task.name")
"""The keys of another section a windows stage reads: its sample windows score held-out prompts exactly as
``evaluate`` does (tasks/stages/common/samples.py), with the task's gold judge (a verifiable task's verifier). Params of the stage in dvc.yaml (a change re-runs it), watched by the mid-run
guard (``tasks/store/dvc_ops.py``), part of the resume key (``tasks/stages/common/resume.py``); the stage's params view hands out these
and nothing else of other sections (``tasks.spec.params.StageParams``)."""


WINDOW_COLUMNS = ("step", "kl", "gold_reward")
"""``plots/<stage>_windows.csv`` of a windows stage: one row per sample window (``kl``: mean sequence KL to SFT of
the window's samples; tasks/stages/common/samples.py)."""


def window_plot(stage: str) -> dict[str, str]:
    """DVC's options of ``plots/<stage>_windows.csv``."""
    return dict(title=f"{stage.upper()} gold reward of the held-out samples per step window (their KL is in the "
                      "frontier plot)", x="step", y="gold_reward")


def metrics_file(paths: PathsParams, stage: str) -> str:
    """``<paths.metrics>/<stage>.json``: the one rule for a stage's metrics file (``metrics/evaluate.json`` too)."""
    return f"{paths.metrics}/{stage}.json"


def plot_file(paths: PathsParams, name: str) -> str:
    """``<paths.plots>/<name>.csv``."""
    return f"{paths.plots}/{name}.csv"


@dataclass(frozen=True)
class StageIO:
    """A stage's files, relative to the project, in dvc.yaml's order (``tests/test_params.py`` holds them equal)."""

    deps: dict[str, str]
    """Inputs by name (``{"sft": "models/sft", ...}``)."""
    outs: dict[str, str]
    """DVC-cached outputs by name (``{"model": "models/ppo"}``)."""
    metrics: str
    """``metrics/<stage>.json`` (git-tracked)."""
    plots: dict[str, str]
    """Plot files by name (git-tracked): ``curve`` (``plots/<stage>.csv``), ``windows`` for a windows stage, and
    the stage's extra plots (``frontier``)."""

    def group(self, prefix: str) -> dict[str, str]:
        """The deps named ``<prefix>/<name>``, as ``{name: path}`` in order (evaluate's ``policy/ppo``...)."""
        return {k.split("/", 1)[1]: v for k, v in self.deps.items() if k.startswith(prefix + "/")}


@dataclass(frozen=True)
class Stage:
    """One row of the stage table: everything the pipeline knows about a stage, besides its body's code."""

    name: str
    """The stage (and its params.yaml section, and its DVC stage)."""
    params: type
    """The schema of its params.yaml section (no defaults: every key is in params.yaml)."""
    body: Callable[[StageContext], StageResult]
    """``body(ctx) -> StageResult``: the stage's work (tasks/stages/<name>.py)."""
    deps: Mapping[str, str]
    """Inputs by name, as templates over the paths section (``"{models}/sft"``)."""
    outs: Mapping[str, str]
    """DVC-cached outputs by name, as templates. A disabled stage writes a placeholder directory at each."""
    plot_columns: tuple[str, ...]
    """Columns of ``plots/<name>.csv`` (a disabled stage writes the header alone)."""
    plot: Mapping[str, str]
    """DVC's options of ``plots/<name>.csv`` (``title``, ``x``, ``y``, ``template``...: dvc.yaml is rendered from them)."""
    policy: bool = False
    """Trains a policy from SFT into ``models/<name>``: evaluate scores it, the registry may register it."""
    windows: bool = False
    """Scores held-out samples along training (tasks/stages/common/samples.py): also writes ``plots/<name>_windows.csv``, which
    evaluate draws on the reward-KL frontier, and reads :data:`WINDOW_READS`."""
    launchable: bool = False
    """May run under ``accelerate launch`` / ``torchrun`` (every rank trains, rank 0 writes)."""
    optional: bool = False
    """Outside the default pipeline (off unless its section says ``enabled: true``; still run and recorded)."""
    charts: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Charts that combine columns of its plot files, by title (dvc.yaml's top-level ``plots``): DVC's options, with
    ``y`` naming the plot (``curve``, ``windows``...) and its columns: ``{"curve": ["reward_mean", "kl"]}``."""
    extra_plots: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """More plot files the body returns, by name (each written to ``plots/<name>.csv``: evaluate's frontier), with
    DVC's options of each."""
    serves: tuple[str, ...] = ()
    """The tasks (``task.name``) it does work for; under another it writes placeholders, as a disabled stage does
    (the reward model under a verifiable task). Empty: every task."""
    task_reads: tuple[str, ...] = ()
    """The keys of the ``task`` section it reads (``tasks.spec.task.TASK_READS``: which task it serves, and that
    task's data controls); empty for a stage that serves every task alike."""
    other_reads: tuple[str, ...] = ()
    """Dotted keys of other stages' sections it reads (prepare: ``sft.model_name``, whose chat template renders a
    user's conversational pairs)."""
    retries: int = 0
    """Prefect retries of a transient failure (never of bad input: ``tasks.run.stage_task.retry_unless_bad_input``)."""

    @property
    def reads(self) -> tuple[str, ...]:
        """The dotted keys of other sections it reads (:data:`WINDOW_READS` for a windows stage, then its
        ``task_reads`` and ``other_reads``)."""
        return (WINDOW_READS if self.windows else ()) + tuple(self.task_reads) + tuple(self.other_reads)

    def serves_task(self, params: Any) -> bool:
        """Whether it does work for the task of ``params`` (see ``serves``)."""
        return not self.serves or params.section("task").name in self.serves

    def param_keys(self) -> list[str]:
        """What dvc.yaml lists as its params: every key of its section, then those it reads elsewhere."""
        return [f"{self.name}.{key}" for key in section_keys(self.params)] + list(self.reads)

    def plot_options(self, name: str) -> Mapping[str, str]:
        """DVC's options of plot ``name`` (``curve``, ``windows`` or an extra plot), for dvc.yaml."""
        if name == "curve":
            return self.plot
        if name == "windows":
            return window_plot(self.name)
        return self.extra_plots[name]

    def io(self, paths: PathsParams) -> StageIO:
        """Its files under the paths section of params.yaml."""
        where = dataclasses.asdict(paths)
        plots = {"curve": plot_file(paths, self.name)}
        if self.windows:
            plots["windows"] = plot_file(paths, f"{self.name}_windows")
        plots.update({name: plot_file(paths, name) for name in self.extra_plots})
        return StageIO(deps={k: v.format(**where) for k, v in self.deps.items()},
                       outs={k: v.format(**where) for k, v in self.outs.items()},
                       metrics=metrics_file(paths, self.name), plots=plots)


@dataclass
class StageContext:
    """What a stage body is given: the project, the params it may read, its files and its MLflow run."""

    stage: Stage
    root: Path
    """The project directory (resolved)."""
    params: StageParams
    """What the stage may read of params.yaml: its section, ``paths`` and what it declares elsewhere."""
    section: Any
    """Its own section (``params.<name>``)."""
    io: StageIO
    run: Any
    """The stage's :class:`tasks.store.stage_run.StageRun`: tracker, params, datasets, tables, model cards, summary."""

    def dep(self, name: str) -> Path:
        """The absolute path of input ``name``."""
        return self.root / self.io.deps[name]

    def out(self, name: str) -> Path:
        """The absolute path of output ``name``."""
        return self.root / self.io.outs[name]


@dataclass
class StageResult:
    """What a stage body gives back; the wrapper writes it (``tasks/run/stage_task.py``), the same way for every stage."""

    metrics: dict[str, Any]
    """``metrics/<stage>.json`` (its numbers are also logged to the stage run as ``final/<key>``)."""
    curve: Sequence[Mapping[str, Any]]
    """The rows of ``plots/<stage>.csv`` (columns: the row's ``plot_columns``)."""
    windows: Sequence[Mapping[str, Any]] | None = None
    """A windows stage: the rows of ``plots/<stage>_windows.csv``."""
    plots: dict[str, tuple[Sequence[str], Sequence[Mapping[str, Any]]]] = field(default_factory=dict)
    """The row's extra plots: name -> (columns, rows)."""
    summary: dict[str, Any] | None = None
    """The stage run's summary (its MLflow description and Prefect artifact); None: the metrics."""
    finish: Callable[[], None] | None = None
    """Called once every output is written: removes the stage's resumable state (a kill before then resumes)."""


__all__ = ["Stage", "StageContext", "StageIO", "StageResult", "WINDOW_COLUMNS", "WINDOW_READS", "metrics_file",
           "plot_file"]
