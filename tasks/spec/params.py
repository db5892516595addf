"""The loader of ``params.yaml``: one schema per section, unknown or missing keys rejected, no defaults.

One source of values: ``params.yaml``. One schema per section, kept with the code that reads it: a stage's schema in
its module (``tasks/stages/<stage>.py``, named by its row of the stage table), ``paths`` and ``registry`` here. A
section that configures a library trainer (``ppo``) lists which fields of the rlhf_core config dataclass it sets
(names only; types and docs on ``PPOConfig``) and keeps its stage-only keys in a small dataclass
(:class:`ConfigSection`). Fields that match ``TrainingArguments`` keep those names so they pass straight through.

:func:`parse` checks a whole file against the sections it is given (the stage table gives them all:
``tasks.stages.load_params``): keys and types here, each section's value rules beside its schema (``RULES``, applied by
``tasks/spec/param_rules.py`` with the rules across sections), each section's
cross-field rules in its schema's ``problems(name)``, the registry's rule here. A stage reads only its
:class:`StageParams` view: its section, ``paths`` and the keys of other sections it declares.

Hardware is not a parameter: the accelerate config is chosen outside this file (``ACCELERATE_CONFIG_FILE``).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from tasks.spec import param_rules
from tasks.spec.param_rules import PATH_KEYS, ParamsError, ValueRules
from tasks.spec.paths import resolve_output_path

PARAMS_FILE = "params.yaml"

METRIC_KEYS = ("gold_reward", "rm_reward", "kl", "perplexity", "win_rate")
"""The keys of each policy's object in ``metrics/evaluate.json``."""
PAIRED_METRICS = ("gold_reward", "rm_reward", "win_rate")
"""The metrics the registry can decide on for the sentiment task: higher is better and each has a value per
evaluation prompt."""
VERIFIED_METRICS = ("pass@1",)
"""The metric the registry decides on for a verifiable task (arithmetic, problems): higher is better, one value (c/n)
per evaluation problem."""


@dataclass(frozen=True)
class PathsParams:
    """Directory layout shared by every stage; dvc.yaml's deps and outs use the same paths."""

    data: str
    """Prepared datasets (DVC-cached)."""
    models: str
    """Trained checkpoints, one directory per stage (DVC-cached)."""
    metrics: str
    """One ``<stage>.json`` per stage (git-tracked, ``cache: false``)."""
    plots: str
    """One ``<stage>.csv`` per stage (git-tracked, ``cache: false``)."""
    incoming: str
    """New data for retraining: review files and preference files dropped here are merged by prepare."""
    allow_outside: bool
    """Allow the paths above to resolve outside the project directory (``..``, absolute, symlinks); keep false."""


@dataclass(frozen=True)
class PolicySwitch:
    """The key of every policy stage's section."""

    enabled: bool
    """Train this policy; false: the stage writes a placeholder quickly and evaluate skips it."""


@dataclass(frozen=True)
class SampledPolicy(PolicySwitch):
    """A policy stage that scores held-out samples along training (tasks/stages/common/samples.py)."""

    sample_every: int
    """Every this many steps (and at the last), sample the first ``sample_prompts`` held-out prompts, score them with
    the gold judge, log the table and a reward-KL point (plots/<stage>_windows.csv, tasks/stages/common/samples.py); 0: never."""
    sample_prompts: int
    """How many held-out prompts (the first of data/prompts_eval.jsonl) each sample window scores."""


