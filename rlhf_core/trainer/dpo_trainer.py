"""`trl.trainer.dpo_trainer` of TRL 0.11: re-exports `rlhf_core.trainers.preference.dpo`."""

from rlhf_core.trainers.preference.dpo import *  # noqa: F401,F403

from rlhf_core.trainers.preference.dpo import _build_tokenized_answer, _truncate_tokens  # noqa: F401  (TRL 0.11 private helpers)
