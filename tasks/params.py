"""The one loader for ``params.yaml``: one schema per section, unknown or missing keys rejected.

One source of values: ``params.yaml`` (the dataclasses here have no defaults; every key must be there).
One source of field docs: a section that configures a library trainer (``ppo``) lists which fields of the
rlhf_core config dataclass it sets (``PPO_CONFIG_KEYS``: names only; types and docs on ``PPOConfig``) and
keeps its stage-only keys in a small dataclass (``PPOStageParams``). The other sections are stage-only
dataclasses; fields that match ``TrainingArguments`` keep those names so they pass straight through.

``params.yaml`` has one section per pipeline stage (plus ``paths`` and ``registry``); ``dvc.yaml`` lists, per
stage, exactly the keys of that stage's section (``tests/test_params.py`` checks that the three agree).

Hardware is not a parameter: the accelerate config is chosen outside this file (``ACCELERATE_CONFIG_FILE``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar


from tasks import param_rules
from tasks.param_rules import PATH_KEYS, ParamsError

from tasks.paths import resolve_output_path

PARAMS_FILE = "params.yaml"

# The DVC stages of the default pipeline, in order (registry is an MLflow step, not a DVC stage).
STAGES = ("prepare", "sft", "reward_model", "ppo", "dpo", "grpo", "rloo", "kto", "evaluate")

POLICY_STAGES = ("ppo", "dpo", "grpo", "rloo", "kto")
"""Stages that train a policy from the SFT model; each runs only when its section's ``enabled`` is true (a disabled
one still runs, writing a placeholder ``models/<stage>`` and ``metrics/<stage>.json`` = ``{"enabled": false}``,
so DVC records it and ``dvc status`` stays clean). ``evaluate`` scores SFT and every enabled policy."""
WINDOW_STAGES = ("ppo", "dpo", "kto")
"""Policy stages that score held-out samples every ``sample_every`` steps (tasks/samples.py): each also writes
``plots/<stage>_windows.csv``, which ``evaluate`` reads to draw the reward-KL frontier (``plots/frontier.csv``)."""

OPTIONAL_STAGES = ("ddpo",)
"""DVC stages outside the default run: run by name, or by the pipeline flow when their section's ``enabled``."""

ALL_STAGES = STAGES + OPTIONAL_STAGES


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
class PrepareParams:
    """Dataset preparation: corpus, prompts and gold-labelled preference pairs."""

    source: str
    """``synthetic`` (generated offline), a local file/dir (txt, jsonl, csv, parquet) or ``hub:<dataset name>``."""
    source_revision: str
    """Hub dataset revision (a new revision is new data for retraining); empty = default branch."""
    split: str
    """Hub split to read."""
    text_field: str
    """Column holding the review text (jsonl/csv/parquet/hub)."""
    num_reviews: int
    """Synthetic: how many reviews to generate. Files/hub: cap on reviews read (0 = all)."""
    max_words: int
    """Reviews longer than this many words are truncated at a word boundary."""
    prompt_min_words: int
    """Prompts are the first N words of a review, N drawn from [prompt_min_words, prompt_max_words]."""
    prompt_max_words: int
    """Upper bound of the prompt length in words."""
    eval_fraction: float
    """Share of reviews held out for evaluation (prompts and perplexity text)."""
    pairs_per_review: int
    """Preference pairs built per training review (its continuation against another review's)."""
    min_margin: float
    """Minimum gold-judge score gap between chosen and rejected; closer pairs are dropped."""
    seed: int
    """Seed for generation, shuffling and pairing."""


@dataclass(frozen=True)
class SFTParams:
    """Supervised fine-tuning of the policy on the corpus (tokenizer trained on the corpus when offline)."""

    model_name: str
    """Empty: build a small model from the config below; else a hub name or local path (e.g. ``gpt2``)."""
    arch: str
    """Architecture of the built model: ``gpt2`` or ``llama``."""
    vocab_size: int
    """Byte-level BPE vocabulary trained on the corpus (built model only)."""
    hidden_size: int
    """Width of the built model."""
    num_layers: int
    """Transformer blocks of the built model."""
    num_heads: int
    """Attention heads of the built model."""
    max_positions: int
    """Context length of the built model."""
    max_seq_length: int
    """SFT truncates training texts to this many tokens."""
    learning_rate: float
    """AdamW learning rate."""
    num_train_epochs: float
    """Passes over the corpus."""
    per_device_train_batch_size: int
    """Batch size."""
    warmup_steps: float
    """Linear warm-up: a share of the steps when < 1, else a step count (TrainingArguments.warmup_steps)."""
    weight_decay: float
    """AdamW weight decay."""
    seed: int
    """Seed for initialisation and data order."""