@dataclass(frozen=True)
class ConfigSection:
    """A section made of a library config's keyword arguments plus a few stage-only keys.

    ``config``: the ``CONFIG_KEYS`` (fields of the rlhf_core dataclass ``CONFIG``, which types and documents
    them) with params.yaml's values; ``stage``: the ``STAGE`` dataclass of the rest. Attribute access reaches
    both (``p.batch_size``, ``p.total_steps``); ``as_dict`` gives the flat section.
    """

    config: Mapping[str, Any]
    stage: Any

    CONFIG: ClassVar[str] = ""
    CONFIG_KEYS: ClassVar[tuple[str, ...]] = ()
    STAGE: ClassVar[type] = object

    def __init_subclass__(cls, config: str = "", keys: tuple[str, ...] = (), stage: type = object, **kwargs):
        """``class PPOParams(ConfigSection, config="PPOConfig", keys=PPO_CONFIG_KEYS, stage=PPOStageParams)``."""
        super().__init_subclass__(**kwargs)
        cls.CONFIG, cls.CONFIG_KEYS, cls.STAGE = config, keys, stage

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        config, stage = self.__dict__.get("config", {}), self.__dict__.get("stage")
        if name in config:
            return config[name]
        if stage is not None and name in {f.name for f in fields(stage)}:
            return getattr(stage, name)
        raise AttributeError(f"{type(self).__name__} has no key {name!r}")

    @classmethod
    def declared(cls) -> dict[str, Any]:
        """Every key of the section, in order, with its declared type (the config's, then the stage's)."""
        import rlhf_core  # the config classes load transformers: only when a params file is checked

        hints = typing.get_type_hints(getattr(rlhf_core, cls.CONFIG))
        return {**{k: hints[k] for k in cls.CONFIG_KEYS}, **{f.name: f.type for f in fields(cls.STAGE)}}

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ConfigSection:
        config = {k: values[k] for k in cls.CONFIG_KEYS}
        return cls(config=config, stage=cls.STAGE(**{f.name: values[f.name] for f in fields(cls.STAGE)}))

    def as_dict(self) -> dict[str, Any]:
        return {**self.config, **dataclasses.asdict(self.stage)}


@dataclass(frozen=True)
class RegistryParams:
    """The registry rule: which evaluated policy becomes challenger, and when it replaces the champion."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("bootstrap_samples",),
        positive_floats=("max_kl", "max_kl_increase"),
        non_negative_floats=("min_improvement",),
        unit_interval=("significance",))
    """Value rules of the section (tasks/spec/param_rules.py applies them)."""

    model_name: str
    """Registered model name in MLflow."""
    candidates: list
    """Evaluated policies eligible for registration; the best by ``metric`` becomes the challenger."""
    metric: str
    """evaluate.json key that decides (higher is better)."""
    min_improvement: float
    """Challenger must beat the champion's metric by at least this much."""
    max_kl: float
    """Challenger's KL to the SFT reference must not exceed this."""
    max_kl_increase: float
    """Nor its KL exceed the champion's by more than this (the gate reports the change either way): a jump from 3.8
    to 9.3 was once promoted without a word, within ``max_kl``."""
    significance: float
    """And the win must be larger than the evaluation's noise: the paired bootstrap test over the evaluation
    prompts (rlhf_core.evaluation.paired_bootstrap) must give a one-sided p-value below this."""
    bootstrap_samples: int
    """Resamples of the evaluation prompts in that test."""
    seed: int
    """Seed of the resampling (the same decision on every machine)."""


class Params:
    """All of params.yaml: one attribute per section (``params.ppo.learning_rate``), in the file's order."""

    def __init__(self, sections: Mapping[str, Any]) -> None:
        self._sections = dict(sections)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self.__dict__.get("_sections", {}):
            raise AttributeError(name)
        return self._sections[name]

    def section(self, name: str) -> Any:
        return self._sections[name]

    def sections(self) -> dict[str, Any]:
        """name -> section object, in params.yaml's order."""
        return dict(self._sections)


def _plain_type(declared: Any) -> Any:
    """The type to check a YAML value against: ``Optional[X]`` -> X, ``Literal[...]`` -> its values' type."""
    origin = typing.get_origin(declared)
    if origin is typing.Literal:
        return type(typing.get_args(declared)[0])
    if origin is typing.Union:
        inner = [a for a in typing.get_args(declared) if a is not type(None)]
        return inner[0] if len(inner) == 1 else None
    return declared


def _check_type(where: str, name: str, value: Any, declared: Any) -> Any:
    declared = _plain_type(declared)
    expected = {"int": int, "float": float, "str": str, "bool": bool, "list": list}.get(
        declared if isinstance(declared, str) else getattr(declared, "__name__", ""), None
    )
    if expected is None:
        return value
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is int and isinstance(value, bool):
        raise ParamsError(f"{where}.{name}: expected int, got bool {value!r}")
    if not isinstance(value, expected):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:80] + "..."  # a value may be a whole list
        raise ParamsError(f"{where}.{name}: expected {expected.__name__}, got {type(value).__name__} {shown}")
    return value


