"""Stage ``dpo``: direct preference optimisation of the SFT policy on the preference pairs (loss: ``dpo.loss_type``).

The reference is a frozen copy of the SFT policy (``ref_model=None``). Writes ``models/dpo``; the wrapper writes
``metrics/dpo.json``, ``plots/dpo.csv`` and ``plots/dpo_windows.csv`` (every ``dpo.sample_every`` optimizer steps:
gold reward and KL to SFT of held-out samples, also logged as a sample table; tasks/stages/common/samples.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlhf_core.data import read_jsonl
from tasks.process.logs import get_logger
from tasks.spec.param_rules import ValueRules
from tasks.spec.params import SampledPolicy
from tasks.spec.stage import StageContext, StageResult
from tasks.stages.common.labelled_data import preference_file
from tasks.stages.common.policy import load_sft_policy
from tasks.stages.common.samples import sample_windows


@dataclass(frozen=True)
class DPOParams(SampledPolicy):
    """Direct preference optimisation of the SFT policy on the preference pairs."""

    RULES: ClassVar[ValueRules] = ValueRules(
        positive_ints=("per_device_train_batch_size", "max_length", "max_prompt_length", "sample_prompts"),
        non_negative_ints=("sample_every",),
        positive_floats=("beta", "learning_rate", "num_train_epochs"),
        choices={"loss_type": ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                               "aot", "aot_pair", "apo_zero", "apo_down")})
    """Value rules of the section (tasks/spec/param_rules.py applies them); ``loss_type``: rlhf_core.losses's
    ``DPO_LOSS_TYPES``, spelled out so loading params imports no loss code (tests/test_params.py keeps them equal)."""

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

    def problems(self, name: str) -> list[str]:
        """The prompt leaves room for a completion."""
        return [] if self.max_prompt_length < self.max_length else [
            f"{name}.max_prompt_length must be < {name}.max_length"]


COLUMNS = ("step", "loss", "reward_accuracy", "reward_margin")
"""plots/dpo.csv: per logged step, the loss and the implicit reward's accuracy and margin on the batch."""
PLOT = dict(title="DPO loss", x="step", y="loss")
"""DVC's options of ``plots/dpo.csv`` (dvc.yaml is rendered from them: ``tasks/run/dvc_yaml.py``)."""


def body(ctx: StageContext) -> StageResult:
    """Train ``models/dpo`` from ``data/preferences.jsonl`` (a verifiable task: the label stage's
    ``data/labelled/preferences.jsonl``), scoring held-out samples every ``dpo.sample_every``."""
    from datasets import Dataset  # datasets and the trainer load transformers: only when the stage runs

    from rlhf_core import DPOTrainer, set_seed
    from tasks.stages.common.resume import checkpointing_arguments, loss_curve, train_and_save, training_arguments

    p, run, log = ctx.section, ctx.run, get_logger()
    pairs_path, pairs_name = preference_file(ctx, "preferences", "preferences.jsonl")
    pairs = read_jsonl(pairs_path)
    if not pairs:
        raise ValueError(f"{pairs_name}: no preference pairs")
    set_seed(p.seed)
    tokenizer, model = load_sft_policy(ctx.dep("sft"))
    dataset = Dataset.from_dict({c: [x[c] for x in pairs] for c in ("prompt", "chosen", "rejected")})
    run.log_dataset(pairs_path, "preferences")
    log.info("dpo: %d pairs, beta %.3g", len(pairs), p.beta)
    windows = None
    curve_keys = ("loss", "rewards/accuracies", "rewards/margins")

    def build(ck):
        nonlocal windows
        windows, windows_callback = sample_windows(ctx, ck.dir / "sample_windows.json")
        return DPOTrainer(model, ref_model=None, beta=p.beta, loss_type=p.loss_type,
                          args=training_arguments(ck.dir, p, **checkpointing_arguments()),
                          train_dataset=dataset, tokenizer=tokenizer, max_length=p.max_length,
                          max_prompt_length=p.max_prompt_length, tracker=run.tracker,
                          callbacks=[ck.callback, windows_callback])

    def card_metrics(trainer, result):
        curve = loss_curve(trainer.state.log_history, curve_keys)
        last = curve[-1] if curve else {}
        return {"train_loss": round(float(result.training_loss), 4),
                "final_loss": round(float(last.get("loss", result.training_loss)), 4),
                "final_reward_accuracy": round(float(last.get("rewards/accuracies", float("nan"))), 4),
                "final_reward_margin": round(float(last.get("rewards/margins", float("nan"))), 4),
                "num_pairs": len(pairs), "steps": trainer.state.global_step,
                "num_processes": trainer.args.world_size}

    trained = train_and_save(ctx, build, ("DPOTrainer", f"{ctx.io.deps['sft']} (SFT policy; also the reference)"),
                             card_metrics, tokenizer)
    curve = loss_curve(trained.trainer.state.log_history, curve_keys)
    rows = [{"step": r["step"], "loss": r.get("loss"), "reward_accuracy": r.get("rewards/accuracies"),
             "reward_margin": r.get("rewards/margins")} for r in curve]
    return StageResult(trained.card_metrics, rows, windows=windows.points, finish=trained.finish)