@dataclass(frozen=True)
class RewardModelParams:
    """Pairwise reward model on the preference pairs, initialised from the SFT model (InstructGPT)."""

    init_from: str
    """``sft`` (the SFT checkpoint, as in InstructGPT) or a hub name / local path."""
    max_length: int
    """Chosen/rejected texts are truncated to this many tokens."""
    learning_rate: float
    """AdamW learning rate."""
    num_train_epochs: float
    """Passes over the pairs."""
    per_device_train_batch_size: int
    """Pairs per batch."""
    seed: int
    """Seed for the score head and data order."""


PPO_CONFIG_KEYS = (
    "learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs", "init_kl_coef",
    "adap_kl_ctrl", "target", "horizon", "kl_penalty", "gamma", "lam", "cliprange", "cliprange_value", "vf_coef",
    "max_grad_norm", "use_score_scaling", "use_score_norm", "whiten_rewards", "seed",
)
"""The ``PPOConfig`` fields the ppo section sets, in params.yaml's order (types and docs: ``PPOConfig``)."""


@dataclass(frozen=True)
class PolicySwitch:
    """The key of every policy stage's section."""

    enabled: bool
    """Train this policy; false: the stage writes a placeholder quickly and evaluate skips it."""


@dataclass(frozen=True)
class SampledPolicy(PolicySwitch):
    """A policy stage that scores held-out samples along training (tasks/samples.py)."""

    sample_every: int
    """Every this many steps (and at the last), sample the first ``sample_prompts`` held-out prompts, score them with
    the gold judge, log the table and a reward-KL point (plots/<stage>_windows.csv, tasks/samples.py); 0: never."""
    sample_prompts: int
    """How many held-out prompts (the first of data/prompts_eval.jsonl) each sample window scores."""


@dataclass(frozen=True)
class PPOStageParams(SampledPolicy):
    """The ppo section's keys that are not ``PPOConfig`` fields."""

    total_steps: int
    """Number of PPO steps (batches of rollouts)."""
    max_new_tokens: int
    """Tokens sampled per response."""
    reward: str
    """``reward_model`` (the learned RM), ``gold`` (VADER) or ``pipeline:<hub classifier>``."""
    save_steps: int
    """Write the resumable PPO checkpoint every this many steps (0: only on SIGTERM/SIGINT)."""


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
        import typing

        import rlhf_core

        hints = typing.get_type_hints(getattr(rlhf_core, cls.CONFIG))
        return {**{k: hints[k] for k in cls.CONFIG_KEYS}, **{f.name: f.type for f in fields(cls.STAGE)}}

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ConfigSection:
        config = {k: values[k] for k in cls.CONFIG_KEYS}
        return cls(config=config, stage=cls.STAGE(**{f.name: values[f.name] for f in fields(cls.STAGE)}))

    def as_dict(self) -> dict[str, Any]:
        return {**self.config, **dataclasses.asdict(self.stage)}


@dataclass(frozen=True)
class PPOParams(ConfigSection, config="PPOConfig", keys=PPO_CONFIG_KEYS, stage=PPOStageParams):
    """PPO against the reward with a KL penalty to the SFT reference: ``PPOConfig`` keys + ``PPOStageParams``."""


DDPO_CONFIG_KEYS = (
    "num_epochs", "sample_num_steps", "sample_batch_size", "sample_num_batches_per_epoch", "sample_guidance_scale",
    "train_batch_size", "train_learning_rate", "train_clip_range", "seed",
)
"""The ``DDPOConfig`` fields the ddpo section sets, in params.yaml's order (types and docs: ``DDPOConfig``)."""


