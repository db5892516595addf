"""Transformer language models with a scalar value head: the classic TRL ``...WithValueHead`` API.

``AutoModelForCausalLMWithValueHead`` and ``AutoModelForSeq2SeqLMWithValueHead`` wrap a transformers model
(or a ``peft.PeftModel``) and add ``v_head``, a dropout + ``Linear(H, 1)`` that reads the last hidden state
and predicts one value per token. ``forward`` returns ``(lm_logits, loss, value)``.

Checkpoint layout (classic TRL): the transformer's own keys, unprefixed, plus ``v_head.summary.weight`` and
``v_head.summary.bias`` in the same ``model.safetensors`` (or shards). A plain
``AutoModelForCausalLM.from_pretrained(dir)`` loads such a directory and ignores the two extra keys.
A PEFT policy saves its adapter (``adapter_config.json`` + ``adapter_model.safetensors``) and the value head
in ``v_head.safetensors`` beside it (same two keys). Loading also reads classic TRL's PEFT layout, where the
value head sits in ``pytorch_model.bin``; ``.bin`` files are only ever read with ``weights_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PretrainedConfig, PreTrainedModel

from rlhf_core.models.peft_support import is_peft_model

logger = logging.getLogger(__name__)

V_HEAD_PREFIX = "v_head."
# File holding the value head beside a PEFT adapter (the adapter file itself belongs to peft).
V_HEAD_FILE = "v_head.safetensors"
# kwargs of ``from_pretrained`` that configure the value head and never reach transformers.
VALUE_HEAD_KWARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
# kwargs that locate files of a hub repo; read (not popped) when we fetch extra files ourselves.
_HUB_FILE_KWARGS = ("revision", "token", "cache_dir", "subfolder")
# Config attributes that may hold the width of the last hidden state, most specific first
# (OPT projects its output to ``word_embed_proj_dim``; T5 calls it ``d_model``).
_HIDDEN_SIZE_ATTRS = ("word_embed_proj_dim", "hidden_size", "d_model", "n_embd", "dim")
_UNSET: Any = object()  # "argument not given", distinct from an explicit None


# --------------------------------------------------------------------------------------------
# the value head
# --------------------------------------------------------------------------------------------


def hidden_size_from_config(config: PretrainedConfig) -> int:
    """Width of the last hidden state, read from the usual config attribute names."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in _HIDDEN_SIZE_ATTRS:
        value = getattr(text_config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"cannot find the hidden size in {type(config).__name__}; looked for {_HIDDEN_SIZE_ATTRS}")


