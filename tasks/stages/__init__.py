"""The one table of pipeline stages. Every list of stages the pipeline needs is a one-line query of it.

Each row (``tasks.spec.stage.Stage``) names the stage, the schema of its params.yaml section, its body
(``tasks/stages/<stage>.py``: ``body(ctx) -> StageResult``), its files and its flags. ``dvc.yaml`` is rendered from
this table (``python -m tasks.run.dvc_yaml``; ``tests/test_params.py`` compares it with the committed file), and
``tasks/run/stage_task.py`` runs a row the same way for every stage.

Adding a stage: its module (schema with its value rules, ``PLOT``, body), its row here, its section in
``params.yaml``; then ``python -m tasks.run.dvc_yaml`` writes its dvc.yaml entry.
"""

from __future__ import annotations

from pathlib import Path

from tasks.spec import params
from tasks.spec.params import PARAMS_FILE, Params, PathsParams, RegistryParams
from tasks.spec.stage import Stage
from tasks.spec.param_rules import ParamsError
from tasks.spec.task import TASK_READS, TaskParams, task_problems
from tasks.stages import ddpo, dpo, evaluate, grpo, kto, label, ppo, prepare, reward_model, rloo, sft

_TRAINING = (
    Stage("prepare", prepare.PrepareParams, prepare.body, deps={"incoming": "{incoming}"},
          outs={name: f"{{data}}/{name}.jsonl" for name in prepare.DATASETS},
          plot_columns=prepare.COLUMNS, plot=prepare.PLOT, task_reads=TASK_READS, other_reads=("sft.model_name",),
          retries=2),
    Stage("sft", sft.SFTParams, sft.body, deps={"sft_train": "{data}/sft_train.jsonl"}, outs={"model": "{models}/sft"},
          plot_columns=sft.COLUMNS, plot=sft.PLOT, launchable=True),
    # a verifiable task's preference data (dpo, kto): verifier-labelled samples of SFT; sentiment: placeholders
    Stage("label", label.LabelParams, label.body, deps={"prompts_train": "{data}/prompts_train.jsonl",
                                                        "sft": "{models}/sft"},
          outs={"labelled": "{data}/labelled"}, plot_columns=label.COLUMNS, plot=label.PLOT,
          serves=label.TASKS_SERVED, task_reads=("task.name",)),
    Stage("reward_model", reward_model.RewardModelParams, reward_model.body,
          deps={"preferences": "{data}/preferences.jsonl", "sft": "{models}/sft"},
          outs={"model": "{models}/reward_model"}, plot_columns=reward_model.COLUMNS, plot=reward_model.PLOT,
          launchable=True, serves=("sentiment",), task_reads=("task.name",)),
    Stage("ppo", ppo.PPOParams, ppo.body,
          deps={"prompts_train": "{data}/prompts_train.jsonl", "sft": "{models}/sft",
                "reward_model": "{models}/reward_model", "prompts_eval": "{data}/prompts_eval.jsonl"},
          outs={"model": "{models}/ppo"}, plot_columns=ppo.COLUMNS, plot=ppo.PLOT, charts=ppo.CHARTS,
          policy=True, windows=True, launchable=True),
    Stage("dpo", dpo.DPOParams, dpo.body,
          deps={"preferences": "{data}/preferences.jsonl", "labelled": "{data}/labelled", "sft": "{models}/sft",
                "prompts_eval": "{data}/prompts_eval.jsonl"},
          outs={"model": "{models}/dpo"}, plot_columns=dpo.COLUMNS, plot=dpo.PLOT,
          policy=True, windows=True, launchable=True),
    Stage("grpo", grpo.GRPOParams, grpo.body,
          deps={"prompts_train": "{data}/prompts_train.jsonl", "sft": "{models}/sft",
                "reward_model": "{models}/reward_model"},
          outs={"model": "{models}/grpo"}, plot_columns=grpo.COLUMNS, plot=grpo.PLOT, policy=True, launchable=True),
    Stage("rloo", rloo.RLOOParams, rloo.body,
          deps={"prompts_train": "{data}/prompts_train.jsonl", "sft": "{models}/sft",
                "reward_model": "{models}/reward_model"},
          outs={"model": "{models}/rloo"}, plot_columns=rloo.COLUMNS, plot=rloo.PLOT, policy=True, launchable=True),
    Stage("kto", kto.KTOParams, kto.body,
          deps={"ratings": "{data}/ratings.jsonl", "labelled": "{data}/labelled", "sft": "{models}/sft",
                "prompts_eval": "{data}/prompts_eval.jsonl"},
          outs={"model": "{models}/kto"}, plot_columns=kto.COLUMNS, plot=kto.PLOT,
          policy=True, windows=True, launchable=True),
)