@dataclass(frozen=True)
class DDPOStageParams:
    """The ddpo section's keys that are not ``DDPOConfig`` fields."""

    enabled: bool
    """Run ddpo in the default pipeline flow (``make run``) after evaluate; off: only when asked for by name."""
    reward: str
    """``compressibility`` or ``incompressibility`` (JPEG size of the generated images)."""
    use_lora: bool
    """Train LoRA adapters instead of the whole UNet."""
    num_prompts: int
    """Prompts are drawn from the first this many animal names."""


@dataclass(frozen=True)
class DDPOParams(ConfigSection, config="DDPOConfig", keys=DDPO_CONFIG_KEYS, stage=DDPOStageParams):
    """DDPO on a tiny Stable-Diffusion-shaped pipeline built from configs: ``DDPOConfig`` keys + ``DDPOStageParams``."""


GRPO_CONFIG_KEYS = (
    "learning_rate", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
    "beta", "epsilon", "loss_type", "scale_rewards", "num_iterations", "temperature", "seed",
)
"""The ``GRPOConfig`` fields (TRL 1.16 names) the grpo section sets, in params.yaml's order (docs: ``GRPOConfig``)."""

RLOO_CONFIG_KEYS = (
    "learning_rate", "per_device_train_batch_size", "num_generations", "max_completion_length", "max_steps",
    "beta", "epsilon", "num_iterations", "normalize_advantages", "temperature", "seed",
)
"""The ``RLOOConfig`` fields (TRL 1.16 names) the rloo section sets, in params.yaml's order (docs: ``RLOOConfig``)."""

KTO_CONFIG_KEYS = (
    "beta", "learning_rate", "num_train_epochs", "per_device_train_batch_size", "max_length", "desirable_weight",
    "undesirable_weight", "seed",
)
"""The ``KTOConfig`` fields (TRL 1.16 names) the kto section sets, in params.yaml's order (docs: ``KTOConfig``)."""

ONLINE_REWARDS = ("reward_model", "gold")
"""What GRPO/RLOO optimise: the learned reward model (``models/reward_model``) or the gold judge (VADER)."""


@dataclass(frozen=True)
class OnlineStageParams(PolicySwitch):
    """The grpo/rloo sections' keys that are not ``GRPOConfig``/``RLOOConfig`` fields."""

    reward: str
    """``reward_model`` (the learned RM, as PPO) or ``gold`` (VADER: a verifiable reward, for experiments)."""


@dataclass(frozen=True)
class KTOStageParams(SampledPolicy):
    """The kto section's keys that are not ``KTOConfig`` fields (those of every sampled policy)."""


@dataclass(frozen=True)
class GRPOParams(ConfigSection, config="GRPOConfig", keys=GRPO_CONFIG_KEYS, stage=OnlineStageParams):
    """GRPO of the SFT policy against the reward (group-relative advantages): ``GRPOConfig`` keys + stage keys."""


@dataclass(frozen=True)
class RLOOParams(ConfigSection, config="RLOOConfig", keys=RLOO_CONFIG_KEYS, stage=OnlineStageParams):
    """RLOO of the SFT policy against the reward (leave-one-out baseline): ``RLOOConfig`` keys + stage keys."""


@dataclass(frozen=True)
class KTOParams(ConfigSection, config="KTOConfig", keys=KTO_CONFIG_KEYS, stage=KTOStageParams):
    """KTO of the SFT policy on the unpaired thumbs-up/down ratings: ``KTOConfig`` keys + ``KTOStageParams``."""


@dataclass(frozen=True)
class DPOParams(SampledPolicy):
    """Direct preference optimisation of the SFT policy on the preference pairs."""

    beta: float
    """Strength of the implicit KL constraint to the reference."""
    loss_type: str
    """The DPO loss, any of TRL 0.11.4's (``rlhf_core.losses.DPO_LOSS_TYPES``; ``sigmoid`` is the DPO paper's)."""
    learning_rate: float
    """AdamW learning rate."""
    num_train_epochs: float
    """Passes over the pairs."""
    per_device_train_batch_size: int
    """Pairs per batch."""
    max_length: int
    """Prompt + completion truncation, in tokens."""
    max_prompt_length: int
    """Prompt truncation, in tokens."""
    seed: int
    """Seed for data order."""


