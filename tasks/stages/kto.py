"""Stage ``kto``: KTOTrainer (TRL 1.16 API) of the SFT policy on the unpaired thumbs-up/down ratings
(``data/ratings.jsonl``: prompt, completion, label), reference = a frozen copy of the SFT policy.

Its params section (:class:`KTOParams`), its body (:func:`body`) and nothing else: the stage's row in
``tasks/stages/__init__.py`` names its files and flags, and ``tasks/run/stage_task.py`` writes what the body returns
(``metrics/kto.json``, ``plots/kto.csv``, ``plots/kto_windows.csv``) or, when ``kto.enabled`` is false, the
placeholders. The small complete example of a stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.data import read_ratings
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import ConfigSection, SampledPolicy
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.labelled_data import preference_file
from tasks.stages.common.policy import last_fifth_mean, load_sft_policy, train_policy, trainer_arguments
from tasks.stages.common.samples import sample_windows

KTO_CONFIG_KEYS = (
    "beta", "learning_rate", "num_train_epochs", "per_device_train_batch_size", "max_length", "desirable_weight",
    "undesirable_weight", "seed",
)
"""The ``KTOConfig`` fields (TRL 1.16 names) the kto section sets, in params.yaml's order (docs: ``KTOConfig``)."""


@dataclass(frozen=True)
class KTOStageParams(SampledPolicy):
    """The kto section's keys that are not ``KTOConfig`` fields (those of every sampled policy)."""


@dataclass(frozen=True)
class KTOParams(ConfigSection, config="KTOConfig", keys=KTO_CONFIG_KEYS, stage=KTOStageParams):
    """KTO of the SFT policy on the unpaired thumbs-up/down ratings: ``KTOConfig`` keys + ``KTOStageParams``."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("sample_prompts", "per_device_train_batch_size", "max_length"),
        non_negative_ints=("sample_every",),
        positive_floats=("beta", "learning_rate", "num_train_epochs"),
        non_negative_floats=("desirable_weight", "undesirable_weight"))
    """Value rules of the section (tasks/spec/param_rules.py applies them); the weights as KTOConfig
    checks them: a negative weight would reward the wrong side."""

    def problems(self, name: str) -> list[str]:
        """``KTOConfig``'s own rules for the default loss (its KL estimate pairs each row with a neighbour)."""
        return [message for broken, message in (
            (self.per_device_train_batch_size < 2, f"{name}.per_device_train_batch_size: must be >= 2 (KTO's KL "
                                                   "estimate pairs each row with another of its batch)"),
            (self.max_length < 2, f"{name}.max_length: must be >= 2 (a prompt token and a completion token)"),
        ) if broken]


COLUMNS = ("step", "loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins")
"""plots/kto.csv: per logged step (``kl``: the batch's KL reference point)."""
PLOT = dict(title="KTO loss", x="step", y="loss")
"""DVC's options of ``plots/kto.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def body(ctx: StageContext) -> StageResult:
    """Train ``models/kto`` on the ratings, scoring held-out samples every ``kto.sample_every`` steps."""
    from datasets import Dataset  # datasets and the trainers load transformers: only when the stage runs

    from rlhf_core import KTOConfig, KTOTrainer, set_seed

    p, run = ctx.section, ctx.run
    ratings_file, ratings_path = preference_file(ctx, "ratings", "ratings.jsonl")  # a verifiable task: label's
    ratings = read_ratings(ratings_file)  # every row validated; errors name the file and line
    labels = [r["label"] for r in ratings]
    if not any(labels) or all(labels):
        raise ValueError(f"{ratings_path}: KTO needs both desirable and undesirable rows "
                         f"({sum(labels)} of {len(labels)} are label: true)")
    set_seed(p.seed)
    tokenizer, model = load_sft_policy(ctx.dep("sft"))
    dataset = Dataset.from_dict({c: [r[c] for r in ratings] for c in ("prompt", "completion", "label")})
    run.log_dataset(ratings_file, "ratings")
    get_logger().info("kto: %d ratings (%d desirable), beta %.3g", len(ratings), sum(labels), p.beta)

    windows = None

    def build(ck):
        nonlocal windows
        windows, windows_callback = sample_windows(ctx, ck.dir / "sample_windows.json")
        return KTOTrainer(model, ref_model=None, args=trainer_arguments(KTOConfig, p, ck.dir), train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[ck.callback, windows_callback], tracker=run.tracker)

    trained, rows = train_policy(ctx, build, ("KTOTrainer", f"{ctx.io.deps['sft']} (SFT policy; also the reference)"))
    trainer = trained.trainer
    metrics = {"enabled": True, "final_loss": last_fifth_mean(rows, "loss"), "kl_last": last_fifth_mean(rows, "kl"),
               "final_reward_margin": last_fifth_mean(rows, "rewards/margins"), "num_ratings": len(ratings),
               "num_desirable": sum(labels), "steps": trainer.state.global_step, "num_processes": trainer.args.world_size}
    return StageResult(metrics, rows, windows=windows.points, finish=trained.finish)