STAGES: tuple[Stage, ...] = (
    *_TRAINING,
    # scores SFT and every policy above (``policy/<name>``), drawing the windows of those that score samples
    Stage("evaluate", evaluate.EvaluateParams, evaluate.body,
          deps={"prompts_eval": "{data}/prompts_eval.jsonl", "heldout": "{data}/heldout.jsonl",
                "policy/sft": "{models}/sft", "reward_model": "{models}/reward_model",
                **{f"windows/{s.name}": f"{{plots}}/{s.name}_windows.csv" for s in _TRAINING if s.windows},
                **{f"policy/{s.name}": f"{{models}}/{s.name}" for s in _TRAINING if s.policy}},
          outs={"prompt_scores": "{data}/evaluate_prompts.csv"}, plot_columns=evaluate.COLUMNS, plot=evaluate.PLOT,
          extra_plots={"frontier": evaluate.FRONTIER_PLOT}, task_reads=TASK_READS),
    Stage("ddpo", ddpo.DDPOParams, ddpo.body, deps={}, outs={"model": "{models}/ddpo"}, plot_columns=ddpo.COLUMNS,
          plot=ddpo.PLOT, optional=True),
)
"""Every stage, in the order the pipeline runs them."""

BY_NAME = {s.name: s for s in STAGES}
NAMES = tuple(BY_NAME)
DEFAULT_STAGES = tuple(s.name for s in STAGES if not s.optional)
"""The default run (``make run`` says "all stages" when it ran these)."""
POLICY_STAGES = tuple(s.name for s in STAGES if s.policy)
POLICIES = ("sft", *POLICY_STAGES)
"""What evaluate scores and ``registry.candidates`` may name."""
LAUNCHABLE = tuple(s.name for s in STAGES if s.launchable)
SECTIONS: dict[str, type] = {"paths": PathsParams, "task": TaskParams, **{s.name: s.params for s in STAGES},
                              "registry": RegistryParams}
"""params.yaml's sections, in the file's order."""


def parse_params(raw: object, source: str = PARAMS_FILE) -> Params:
    """:class:`tasks.spec.params.Params` from a parsed params.yaml, checked against every section of the table."""
    return _check_task(params.parse(raw, SECTIONS, POLICIES, source), source)


def _check_task(parsed: Params, source: str) -> Params:
    """The task's rules across sections (``tasks.spec.task.task_problems``), before any stage runs."""
    found = task_problems(parsed)
    if found:
        raise ParamsError(f"{source}: {found[0]}")
    return parsed


def stage_files(paths: PathsParams) -> dict:
    """Every stage's files (``StageIO``) under the paths section, by stage name."""
    return {s.name: s.io(paths) for s in STAGES}


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and check a params.yaml against every section of the table."""
    return _check_task(params.load(path, SECTIONS, POLICIES), str(path))


__all__ = ["BY_NAME", "DEFAULT_STAGES", "LAUNCHABLE", "NAMES", "POLICIES", "POLICY_STAGES", "SECTIONS", "STAGES",
           "load_params", "parse_params", "stage_files"]