@dataclass(frozen=True)
class EvaluateParams:
    """Compare SFT and every enabled policy (ppo, dpo, grpo, rloo, kto) on held-out prompts."""

    num_prompts: int
    """Held-out prompts sampled per policy."""
    max_new_tokens: int
    """Tokens sampled per response (same as PPO for a fair comparison)."""
    batch_size: int
    """Generation / scoring batch size."""
    num_samples: int
    """Samples shown in the before/after table."""
    seed: int
    """Seed for sampling."""


@dataclass(frozen=True)
class RegistryParams:
    """The registry rule: which evaluated policy becomes challenger, and when it replaces the champion."""

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
    significance: float
    """And the win must be larger than the evaluation's noise: the paired bootstrap test over the evaluation
    prompts (rlhf_core.evaluation.paired_bootstrap) must give a one-sided p-value below this."""
    bootstrap_samples: int
    """Resamples of the evaluation prompts in that test."""
    seed: int
    """Seed of the resampling (the same decision on every machine)."""


@dataclass(frozen=True)
class Params:
    """All of params.yaml."""

    paths: PathsParams
    prepare: PrepareParams
    sft: SFTParams
    reward_model: RewardModelParams
    ppo: PPOParams
    dpo: DPOParams
    grpo: GRPOParams
    rloo: RLOOParams
    kto: KTOParams
    evaluate: EvaluateParams
    ddpo: DDPOParams
    registry: RegistryParams

    def section(self, name: str):
        return getattr(self, name)


SECTIONS: dict[str, type] = {
    "paths": PathsParams, "prepare": PrepareParams, "sft": SFTParams, "reward_model": RewardModelParams,
    "ppo": PPOParams, "dpo": DPOParams,
    "grpo": GRPOParams, "rloo": RLOOParams, "kto": KTOParams, "evaluate": EvaluateParams, "ddpo": DDPOParams, "registry": RegistryParams,
}


def _plain_type(declared: Any) -> Any:
    """The type to check a YAML value against: ``Optional[X]`` -> X, ``Literal[...]`` -> its values' type."""
    import typing

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
        raise ParamsError(f"{where}.{name}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    return value


def section_keys(name: str) -> dict[str, Any]:
    """Every key of section ``name``, in params.yaml's order, with its declared type."""
    cls = SECTIONS[name]
    if issubclass(cls, ConfigSection):
        return cls.declared()
    return {f.name: f.type for f in fields(cls)}


def build_section(name: str, raw: Any, source: str = PARAMS_FILE):
    """Build the section object of ``name`` from a mapping; unknown or missing keys are errors (no defaults)."""
    cls = SECTIONS[name]
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: section {name!r} must be a mapping, got {type(raw).__name__}")
    declared = section_keys(name)
    unknown = sorted(set(raw) - set(declared))
    missing = sorted(set(declared) - set(raw))
    if unknown:
        raise ParamsError(f"{source}: unknown key(s) in section {name!r}: {', '.join(unknown)}")
    if missing:
        raise ParamsError(f"{source}: missing key(s) in section {name!r}: {', '.join(missing)}")
    values = {k: _check_type(f"{source}:{name}", k, raw[k], declared[k]) for k in declared}
    return cls.from_values(values) if issubclass(cls, ConfigSection) else cls(**values)


def parse_params(raw: Any, source: str = PARAMS_FILE) -> Params:
    """Build :class:`Params` from the parsed YAML mapping."""
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: expected a mapping of sections, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(SECTIONS))
    missing = sorted(set(SECTIONS) - set(raw))
    if unknown:
        raise ParamsError(f"{source}: unknown section(s): {', '.join(unknown)}")
    if missing:
        raise ParamsError(f"{source}: missing section(s): {', '.join(missing)}")
    params = Params(**{name: build_section(name, raw[name], source) for name in SECTIONS})
    param_rules.check(raw, source)  # value rules (sizes, rates, vocabularies, positions, paths), naming the key
    validate(params, source)
    return params