def section_keys(schema: type) -> dict[str, Any]:
    """Every key of a section with schema ``schema``, in params.yaml's order, with its declared type."""
    if issubclass(schema, ConfigSection):
        return schema.declared()
    return {f.name: f.type for f in fields(schema)}


def _refuse_unknown_and_missing(source: str, what: str, given: Mapping[str, Any], declared: Mapping[str, Any]) -> None:
    """``ParamsError`` naming the keys of ``given`` that are not ``declared`` (``unknown <what>``), then those
    ``declared`` that ``given`` lacks (``missing <what>``)."""
    unknown = sorted(set(given) - set(declared))
    missing = sorted(set(declared) - set(given))
    if unknown:
        raise ParamsError(f"{source}: unknown {what}: {', '.join(unknown)}")
    if missing:
        raise ParamsError(f"{source}: missing {what}: {', '.join(missing)}")


def build_section(name: str, schema: type, raw: Any, source: str = PARAMS_FILE):
    """Build section ``name`` from a mapping; unknown or missing keys are errors (no defaults)."""
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: section {name!r} must be a mapping, got {type(raw).__name__}")
    declared = section_keys(schema)
    _refuse_unknown_and_missing(source, f"key(s) in section {name!r}", raw, declared)
    values = {k: _check_type(f"{source}:{name}", k, raw[k], declared[k]) for k in declared}
    return schema.from_values(values) if issubclass(schema, ConfigSection) else schema(**values)


def parse(raw: Any, sections: Mapping[str, type], policies: Sequence[str], source: str = PARAMS_FILE) -> Params:
    """:class:`Params` from the parsed YAML mapping, checked against ``sections`` (name -> schema, in the file's
    order); ``policies``: what ``registry.candidates`` may name (sft and the policy stages)."""
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    _refuse_unknown_and_missing(source, "section(s)", raw, sections)
    params = Params({name: build_section(name, schema, raw[name], source) for name, schema in sections.items()})
    param_rules.check(raw, sections, source)  # value rules (sizes, rates, vocabularies, positions, paths), naming the key
    for name, section in params.sections().items():  # cross-field rules, checked before any stage touches state
        problems = section.problems(name) if hasattr(section, "problems") else []
        if problems:
            raise ParamsError(f"{source}: {problems[0]}")
    _check_registry(params, policies, source)
    return params


REGISTERED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,255}")
"""A ``registry.model_name`` the registry can register and ``models:/<name>@<alias>`` can name (MLflow refuses '/'
and ':' only at registration, the pipeline's last step; '@' would split the alias)."""


def _check_registry(p: Params, policies: Sequence[str], source: str) -> None:
    """The registry's rules: it names evaluated policies, one of them enabled, and a paired metric."""
    candidates = p.registry.candidates
    if not (set(candidates) <= set(policies) and candidates):
        raise ParamsError(f"{source}: registry.candidates must be a non-empty subset of {list(policies)}")
    if not any(stage_enabled(p, c) for c in candidates):
        raise ParamsError(f"{source}: registry.candidates names no enabled policy (sft, or a policy stage whose "
                          "section has enabled: true)")
    if not REGISTERED_NAME.fullmatch(p.registry.model_name):
        raise ParamsError(f"{source}: registry.model_name: {p.registry.model_name[:80]!r} is not a registered model "
                          "name MLflow accepts in a model URI (letters, digits, '.', '_', '-'; at most 256 characters; "
                          "no '/', ':' or '@')")
    verifiable = "task" in p.sections() and p.task.name != "sentiment"
    allowed = VERIFIED_METRICS if verifiable else PAIRED_METRICS
    if p.registry.metric not in allowed:
        what = (f"for task.name: {p.task.name} (one value, c/n, per evaluation problem for the paired test)"
                if verifiable else "(higher is better, one value per evaluation prompt for the paired test)")
        raise ParamsError(f"{source}: registry.metric must be one of {allowed} {what}")


