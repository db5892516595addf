"""The one loader for ``params.yaml``: one dataclass per section, unknown or missing keys rejected.

``params.yaml`` has one section per pipeline stage (plus ``paths`` and ``registry``). Each section mirrors
the dataclass below key for key; ``dvc.yaml`` lists, per stage, exactly the keys of that stage's section
(``tests/test_params.py`` checks that the three agree). Fields whose names match ``PPOConfig`` /
``TrainingArguments`` fields keep those names so they can be passed straight through.

Hardware is not a parameter: the accelerate config is chosen outside this file (``ACCELERATE_CONFIG_FILE``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


from tasks import param_rules

PARAMS_FILE = "params.yaml"

# The DVC stages, in pipeline order (registry is an MLflow step, not a DVC stage).
STAGES = ("prepare", "sft", "reward_model", "ppo", "dpo", "evaluate")


class ParamsError(ValueError):
    """params.yaml does not match the dataclasses (unknown, missing or mistyped key)."""


@dataclass(frozen=True)
class PathsParams:
    """Directory layout shared by every stage; dvc.yaml's deps and outs use the same paths."""

    data: str = "data"
    """Prepared datasets (DVC-cached)."""
    models: str = "models"
    """Trained checkpoints, one directory per stage (DVC-cached)."""
    metrics: str = "metrics"
    """One ``<stage>.json`` per stage (git-tracked, ``cache: false``)."""
    plots: str = "plots"
    """One ``<stage>.csv`` per stage (git-tracked, ``cache: false``)."""
    incoming: str = "incoming"
    """New data for retraining: review files and preference files dropped here are merged by prepare."""
    allow_outside: bool = False
    """Allow the paths above to resolve outside the project directory (``..``, absolute, symlinks); off by default."""


@dataclass(frozen=True)
class PrepareParams:
    """Dataset preparation: corpus, prompts and gold-labelled preference pairs."""

    source: str = "synthetic"
    """``synthetic`` (generated offline), a local file/dir (txt, jsonl, csv, parquet) or ``hub:<dataset name>``."""
    source_revision: str = ""
    """Hub dataset revision (a new revision is new data for retraining); empty = default branch."""
    split: str = "train"
    """Hub split to read."""
    text_field: str = "text"
    """Column holding the review text (jsonl/csv/parquet/hub)."""
    num_reviews: int = 4000
    """Synthetic: how many reviews to generate. Files/hub: cap on reviews read (0 = all)."""
    max_words: int = 40
    """Reviews longer than this many words are truncated at a word boundary."""
    prompt_min_words: int = 2
    """Prompts are the first N words of a review, N drawn from [prompt_min_words, prompt_max_words]."""
    prompt_max_words: int = 4
    """Upper bound of the prompt length in words."""
    eval_fraction: float = 0.1
    """Share of reviews held out for evaluation (prompts and perplexity text)."""
    pairs_per_review: int = 1
    """Preference pairs built per training review (its continuation against another review's)."""
    min_margin: float = 0.3
    """Minimum gold-judge score gap between chosen and rejected; closer pairs are dropped."""
    seed: int = 0
    """Seed for generation, shuffling and pairing."""


@dataclass(frozen=True)
class SFTParams:
    """Supervised fine-tuning of the policy on the corpus (tokenizer trained on the corpus when offline)."""

    model_name: str = ""
    """Empty: build a small model from the config below; else a hub name or local path (e.g. ``gpt2``)."""
    arch: str = "gpt2"
    """Architecture of the built model: ``gpt2`` or ``llama``."""
    vocab_size: int = 2000
    """Byte-level BPE vocabulary trained on the corpus (built model only)."""
    hidden_size: int = 128
    """Width of the built model."""
    num_layers: int = 3
    """Transformer blocks of the built model."""
    num_heads: int = 4
    """Attention heads of the built model."""
    max_positions: int = 96
    """Context length of the built model."""
    max_seq_length: int = 64
    """SFT truncates training texts to this many tokens."""
    learning_rate: float = 2e-3
    """AdamW learning rate."""
    num_train_epochs: float = 4.0
    """Passes over the corpus."""
    per_device_train_batch_size: int = 32
    """Batch size."""
    warmup_steps: float = 0.05
    """Linear warm-up: a share of the steps when < 1, else a step count (TrainingArguments.warmup_steps)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Seed for initialisation and data order."""


@dataclass(frozen=True)
class RewardModelParams:
    """Pairwise reward model on the preference pairs, initialised from the SFT model (InstructGPT)."""

    init_from: str = "sft"
    """``sft`` (the SFT checkpoint, as in InstructGPT) or a hub name / local path."""
    max_length: int = 64
    """Chosen/rejected texts are truncated to this many tokens."""
    learning_rate: float = 1e-3
    """AdamW learning rate."""
    num_train_epochs: float = 1.0
    """Passes over the pairs."""
    per_device_train_batch_size: int = 32
    """Pairs per batch."""
    seed: int = 0
    """Seed for the score head and data order."""