def validate(p: Params, source: str = PARAMS_FILE) -> None:
    """Cross-field rules, checked before any stage touches state."""
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ParamsError(f"{source}: {msg}")

    need(p.prepare.prompt_min_words >= 1, "prepare.prompt_min_words must be >= 1")
    need(p.prepare.prompt_max_words >= p.prepare.prompt_min_words,
         "prepare.prompt_max_words must be >= prepare.prompt_min_words")
    need(0.0 < p.prepare.eval_fraction < 1.0, "prepare.eval_fraction must be in (0, 1)")
    need(p.ppo.batch_size % p.ppo.mini_batch_size == 0, "ppo.batch_size must be a multiple of ppo.mini_batch_size")
    backward = p.ppo.mini_batch_size * p.ppo.gradient_accumulation_steps  # what PPOConfig checks when the stage starts
    need(p.ppo.batch_size % backward == 0,
         f"ppo.gradient_accumulation_steps: ppo.batch_size ({p.ppo.batch_size}) must be a multiple of "
         f"ppo.mini_batch_size x ppo.gradient_accumulation_steps ({p.ppo.mini_batch_size} x "
         f"{p.ppo.gradient_accumulation_steps} = {backward})")
    # KTOConfig's own rules for the default loss (its KL estimate pairs each row with a neighbour in the batch)
    need(p.kto.per_device_train_batch_size >= 2, "kto.per_device_train_batch_size: must be >= 2 (KTO's KL estimate "
         "pairs each row with another of its batch)")
    need(p.kto.max_length >= 2, "kto.max_length: must be >= 2 (a prompt token and a completion token)")
    need(p.ppo.total_steps >= 1, "ppo.total_steps must be >= 1")
    need(p.ppo.reward in ("reward_model", "gold") or p.ppo.reward.startswith("pipeline:"),
         "ppo.reward must be reward_model, gold or pipeline:<model>")
    need(p.dpo.max_prompt_length < p.dpo.max_length, "dpo.max_prompt_length must be < dpo.max_length")
    need(p.sft.hidden_size % p.sft.num_heads == 0, "sft.hidden_size must be divisible by sft.num_heads")
    need(set(p.registry.candidates) <= set(POLICIES) and p.registry.candidates,
         f"registry.candidates must be a non-empty subset of {list(POLICIES)}")
    need(any(stage_enabled(p, c) for c in p.registry.candidates),
         "registry.candidates names no enabled policy (sft, or a policy stage whose section has enabled: true)")
    for stage in ("grpo", "rloo"):
        section = p.section(stage)
        need(section.reward in ONLINE_REWARDS, f"{stage}.reward must be one of {ONLINE_REWARDS}")
        need(section.max_steps >= 1, f"{stage}.max_steps must be >= 1")
        need(section.num_generations >= 2, f"{stage}.num_generations must be >= 2")
        need(section.per_device_train_batch_size % section.num_generations == 0,
             f"{stage}.per_device_train_batch_size must be a multiple of {stage}.num_generations")
    need(p.registry.metric in PAIRED_METRICS, f"registry.metric must be one of {PAIRED_METRICS} (higher is better, "
                                               "one value per evaluation prompt for the paired test)")
    need(p.ddpo.reward in DDPO_REWARDS, f"ddpo.reward must be one of {DDPO_REWARDS}")
    need(1 <= p.ddpo.num_prompts <= 24, "ddpo.num_prompts must be in [1, 24] (the animal prompts)")
    need(p.ddpo.num_epochs >= 1, "ddpo.num_epochs must be >= 1")


DDPO_REWARDS = ("compressibility", "incompressibility")


# evaluate.json: one object per policy with these keys.
POLICIES = ("sft",) + POLICY_STAGES
METRIC_KEYS = ("gold_reward", "rm_reward", "kl", "perplexity", "win_rate")
PAIRED_METRICS = ("gold_reward", "rm_reward", "win_rate")
"""The metrics the registry can decide on: higher is better and each has a value per evaluation prompt."""


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


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate ``params.yaml``; the output paths are checked against the file's directory (the project)."""
    params = parse_params(read_raw(path), str(path))
    check_paths(Path(path).resolve().parent, params.paths, str(path))
    return params