def read_raw(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: params file not found")
    raw = param_rules.load_yaml(path)  # a syntax error names file:line:column
    return raw if raw is not None else {}


def check_paths(root: str | Path, paths: PathsParams, source: str = PARAMS_FILE) -> dict[str, Path]:
    """Every ``paths.*`` directory resolved under ``root``; a :class:`ParamsError` naming the key if one escapes
    the project (``..``, an absolute path, a symlink) while ``paths.allow_outside`` is false."""
    resolved = {}
    for key in PATH_KEYS:
        try:
            resolved[key] = resolve_output_path(root, getattr(paths, key), allow_outside=paths.allow_outside)
        except ValueError as err:
            raise ParamsError(f"{source}: paths.{key}: {err} (or set paths.allow_outside: true)") from None
    return resolved


def load(path: str | Path, sections: Mapping[str, type], policies: Sequence[str]) -> Params:
    """Read and check a params file (:func:`parse`); its output paths are checked against its directory."""
    params = parse(read_raw(path), sections, policies, str(path))
    check_paths(Path(path).resolve().parent, params.paths, str(path))
    return params


def load_paths(path: str | Path) -> PathsParams:
    """Only the ``paths`` section of a params file, checked (a reader of outputs needs no other section)."""
    raw = read_raw(path)
    paths = build_section("paths", PathsParams, raw.get("paths") if isinstance(raw, dict) else None, str(path))
    check_paths(Path(path).resolve().parent, paths, str(path))
    return paths


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Return a copy of ``raw`` with ``{"ppo.learning_rate": 1e-4}``-style overrides applied (keys must exist)."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if section not in out or key not in out[section]:
            raise ParamsError(f"override {dotted!r}: no such key in params")
        out[section][key] = value
    return out


def as_dict(section) -> dict[str, Any]:
    """A section as a flat dict, keys in params.yaml's order (for MLflow params and checkpoint fingerprints)."""
    return section.as_dict() if isinstance(section, ConfigSection) else dataclasses.asdict(section)


def stage_enabled(params: Params | StageParams, stage: str) -> bool:
    """Whether ``stage`` does its work: a section without ``enabled`` always; a policy stage and ddpo when their
    section's ``enabled`` is true (a disabled one still runs and is recorded, writing a placeholder)."""
    return bool(getattr(params.section(stage), "enabled", True))


def cross_section_values(params: Params | StageParams, reads: Sequence[str]) -> dict[str, Any]:
    """``{"evaluate.seed": 0, ...}``: the values of the dotted keys ``reads`` (a stage's reads of other sections)."""
    values = {}
    for dotted in reads:
        section, key = dotted.split(".", 1)
        values[dotted] = getattr(params.section(section), key)
    return values


class UndeclaredParam(AttributeError):
    """A stage read a param it does not declare (it would not re-run, nor be guarded, when the param changes)."""


class StageParams:
    """What one stage may read of params.yaml: ``paths``, its own section and the keys of other sections it declares
    (``reads``: its row's ``Stage.reads``). Reading anything else raises :class:`UndeclaredParam` naming the key, so a
    stage cannot depend on a param that dvc.yaml does not list."""

    def __init__(self, params: Params, stage: str, reads: Sequence[str] = ()) -> None:
        self._params, self._stage, self._reads = params, stage, tuple(reads)

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name not in self._params.sections():
            raise AttributeError(name)
        if name in ("paths", self._stage):
            return self._params.section(name)
        keys = [d.split(".", 1)[1] for d in self._reads if d.split(".", 1)[0] == name]
        return _DeclaredKeys(self._params.section(name), name, keys, self._stage)


class _DeclaredKeys:
    """Another stage's section as one stage sees it: only the keys that stage declares."""

    def __init__(self, section: Any, name: str, keys: list[str], stage: str) -> None:
        self._section, self._name, self._keys, self._stage = section, name, keys, stage

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        if key not in self._keys:
            raise UndeclaredParam(f"stage {self._stage} reads {self._name}.{key}, which it does not declare: add it to "
                                  f"the reads of stage {self._stage!r} (tasks/spec/stage.py: Stage.reads) and to the "
                                  "stage's params in dvc.yaml (else a change to it would neither re-run nor stop the "
                                  "stage)")
        return getattr(self._section, key)


__all__ = [
    "ConfigSection", "METRIC_KEYS", "PAIRED_METRICS", "PARAMS_FILE", "PATH_KEYS", "Params", "ParamsError",
    "PathsParams", "PolicySwitch", "RegistryParams", "VERIFIED_METRICS", "SampledPolicy", "StageParams", "UndeclaredParam",
    "apply_overrides", "as_dict", "build_section", "check_paths", "cross_section_values", "load", "load_paths", "parse",
    "read_raw",
    "section_keys", "stage_enabled",
]