@dataclass(frozen=True)
class PPOParams:
    """PPO against the reward with a KL penalty to the SFT reference. Names match ``PPOConfig`` fields
    except the stage-only ones at the end (``total_steps``, ``max_new_tokens``, ``reward``)."""

    learning_rate: float = 5e-4
    """Adam learning rate (PPOConfig.learning_rate)."""
    batch_size: int = 64
    """Rollouts per PPO step."""
    mini_batch_size: int = 16
    """Minibatch size inside a PPO step."""
    gradient_accumulation_steps: int = 1
    """Minibatches accumulated per optimiser step."""
    ppo_epochs: int = 4
    """Optimisation epochs per batch of rollouts."""
    init_kl_coef: float = 0.1
    """Initial KL penalty coefficient."""
    adap_kl_ctrl: bool = True
    """Adapt the KL coefficient towards ``target``."""
    target: float = 6.0
    """Target KL for the adaptive controller."""
    horizon: float = 10000.0
    """Horizon of the adaptive KL controller."""
    kl_penalty: str = "kl"
    """KL estimator: kl, abs, mse or full."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    cliprange: float = 0.2
    """Policy ratio clip range."""
    cliprange_value: float = 0.2
    """Value clip range."""
    vf_coef: float = 0.1
    """Value loss coefficient."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    use_score_scaling: bool = False
    """Scale scores by a running standard deviation."""
    use_score_norm: bool = False
    """Also subtract the running mean (needs use_score_scaling)."""
    whiten_rewards: bool = False
    """Whiten per-token rewards before GAE."""
    seed: int = 0
    """Seed for sampling and minibatch order."""
    total_steps: int = 40
    """Stage-only: number of PPO steps (batches of rollouts)."""
    max_new_tokens: int = 20
    """Stage-only: tokens sampled per response."""
    reward: str = "reward_model"
    """Stage-only: ``reward_model`` (the learned RM), ``gold`` (VADER) or ``pipeline:<hub classifier>``."""


@dataclass(frozen=True)
class DPOParams:
    """Direct preference optimisation of the SFT policy on the preference pairs."""

    beta: float = 0.1
    """Strength of the implicit KL constraint to the reference."""
    learning_rate: float = 5e-4
    """AdamW learning rate."""
    num_train_epochs: float = 2.0
    """Passes over the pairs."""
    per_device_train_batch_size: int = 32
    """Pairs per batch."""
    max_length: int = 64
    """Prompt + completion truncation, in tokens."""
    max_prompt_length: int = 16
    """Prompt truncation, in tokens."""
    seed: int = 0
    """Seed for data order."""


@dataclass(frozen=True)
class EvaluateParams:
    """Compare the SFT, PPO and DPO policies on held-out prompts."""

    num_prompts: int = 256
    """Held-out prompts sampled per policy."""
    max_new_tokens: int = 20
    """Tokens sampled per response (same as PPO for a fair comparison)."""
    batch_size: int = 64
    """Generation / scoring batch size."""
    num_samples: int = 12
    """Samples shown in the before/after table."""
    seed: int = 0
    """Seed for sampling."""


@dataclass(frozen=True)
class RegistryParams:
    """The registry rule: which evaluated policy becomes challenger, and when it replaces the champion."""

    model_name: str = "rlhf-policy"
    """Registered model name in MLflow."""
    candidates: list = field(default_factory=lambda: ["ppo", "dpo"])
    """Evaluated policies eligible for registration; the best by ``metric`` becomes the challenger."""
    metric: str = "gold_reward"
    """evaluate.json key that decides (higher is better)."""
    min_improvement: float = 0.02
    """Challenger must beat the champion's metric by at least this much."""
    max_kl: float = 20.0
    """Challenger's KL to the SFT reference must not exceed this."""


@dataclass(frozen=True)
class Params:
    """All of params.yaml."""

    paths: PathsParams
    prepare: PrepareParams
    sft: SFTParams
    reward_model: RewardModelParams
    ppo: PPOParams
    dpo: DPOParams
    evaluate: EvaluateParams
    registry: RegistryParams

    def section(self, name: str):
        return getattr(self, name)


SECTIONS: dict[str, type] = {
    "paths": PathsParams, "prepare": PrepareParams, "sft": SFTParams, "reward_model": RewardModelParams,
    "ppo": PPOParams, "dpo": DPOParams, "evaluate": EvaluateParams, "registry": RegistryParams,
}


def _check_type(where: str, name: str, value: Any, declared: Any) -> Any:
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