def apply_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    """Return a copy of ``raw`` with ``{"ppo.learning_rate": 1e-4}``-style overrides applied (keys must exist)."""
    import copy

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


CROSS_SECTION_PARAMS: dict[str, tuple[str, ...]] = {
    stage: ("evaluate.max_new_tokens", "evaluate.seed") for stage in WINDOW_STAGES}
"""The keys of other sections a stage reads, by stage. The sample windows of ppo, dpo and kto score held-out prompts
exactly as ``evaluate`` does, with its ``max_new_tokens`` and ``seed`` (tasks/samples.py). Declared here, they are
params of the stage in dvc.yaml (a change re-runs it), the mid-run guard watches them (``tasks/dvc_ops.py``), the
resume key holds them (``tasks/resume.py:resume_key``), and ``load_stage`` lets the stage read them and nothing else
(:class:`StageParams`)."""


def stage_param_keys(stage: str) -> list[str]:
    """The dotted params a DVC stage depends on: every key of its own section, then those it reads elsewhere."""
    return [f"{stage}.{key}" for key in section_keys(stage)] + list(CROSS_SECTION_PARAMS.get(stage, ()))


def cross_section_values(params: Params | StageParams, stage: str) -> dict[str, Any]:
    """``{"evaluate.seed": 0, ...}``: the values of the keys ``stage`` reads outside its own section."""
    values = {}
    for dotted in CROSS_SECTION_PARAMS.get(stage, ()):
        section, key = dotted.split(".", 1)
        values[dotted] = getattr(params.section(section), key)
    return values


class UndeclaredParam(AttributeError):
    """A stage read a param it does not declare (it would not re-run, nor be guarded, when the param changes)."""


