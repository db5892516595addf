"""``TrainingArguments`` options of the transformers of TRL 0.11's era (4.45) that the pinned transformers (5.x)
no longer has: each is mapped to today's option with a warning, or refused with what to write instead.

Applied by ``TrlParser`` to the command line and the YAML config of a script, and only to names no dataclass of
the parser defines (a script's own ``warmup_ratio`` field stays its own). docs/library.md lists the table.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable

# old option -> new option, same value
RENAMED = {
    "warmup_ratio": "warmup_steps",  # transformers 5: a float below 1 in warmup_steps is the ratio
    "evaluation_strategy": "eval_strategy",
    "no_cuda": "use_cpu",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "push_to_hub_model_id": "hub_model_id",
    "push_to_hub_token": "hub_token",
}
# old boolean flag -> (new option, the value that means the same when the flag is on)
FLAG_TO_VALUE = {
    "group_by_length": ("train_sampling_strategy", "group_by_length"),
    "adafactor": ("optim", "adafactor"),
    "include_inputs_for_metrics": ("include_for_metrics", "inputs"),
}
# old option -> why it is accepted and ignored (today's behaviour is what the option asked for)
IGNORED = {
    "overwrite_output_dir": "transformers 5 always writes into output_dir",
    "save_safetensors": "transformers 5 always saves safetensors",
}
# old option -> what to write instead (no faithful mapping: refused)
REFUSED = {
    "split_batches": "accelerator_config='{\"split_batches\": true}'",
    "dispatch_batches": "accelerator_config='{\"dispatch_batches\": true}'",
    "fsdp_min_num_params": "fsdp_config='{\"min_num_params\": N}'",
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_config='{\"transformer_layer_cls_to_wrap\": [...]}'",
    "push_to_hub_organization": "hub_model_id=<organization>/<name>",
    "use_mps_device": "nothing: the MPS device is chosen automatically",
    "use_ipex": "nothing: IPEX support was removed",
    "torchdynamo": "torch_compile_backend=<backend>",
    "half_precision_backend": "nothing: mixed precision goes through accelerate (--bf16 / --fp16)",
    "fp16_backend": "nothing: mixed precision goes through accelerate (--bf16 / --fp16)",
    "fp16_opt_level": "nothing: apex mixed precision was removed",
    "jit_mode_eval": "nothing: TorchScript evaluation was removed",
    "tpu_num_cores": "nothing: launch on TPUs through accelerate",
    "tpu_metrics_debug": "debug=tpu_metrics_debug",
    "use_legacy_prediction_loop": "nothing: the legacy prediction loop was removed",
    "past_index": "nothing: past_index was removed",
    "mp_parameters": "nothing: SageMaker model-parallel parameters were removed",
    "ray_scope": "nothing: ray_scope was removed",
    "include_tokens_per_second": "include_num_input_tokens_seen=true (tokens/s is logged from it)",
}
LEGACY = set(RENAMED) | set(FLAG_TO_VALUE) | set(IGNORED) | {"logging_dir"} | set(REFUSED)
WHERE = "a transformers 4.x TrainingArguments option that transformers 5 (pinned here) removed"


def _truthy(value: object) -> bool:
    return str(value).lower() in ("true", "1", "yes")


def map_option(name: str, value: object) -> list[tuple[str, object]]:
    """``[(new_name, new_value), ...]`` for one legacy option (empty: ignored), with a warning; refused ones raise."""
    if name in RENAMED:
        warnings.warn(f"--{name} is {WHERE}; mapped to --{RENAMED[name]}={value}", FutureWarning, stacklevel=3)
        return [(RENAMED[name], value)]
    if name in FLAG_TO_VALUE:
        new, new_value = FLAG_TO_VALUE[name]
        if not _truthy(value):
            return []
        warnings.warn(f"--{name} is {WHERE}; mapped to --{new}={new_value}", FutureWarning, stacklevel=3)
        return [(new, new_value)]
    if name in IGNORED:
        if name == "save_safetensors" and not _truthy(value):
            raise ValueError(f"--save_safetensors=False is {WHERE}: it always saves safetensors now; drop it")
        warnings.warn(f"--{name} is {WHERE}; ignored: {IGNORED[name]}", FutureWarning, stacklevel=3)
        return []
    if name == "logging_dir":
        # transformers 5 reads the TensorBoard folder from the environment instead of the arguments
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(value)
        warnings.warn(f"--logging_dir is {WHERE}; mapped to TENSORBOARD_LOGGING_DIR={value}", FutureWarning,
                      stacklevel=3)
        return []
    raise ValueError(f"--{name} is {WHERE}; write instead: {REFUSED[name]}")


def map_config(config: dict, known: Iterable[str]) -> dict:
    """A YAML config's keys with the legacy options (not among ``known`` destinations) mapped."""
    known = set(known)
    out: dict = {}
    for key, value in config.items():
        pairs = map_option(key, value) if key in LEGACY and key not in known else [(key, value)]
        out.update(pairs)
    return out


def map_argv(argv: list[str], known: Iterable[str]) -> list[str]:
    """A command line with the legacy options (``--name value``, ``--name=value`` or a bare flag) mapped."""
    known = set(known)
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if name not in LEGACY or name in known:
            out.append(token)
            i += 1
            continue
        if not eq:  # the value is the next token, unless this is a bare flag
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else "true"
            i += 1 + has_value
        else:
            i += 1
        for new, new_value in map_option(name, value):
            out += [f"--{new}", str(new_value)]
    return out