def build_section(name: str, raw: Any, source: str = PARAMS_FILE):
    """Build the dataclass of section ``name`` from a mapping; unknown or missing keys are errors."""
    cls = SECTIONS[name]
    if not isinstance(raw, dict):
        raise ParamsError(f"{source}: section {name!r} must be a mapping, got {type(raw).__name__}")
    declared = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(declared))
    missing = sorted(set(declared) - set(raw))
    if unknown:
        raise ParamsError(f"{source}: unknown key(s) in section {name!r}: {', '.join(unknown)}")
    if missing:
        raise ParamsError(f"{source}: missing key(s) in section {name!r}: {', '.join(missing)}")
    values = {k: _check_type(f"{source}:{name}", k, raw[k], declared[k].type) for k in declared}
    return cls(**values)


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
    need(p.ppo.total_steps >= 1, "ppo.total_steps must be >= 1")
    need(p.ppo.reward in ("reward_model", "gold") or p.ppo.reward.startswith("pipeline:"),
         "ppo.reward must be reward_model, gold or pipeline:<model>")
    need(p.dpo.max_prompt_length < p.dpo.max_length, "dpo.max_prompt_length must be < dpo.max_length")
    need(p.sft.hidden_size % p.sft.num_heads == 0, "sft.hidden_size must be divisible by sft.num_heads")
    need(set(p.registry.candidates) <= {"sft", "ppo", "dpo"} and p.registry.candidates,
         "registry.candidates must be a non-empty subset of [sft, ppo, dpo]")
    need(p.registry.metric in METRIC_KEYS, f"registry.metric must be one of {METRIC_KEYS}")


# evaluate.json: one object per policy with these keys.
POLICIES = ("sft", "ppo", "dpo")
METRIC_KEYS = ("gold_reward", "rm_reward", "kl", "perplexity", "win_rate")


def read_raw(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: params file not found")
    raw = param_rules.load_yaml(path)  # a syntax error names file:line:column
    return raw if raw is not None else {}


# The keys of the paths section that name directories the stages write to (or, for incoming, read and track).
PATH_KEYS = ("data", "models", "metrics", "plots", "incoming")


def check_paths(root: str | Path, paths: PathsParams, source: str = PARAMS_FILE) -> dict[str, Path]:
    """Every ``paths.*`` directory resolved under ``root``; a :class:`ParamsError` naming the key if one escapes
    the project (``..``, an absolute path, a symlink) while ``paths.allow_outside`` is false."""
    from rlhf_core.checkpointing import resolve_output_path

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
    """A section as a flat dict (for MLflow params)."""
    return dataclasses.asdict(section)


def stage_param_keys(stage: str) -> list[str]:
    """The dotted params a DVC stage depends on: every key of its own section."""
    return [f"{stage}.{f.name}" for f in fields(SECTIONS[stage])]


# What each stage reads and writes, relative to the paths section. dvc.yaml must say the same
# (tests/test_params.py). Code deps are listed in dvc.yaml only.
def load_stage(root: str | Path, stage: str) -> tuple[Path, Params, Any, dict[str, list[str]]]:
    """A stage's start: the resolved project root, all params, the stage's own section and its DVC deps/outs."""
    root = Path(root).resolve()
    params = load_params(root / PARAMS_FILE)
    return root, params, getattr(params, stage), stage_io(params.paths)[stage]


def stage_io(paths: PathsParams) -> dict[str, dict[str, list[str]]]:
    d, m = paths.data, paths.models
    io = {
        "prepare": {"deps": [paths.incoming],
                    "outs": [f"{d}/sft_train.jsonl", f"{d}/heldout.jsonl", f"{d}/prompts_train.jsonl",
                             f"{d}/prompts_eval.jsonl", f"{d}/preferences.jsonl"]},
        "sft": {"deps": [f"{d}/sft_train.jsonl"], "outs": [f"{m}/sft"]},
        "reward_model": {"deps": [f"{d}/preferences.jsonl", f"{m}/sft"], "outs": [f"{m}/reward_model"]},
        "ppo": {"deps": [f"{d}/prompts_train.jsonl", f"{m}/sft", f"{m}/reward_model"], "outs": [f"{m}/ppo"]},
        "dpo": {"deps": [f"{d}/preferences.jsonl", f"{m}/sft"], "outs": [f"{m}/dpo"]},
        "evaluate": {"deps": [f"{d}/prompts_eval.jsonl", f"{d}/heldout.jsonl", f"{m}/sft", f"{m}/reward_model",
                              f"{m}/ppo", f"{m}/dpo"], "outs": []},
    }
    for stage, entry in io.items():
        entry["metrics"] = [f"{paths.metrics}/{stage}.json"]
        entry["plots"] = [f"{paths.plots}/{stage}.csv"]
    return io


__all__ = [
    "PARAMS_FILE", "STAGES", "POLICIES", "METRIC_KEYS", "ParamsError", "Params", "PathsParams", "PrepareParams",
    "SFTParams", "RewardModelParams", "PPOParams", "DPOParams", "EvaluateParams", "RegistryParams", "SECTIONS",
    "load_params", "parse_params", "build_section", "apply_overrides", "as_dict", "stage_param_keys", "stage_io",
    "read_raw", "validate", "PATH_KEYS", "check_paths",
]