class StageParams:
    """What one stage may read of params.yaml (what :func:`load_stage` gives it): ``paths``, its own section and the
    keys of other sections it declares in ``CROSS_SECTION_PARAMS``. Reading anything else raises
    :class:`UndeclaredParam` naming the key, so a stage cannot depend on a param that dvc.yaml does not list."""

    def __init__(self, params: Params, stage: str) -> None:
        self._params, self._stage = params, stage

    def section(self, name: str) -> Any:
        return getattr(self, name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name not in SECTIONS:
            raise AttributeError(name)
        if name in ("paths", self._stage):
            return getattr(self._params, name)
        keys = [d.split(".", 1)[1] for d in CROSS_SECTION_PARAMS.get(self._stage, ()) if d.split(".", 1)[0] == name]
        return _DeclaredKeys(getattr(self._params, name), name, keys, self._stage)


class _DeclaredKeys:
    """Another stage's section as one stage sees it: only the keys that stage declares."""

    def __init__(self, section: Any, name: str, keys: list[str], stage: str) -> None:
        self._section, self._name, self._keys, self._stage = section, name, keys, stage

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        if key not in self._keys:
            raise UndeclaredParam(f"stage {self._stage} reads {self._name}.{key}, which it does not declare: add it to "
                                  f"CROSS_SECTION_PARAMS[{self._stage!r}] in tasks/params.py and to the stage's params "
                                  "in dvc.yaml (else a change to it would neither re-run nor stop the stage)")
        return getattr(self._section, key)


# What each stage reads and writes, relative to the paths section. dvc.yaml must say the same
# (tests/test_params.py). Code deps are listed in dvc.yaml only.
def stage_enabled(params: Params, stage: str) -> bool:
    """Whether ``stage`` does its work: ``sft`` and the non-policy stages always; a policy stage and ddpo when their
    section's ``enabled`` is true (a disabled one still runs and is recorded, writing a placeholder)."""
    section = params.section(stage) if stage in SECTIONS else None
    return bool(getattr(section, "enabled", True))


def load_stage(root: str | Path, stage: str) -> tuple[Path, StageParams, Any, dict[str, list[str]]]:
    """A stage's start: the resolved project root, the params it may read (:class:`StageParams`: its own section,
    ``paths`` and what it declares in ``CROSS_SECTION_PARAMS``), its own section and its DVC deps/outs."""
    root = Path(root).resolve()
    params = load_params(root / PARAMS_FILE)
    return root, StageParams(params, stage), getattr(params, stage), stage_io(params.paths)[stage]


def stage_io(paths: PathsParams) -> dict[str, dict[str, list[str]]]:
    d, m = paths.data, paths.models
    io = {
        "prepare": {"deps": [paths.incoming],
                    "outs": [f"{d}/sft_train.jsonl", f"{d}/heldout.jsonl", f"{d}/prompts_train.jsonl",
                             f"{d}/prompts_eval.jsonl", f"{d}/preferences.jsonl", f"{d}/ratings.jsonl"]},
        "sft": {"deps": [f"{d}/sft_train.jsonl"], "outs": [f"{m}/sft"]},
        "reward_model": {"deps": [f"{d}/preferences.jsonl", f"{m}/sft"], "outs": [f"{m}/reward_model"]},
        "ppo": {"deps": [f"{d}/prompts_train.jsonl", f"{m}/sft", f"{m}/reward_model", f"{d}/prompts_eval.jsonl"],
                "outs": [f"{m}/ppo"]},
        "dpo": {"deps": [f"{d}/preferences.jsonl", f"{m}/sft", f"{d}/prompts_eval.jsonl"], "outs": [f"{m}/dpo"]},
        "grpo": {"deps": [f"{d}/prompts_train.jsonl", f"{m}/sft", f"{m}/reward_model"], "outs": [f"{m}/grpo"]},
        "rloo": {"deps": [f"{d}/prompts_train.jsonl", f"{m}/sft", f"{m}/reward_model"], "outs": [f"{m}/rloo"]},
        "kto": {"deps": [f"{d}/ratings.jsonl", f"{m}/sft", f"{d}/prompts_eval.jsonl"], "outs": [f"{m}/kto"]},
        "evaluate": {"deps": [f"{d}/prompts_eval.jsonl", f"{d}/heldout.jsonl", f"{m}/sft", f"{m}/reward_model",
                              *(f"{paths.plots}/{s}_windows.csv" for s in WINDOW_STAGES),
                              *(f"{m}/{s}" for s in POLICY_STAGES)], "outs": [f"{d}/evaluate_prompts.csv"]},
        "ddpo": {"deps": [], "outs": [f"{m}/ddpo"]},
    }
    for stage, entry in io.items():
        entry["metrics"] = [f"{paths.metrics}/{stage}.json"]
        entry["plots"] = [f"{paths.plots}/{stage}.csv"]
    for stage in WINDOW_STAGES:  # reward-KL points along training (tasks/samples.py)
        io[stage]["plots"].append(f"{paths.plots}/{stage}_windows.csv")
    io["evaluate"]["plots"].append(f"{paths.plots}/frontier.csv")
    return io


__all__ = [
    "PARAMS_FILE", "STAGES", "POLICIES", "METRIC_KEYS", "PAIRED_METRICS", "ParamsError", "Params", "PathsParams", "PrepareParams",
    "SFTParams", "RewardModelParams", "PPOParams", "DPOParams", "EvaluateParams", "RegistryParams", "SECTIONS",
    "load_params", "parse_params", "build_section", "apply_overrides", "as_dict", "stage_param_keys", "stage_io",
    "read_raw", "validate", "PATH_KEYS", "check_paths", "ConfigSection", "PPOStageParams", "PPO_CONFIG_KEYS",
    "section_keys", "ALL_STAGES", "OPTIONAL_STAGES", "DDPOParams", "DDPOStageParams", "DDPO_CONFIG_KEYS",
    "DDPO_REWARDS", "stage_enabled", "POLICY_STAGES", "GRPOParams", "RLOOParams", "KTOParams", "OnlineStageParams",
    "PolicySwitch", "SampledPolicy", "CROSS_SECTION_PARAMS", "StageParams", "UndeclaredParam",
    "cross_section_values", "KTOStageParams", "WINDOW_STAGES", "GRPO_CONFIG_KEYS", "RLOO_CONFIG_KEYS", "KTO_CONFIG_KEYS", "ONLINE_REWARDS",
]