class ValueHead(nn.Module):
    """One scalar per token: dropout, then ``summary = Linear(H, 1)``; (B, T, H) -> (B, T, 1)."""

    def __init__(
        self, config: PretrainedConfig, summary_dropout_prob: float | None = _UNSET, hidden_size: int | None = None
    ) -> None:
        super().__init__()
        if summary_dropout_prob is _UNSET:
            summary_dropout_prob = getattr(config, "summary_dropout_prob", 0.1)
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        self.summary = nn.Linear(hidden_size or hidden_size_from_config(config), 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Values (B, T, 1) from hidden states (B, T, H), computed in the head's dtype."""
        hidden_states = hidden_states.to(self.summary.weight.dtype)  # e.g. bf16 transformer, fp32 head
        return self.summary(self.dropout(hidden_states))  # (B, T, 1)


def init_value_head(head: ValueHead, strategy: str | None = None, initializer_range: float = 0.2) -> None:
    """Re-initialise ``head`` in place: ``None`` keeps nn.Linear's init, ``"normal"`` draws N(0, range), bias 0."""
    if strategy is None:
        return
    if strategy != "normal":
        raise ValueError(f"v_head_init_strategy must be None or 'normal', got {strategy!r}")
    with torch.no_grad():
        head.summary.weight.normal_(mean=0.0, std=initializer_range)
        head.summary.bias.zero_()


# --------------------------------------------------------------------------------------------
# finding and reading checkpoint files
# --------------------------------------------------------------------------------------------


def _hub_misses() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "this file is not available" when asking the hub (or its offline cache)."""
    from huggingface_hub import errors

    return (
        errors.EntryNotFoundError, errors.LocalEntryNotFoundError, errors.RepositoryNotFoundError,
        errors.RevisionNotFoundError, errors.HFValidationError, errors.OfflineModeIsEnabled,
        errors.HfHubHTTPError, OSError,
    )


def resolve_checkpoint_file(name_or_path: str, filename: str, hub_kwargs: Mapping[str, Any]) -> str | None:
    """Local path of ``filename`` in a directory or hub repo (cache first), or None if it is not there."""
    subfolder = hub_kwargs.get("subfolder") or ""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, subfolder, filename)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download

    kwargs = {k: v for k, v in hub_kwargs.items() if k != "subfolder"}
    try:
        return hf_hub_download(name_or_path, filename, subfolder=subfolder or None, **kwargs)
    except _hub_misses():
        return None


def _strip_v_head(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``v_head.*`` entries of a state dict, with the prefix removed."""
    return {k[len(V_HEAD_PREFIX):]: v for k, v in state.items() if k.startswith(V_HEAD_PREFIX)}


def _read_safetensors_v_head(path: str) -> dict[str, torch.Tensor]:
    """Read only the ``v_head.*`` tensors of a safetensors file (the rest is never loaded)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        return {k[len(V_HEAD_PREFIX):]: f.get_tensor(k) for k in f.keys() if k.startswith(V_HEAD_PREFIX)}


def _read_bin_v_head(path: str) -> dict[str, torch.Tensor]:
    """Read the ``v_head.*`` tensors of a legacy pickle checkpoint, safely (``weights_only=True``)."""
    return _strip_v_head(torch.load(path, map_location="cpu", weights_only=True))


def _read_sharded_v_head(
    index_path: str, read_shard: Callable[[str], dict[str, torch.Tensor]], name_or_path: str,
    hub_kwargs: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """Read the ``v_head.*`` tensors of a sharded checkpoint, opening only the shards that hold them."""
    with open(index_path, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    state: dict[str, torch.Tensor] = {}
    for shard in sorted({file for key, file in weight_map.items() if key.startswith(V_HEAD_PREFIX)}):
        shard_path = resolve_checkpoint_file(name_or_path, shard, hub_kwargs)
        if shard_path is None:
            raise FileNotFoundError(f"{index_path} lists shard {shard!r}, which is missing")
        state.update(read_shard(shard_path))
    return state


def load_v_head_state(name_or_path: str, hub_kwargs: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Value-head tensors (``summary.weight``, ``summary.bias``) saved in a checkpoint, or {} if it has none."""
    hub_kwargs = hub_kwargs or {}
    single = ((V_HEAD_FILE, _read_safetensors_v_head), ("model.safetensors", _read_safetensors_v_head),
              ("pytorch_model.bin", _read_bin_v_head))
    sharded = (("model.safetensors.index.json", _read_safetensors_v_head),
               ("pytorch_model.bin.index.json", _read_bin_v_head))
    for filename, reader in single:
        path = resolve_checkpoint_file(name_or_path, filename, hub_kwargs)
        if path is not None and (state := reader(path)):
            return state
    for filename, reader in sharded:
        path = resolve_checkpoint_file(name_or_path, filename, hub_kwargs)
        if path is not None and (state := _read_sharded_v_head(path, reader, name_or_path, hub_kwargs)):
            return state
    return {}


# --------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------


def _nest_transformer_keys(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """Load pre-hook: map the TRL layout (unprefixed transformer keys) back onto ``pretrained_model.*``."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix):]
        if not rest.startswith((V_HEAD_PREFIX, "pretrained_model.")):
            state_dict[f"{prefix}pretrained_model.{rest}"] = state_dict.pop(key)


class PreTrainedModelWrapper(nn.Module):
    """A transformers model (or PeftModel) plus a value head, with TRL-classic loading and saving."""

    transformers_parent_class: Any = None
    is_encoder_decoder = False
    supports_rm_adapter = False
    supported_args = VALUE_HEAD_KWARGS
    lm_head_namings: tuple[str, ...] = ()
    """Attribute names of the wrapped model's LM head; when set, a model with none of them is refused."""

    def __init__(
        self,
        pretrained_model: nn.Module,
        summary_dropout_prob: float | None = _UNSET,
        v_head_initializer_range: float = 0.2,
        v_head_init_strategy: str | None = None,
    ) -> None:
        super().__init__()
        self._check_lm_head(pretrained_model)
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config
        self.is_peft_model = is_peft_model(pretrained_model)
        self.v_head = ValueHead(self.config, summary_dropout_prob=summary_dropout_prob)
        init_value_head(self.v_head, v_head_init_strategy, v_head_initializer_range)
        self.v_head.to(self._output_device())
        self.register_load_state_dict_pre_hook(_nest_transformer_keys)

    def _check_lm_head(self, model: nn.Module) -> None:
        """Refuse a model without a language-model head (a bare ``GPT2Model``/``T5Model``), as TRL 0.11 does: the
        policy's logits come from that head. An LM head under another name counts through ``get_output_embeddings``."""
        if not self.lm_head_namings or any(hasattr(model, name) for name in self.lm_head_namings):
            return
        if callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None:
            return
        raise ValueError("The model does not have a language model head, please use a model that has one. "
                         f"({type(model).__name__} has none of {self.lm_head_namings}; {type(self).__name__} wraps "
                         f"a model of {self.transformers_parent_class.__name__})")

    def _output_device(self) -> torch.device:
        """Device of the LM head, where the last hidden state lives (also with a device_map)."""
        head = self.pretrained_model.get_output_embeddings()
        if head is not None:
            return head.weight.device
        return next(self.pretrained_model.parameters()).device

    @property
    def device(self) -> torch.device:
        """Device of the transformer's first parameter (where inputs should go)."""
        return next(self.pretrained_model.parameters()).device

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike | nn.Module, *model_args: Any, **kwargs: Any
    ) -> PreTrainedModelWrapper:
        """Build from a hub id, a local directory, a ``PreTrainedModel`` or a ``PeftModel`` (TRL classic)."""
        head_kwargs = {k: kwargs.pop(k) for k in VALUE_HEAD_KWARGS if k in kwargs}
        peft_config = kwargs.pop("peft_config", None)
        reward_adapter = kwargs.pop("reward_adapter", None)
        reward_adapter_name = kwargs.pop("reward_adapter_name", "reward_adapter")
        if reward_adapter is not None and not cls.supports_rm_adapter:
            raise ValueError(f"{cls.__name__} does not support reward_adapter (supports_rm_adapter=False)")
        source = pretrained_model_name_or_path
        if isinstance(source, (str, os.PathLike)):
            model = cls._load_transformer(os.fspath(source), model_args, kwargs)
        elif isinstance(source, PreTrainedModel) or is_peft_model(source):
            if model_args or kwargs:
                raise ValueError(f"loading arguments {sorted(kwargs)} only apply to a name or path, not a model")
            model = source
        else:
            raise TypeError(f"expected a name, a path, a PreTrainedModel or a PeftModel, got {type(source).__name__}")
        model = _apply_peft_config(model, peft_config)
        wrapper = cls(model, **head_kwargs)
        if isinstance(source, (str, os.PathLike)):
            wrapper._load_saved_v_head(os.fspath(source), kwargs)
        if reward_adapter is not None:
            wrapper._add_reward_adapter(os.fspath(reward_adapter), reward_adapter_name)
        return wrapper

    def _add_reward_adapter(self, adapter_dir: str, adapter_name: str) -> None:
        """Load a frozen reward-model adapter beside the policy adapter (``compute_reward_score`` uses it)."""
        from rlhf_core.models.reward_adapter import load_reward_adapter

        if not self.is_peft_model:
            raise ValueError("reward_adapter needs a PEFT policy: pass a PeftModel or peft_config= as well")
        self.policy_adapter_name = self.pretrained_model.active_adapter
        self.score = load_reward_adapter(self.pretrained_model, adapter_dir, adapter_name)
        self.rm_adapter_name = adapter_name
        self.pretrained_model.set_adapter(self.policy_adapter_name)

    @torch.no_grad()
    def compute_reward_score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Reward scores (B, T, K) of every position from the reward adapter (read the last real token's)."""
        if getattr(self, "rm_adapter_name", None) is None:
            raise ValueError("compute_reward_score needs a model loaded with reward_adapter=")
        was_training = self.pretrained_model.training
        self.pretrained_model.set_adapter(self.rm_adapter_name)
        self.pretrained_model.eval()
        try:
            outputs = self.pretrained_model(
                input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, return_dict=True,
                **kwargs,
            )
            hidden = outputs.hidden_states[-1].to(self.score.weight.device)  # (B, T, H)
            return self.score(hidden)  # (B, T, K)
        finally:
            self.pretrained_model.set_adapter(self.policy_adapter_name)
            self.pretrained_model.train(was_training)

    @classmethod
    def _load_transformer(cls, name_or_path: str, model_args: tuple, kwargs: dict[str, Any]) -> nn.Module:
        """Load the transformer, or base model + trainable adapter when the checkpoint is a PEFT adapter."""
        hub_kwargs = {k: kwargs[k] for k in _HUB_FILE_KWARGS if k in kwargs}
        is_trainable = kwargs.pop("is_trainable", True)
        adapter_config = resolve_checkpoint_file(name_or_path, "adapter_config.json", hub_kwargs)
        if adapter_config is None:
            return cls.transformers_parent_class.from_pretrained(name_or_path, *model_args, **kwargs)
        from peft import PeftModel

        with open(adapter_config, encoding="utf-8") as f:
            base_name = json.load(f).get("base_model_name_or_path")
        if not base_name:
            raise ValueError(f"{adapter_config} has no base_model_name_or_path; load the base model and pass it")
        # revision/subfolder locate the adapter, not its base model.
        base_kwargs = {k: v for k, v in kwargs.items() if k not in ("revision", "subfolder")}
        base = cls.transformers_parent_class.from_pretrained(base_name, *model_args, **base_kwargs)
        return PeftModel.from_pretrained(base, name_or_path, is_trainable=is_trainable, **hub_kwargs)

    def _load_saved_v_head(self, name_or_path: str, kwargs: Mapping[str, Any]) -> None:
        """Load the value head from the checkpoint if it holds ``v_head.*`` weights (else keep the fresh one)."""
        hub_kwargs = {k: kwargs[k] for k in _HUB_FILE_KWARGS if k in kwargs}
        state = load_v_head_state(name_or_path, hub_kwargs)
        if state:
            self.v_head.load_state_dict(state)
        else:
            logger.info("no v_head weights in %s; the value head is freshly initialised", name_or_path)

    # ---- running -------------------------------------------------------------------------

    def _last_hidden_state(self, outputs: Any) -> torch.Tensor:
        """The hidden state the value head reads (B, T, H)."""
        return outputs.hidden_states[-1]

    def _uses_prefix_tuning(self) -> bool:
        """Prefix tuning feeds its prefix as past_key_values, so ours must not be passed as well."""
        if not self.is_peft_model:
            return False
        return str(self.pretrained_model.active_peft_config.peft_type).endswith("PREFIX_TUNING")

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        attention_mask: torch.Tensor | None = None,
        return_past_key_values: bool = False,
        *,
        upcast_logits: bool = True,
        **kwargs: Any,
    ) -> tuple:
        """Logits (B, T, V) fp32, loss (or None), values (B, T) fp32; plus past_key_values if asked.

        ``upcast_logits=False`` (not in classic TRL): the logits stay in the transformer's dtype, for a caller that
        upcasts them chunk by chunk (``rlhf_core.trainers.forward``) instead of holding an fp32 copy of them all.
        """
        kwargs["output_hidden_states"] = True
        if past_key_values is not None and not self._uses_prefix_tuning():
            kwargs["past_key_values"] = past_key_values
        outputs = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = self._last_hidden_state(outputs).to(self.v_head.summary.weight.device)  # (B, T, H)
        value = self.v_head(hidden).squeeze(-1).float()  # (B, T)
        lm_logits = outputs.logits.float() if upcast_logits else outputs.logits  # (B, T, V)
        if return_past_key_values:
            return lm_logits, outputs.loss, value, outputs.past_key_values
        return lm_logits, outputs.loss, value

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Generate with the transformer (the value head plays no part)."""
        return self.pretrained_model.generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None) -> None:
        """Turn on gradient checkpointing in the transformer."""
        self.pretrained_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """Turn off gradient checkpointing in the transformer."""
        self.pretrained_model.gradient_checkpointing_disable()

    @contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run the PEFT base model with its adapter off (the reference policy); an error without PEFT."""
        if not self.is_peft_model:
            # Silently running the policy itself would make every KL to "the reference" zero.
            raise ValueError("disable_adapter() needs a PEFT model; a full model needs a separate reference model")
        with self.pretrained_model.disable_adapter():
            yield

    # ---- state dict and saving -----------------------------------------------------------

    def state_dict(self, *, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """Transformer keys unprefixed plus ``v_head.summary.{weight,bias}`` (classic TRL layout)."""
        # Honouring destination/prefix keeps this right when the wrapper is nested (DDP's ``module.``).
        destination = self.pretrained_model.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self.v_head.state_dict(destination=destination, prefix=prefix + V_HEAD_PREFIX, keep_vars=keep_vars)

    def _v_head_tensors(self) -> dict[str, torch.Tensor]:
        """The value head as ``{"v_head.summary.weight": ..., "v_head.summary.bias": ...}`` on CPU."""
        return {V_HEAD_PREFIX + k: v.detach().cpu().contiguous() for k, v in self.v_head.state_dict().items()}

    def save_pretrained(
        self, save_directory: str | os.PathLike, safe_serialization: bool = True, **kwargs: Any
    ) -> None:
        """Write config + safetensors with transformer and value head (PEFT: adapter + ``v_head.safetensors``)."""
        if not safe_serialization:
            logger.warning("safe_serialization=False is ignored: weights are always written as safetensors")
        if self.is_peft_model:
            self.pretrained_model.save_pretrained(save_directory, **kwargs)
            from safetensors.torch import save_file

            save_file(self._v_head_tensors(), os.path.join(save_directory, V_HEAD_FILE))
            return
        # transformers writes every key of the given state dict (dropping tied duplicates such as lm_head).
        state_dict = kwargs.pop("state_dict", None)
        if state_dict is None:
            state_dict = self.state_dict()
        self.pretrained_model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)

    def push_to_hub(
        self, repo_id: str, commit_message: str = "Upload model with value head", private: bool | None = None,
        token: str | bool | None = None, revision: str | None = None, **save_kwargs: Any,
    ) -> Any:
        """Save (with the value head) to a temporary directory and upload it to ``repo_id``."""
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp, **save_kwargs)
            return api.upload_folder(repo_id=repo_id, folder_path=tmp, commit_message=commit_message, revision=revision)


