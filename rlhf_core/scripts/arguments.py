"""The script-argument dataclasses of TRL's example scripts: TRL 1.x's ``ScriptArguments`` and TRL 0.11's
``SFTScriptArguments`` / ``DPOScriptArguments`` / ``RewardScriptArguments`` (``trl.commands.cli_utils``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScriptArguments:
    """The dataset a script trains on (TRL 1.x ``trl.ScriptArguments``)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Dataset (hub id or local folder)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset."})
    gradient_checkpointing_use_reentrant: bool = field(default=False, metadata={
        "help": "use_reentrant of gradient checkpointing (copied into gradient_checkpointing_kwargs)."})
    ignore_bias_buffers: bool = field(default=False, metadata={
        "help": "Ignore the LM's bool bias buffers under DDP (a workaround of old torch releases)."})


@dataclass
class _LegacyScriptArguments:
    """TRL 0.11's script arguments: a dataset, its splits and the ``--config`` file path."""

    dataset_name: str | None = field(default=None, metadata={"help": "Dataset (hub id or local folder)."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    config: str | None = field(default=None, metadata={"help": "YAML file of default arguments."})
    gradient_checkpointing_use_reentrant: bool = field(default=False, metadata={
        "help": "use_reentrant of gradient checkpointing (copied into gradient_checkpointing_kwargs)."})


@dataclass
class SFTScriptArguments(_LegacyScriptArguments):
    """TRL 0.11 ``SFTScriptArguments``."""

    dataset_name: str | None = field(default="timdettmers/openassistant-guanaco", metadata={"help": "Dataset."})


@dataclass
class RewardScriptArguments(_LegacyScriptArguments):
    """TRL 0.11 ``RewardScriptArguments``."""

    dataset_name: str | None = field(default="trl-lib/ultrafeedback_binarized", metadata={"help": "Dataset."})


@dataclass
class DPOScriptArguments(_LegacyScriptArguments):
    """TRL 0.11 ``DPOScriptArguments`` (also what its online-DPO family scripts import)."""

    ignore_bias_buffers: bool = field(default=False, metadata={
        "help": "Ignore the LM's bool bias buffers under DDP (a workaround of old torch releases)."})
