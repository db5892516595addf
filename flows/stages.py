"""The stage name -> Prefect task table shared by the flows."""

from tasks.ddpo import ddpo_task
from tasks.distributed import TRAINING_STAGES
from tasks.dpo import dpo_task
from tasks.evaluate import evaluate_task
from tasks.online import grpo_task, rloo_task
from tasks.kto import kto_task
from tasks.ppo import ppo_task
from tasks.prepare import prepare_task
from tasks.reward_model import reward_model_task
from tasks.sft import sft_task

STAGE_TASKS = {
    "prepare": prepare_task,
    "sft": sft_task,
    "reward_model": reward_model_task,
    "ppo": ppo_task,
    "dpo": dpo_task,
    "grpo": grpo_task,
    "rloo": rloo_task,
    "kto": kto_task,
    "evaluate": evaluate_task,
    "ddpo": ddpo_task,
}

LAUNCHABLE_STAGES = TRAINING_STAGES
"""Stages that may run under ``accelerate launch`` / ``torchrun`` (the others fail fast there)."""