def _apply_peft_config(model: nn.Module, peft_config: Any) -> nn.Module:
    """Wrap ``model`` with ``peft.get_peft_model`` when a config is given."""
    if peft_config is None:
        return model
    if is_peft_model(model):
        raise ValueError("peft_config was given but the model already is a PeftModel; pass only one of them")
    from peft import get_peft_model

    return get_peft_model(model, peft_config)


class AutoModelForCausalLMWithValueHead(PreTrainedModelWrapper):
    """A causal LM with a value head: ``forward`` -> (lm_logits, loss, value)."""

    transformers_parent_class = AutoModelForCausalLM
    is_encoder_decoder = False
    supports_rm_adapter = True
    lm_head_namings = ("lm_head", "embed_out", "output_layer")
    """Attribute names a causal LM's output projection goes by (TRL 0.11 API, read by tests and subclasses)."""


class AutoModelForSeq2SeqLMWithValueHead(PreTrainedModelWrapper):
    """An encoder-decoder LM with a value head on the decoder's last hidden state."""

    transformers_parent_class = AutoModelForSeq2SeqLM
    is_encoder_decoder = True
    lm_head_namings = ("lm_head", "embed_out", "output_projection")
    """Attribute names a seq2seq LM's output projection goes by (TRL 0.11 API, read by tests and subclasses)."""

    def _last_hidden_state(self, outputs: Any) -> torch.Tensor:
        """The decoder's last hidden state (B, T_dec, H)."""
        return outputs.decoder_hidden_states[-1]
