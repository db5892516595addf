"""``TrlParser``: transformers' ``HfArgumentParser`` plus a ``--config`` YAML file, as TRL's scripts use it.

Precedence: a dataclass default < the YAML file < the command line. The YAML file's ``env:`` mapping is put in
the environment. Options of the transformers of TRL 0.11's era are mapped or refused by name
(``rlhf_core.scripts.legacy_args``). Both constructor forms work: TRL 0.11's ``TrlParser((A, B))`` and TRL 1.x's
``TrlParser(dataclass_types=[A, B])``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from rlhf_core.scripts import legacy_args


# the one option both eras' dataclasses carry (TRL 0.11: ModelConfig; TRL 1.x: the trainer configs)
SHARED_OPTION = "trust_remote_code"


def init_zero_verbose() -> None:
    """Errors only, and warnings through logging (TRL's quiet start for command-line scripts)."""
    logging.basicConfig(format="%(message)s", level=logging.ERROR)

    def to_logging(message, category, filename, lineno, file=None, line=None):
        logging.warning(f"{filename}:{lineno}: {category.__name__}: {message}")

    warnings.showwarning = to_logging


def read_config(path: str) -> dict[str, Any]:
    """A YAML config file as a dict, its ``env:`` mapping applied to ``os.environ`` and removed."""
    import yaml  # light, but only scripts with --config need it

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    config = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of option: value, got {type(config).__name__}")
    env = config.pop("env", {})
    if not isinstance(env, dict):
        raise ValueError(f"--config {path}: `env` must be a mapping of variable: value")
    for key, value in env.items():
        os.environ[key] = str(value)
    return config


def split_config_flag(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` without ``--config PATH`` / ``--config=PATH``, and that path."""
    for i, token in enumerate(args):
        if token == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a path to a YAML file")
            return args[:i] + args[i + 2:], args[i + 1]
        if token.startswith("--config="):
            return args[:i] + args[i + 1:], token.split("=", 1)[1]
    return args, None


class TrlParser(HfArgumentParser):
    """Parse dataclasses from the command line and an optional ``--config`` YAML file."""

    def __init__(self, parsers: Any = None, ignore_extra_args: bool = False, *, dataclass_types: Any = None,
                 **kwargs: Any) -> None:
        types = dataclass_types if dataclass_types is not None else parsers
        if types is None:
            types = []
        elif not isinstance(types, Iterable):
            types = [types]
        super().__init__(list(types), **kwargs)
        self.ignore_extra_args = ignore_extra_args
        if SHARED_OPTION not in self.known_destinations():
            # ModelConfig's trust_remote_code is no argparse field (rlhf_core.scripts.model_config): TRL 0.11's
            # scripts pair it with configs that lack the option, so the parser declares it for them
            self.add_argument(f"--{SHARED_OPTION}", type=string_to_bool, nargs="?", const=True, default=False,
                              help="Run modelling code shipped with the checkpoint.")

    def parse_args_into_dataclasses(self, args: Any = None, return_remaining_strings: bool = False,
                                    **_: Any) -> tuple:
        """As ``HfArgumentParser``'s, and ``--trust_remote_code`` is given to every parsed object that has it
        (a TRL 1.x trainer config declares it, TRL 0.11's ModelConfig reads it)."""
        namespace, remaining = self.parse_known_args(args=args)
        values = vars(namespace)
        outputs: list[Any] = []
        used: set[str] = set()
        for dtype in self.dataclass_types:
            keys = {f.name for f in dataclasses.fields(dtype) if f.init}
            outputs.append(dtype(**{k: v for k, v in values.items() if k in keys}))
            used |= keys
        if SHARED_OPTION in values:
            for output in outputs:
                if hasattr(output, SHARED_OPTION):
                    setattr(output, SHARED_OPTION, values[SHARED_OPTION])
            used.add(SHARED_OPTION)
        extra = {k: v for k, v in values.items() if k not in used}
        if extra:
            outputs.append(argparse.Namespace(**extra))
        if return_remaining_strings:
            return (*outputs, remaining)
        if remaining:
            raise ValueError(f"Some specified arguments are not used by the HfArgumentParser: {remaining}")
        return tuple(outputs)

    def known_destinations(self) -> set[str]:
        return {action.dest for action in self._actions}

    def set_defaults_with_config(self, **config: Any) -> list[str]:
        """Make the config's values the defaults (no longer required); returns ``--key value`` for unknown keys."""
        used = set()
        for action in self._actions:
            if action.dest in config:
                action.default = config[action.dest]
                action.required = False
                used.add(action.dest)
        return [item for key, value in config.items() if key not in used for item in (f"--{key}", str(value))]

    def parse_args_and_config(self, args: Iterable[str] | None = None, return_remaining_strings: bool = False,
                              fail_with_unknown_args: bool = True) -> tuple:
        """The dataclass instances, from defaults < ``--config`` YAML < command line."""
        argv, config_path = split_config_flag(list(sys.argv[1:] if args is None else args))
        known = self.known_destinations()
        argv = legacy_args.map_argv(argv, known)
        unknown_config: list[str] = []
        if config_path is not None:
            config = legacy_args.map_config(read_config(config_path), known)
            unknown_config = self.set_defaults_with_config(**config)
        outputs = self.parse_args_into_dataclasses(args=argv, return_remaining_strings=return_remaining_strings)
        if return_remaining_strings:
            return (*self.post_process(outputs[:-1]), unknown_config + list(outputs[-1]))
        if unknown_config and fail_with_unknown_args and not self.ignore_extra_args:
            raise ValueError(f"--config {config_path}: options no dataclass of this script defines: "
                             f"{unknown_config[::2]}")
        return self.post_process(outputs)

    @staticmethod
    def post_process(outputs: tuple) -> tuple:
        """TRL 0.11: a script argument ``gradient_checkpointing_use_reentrant`` sets the training arguments'
        ``gradient_checkpointing_kwargs`` (unless they were given)."""
        script = next((o for o in outputs if hasattr(o, "gradient_checkpointing_use_reentrant")), None)
        training = next((o for o in outputs if hasattr(o, "gradient_checkpointing_kwargs")), None)
        if script is not None and training is not None and training.gradient_checkpointing_kwargs is None:
            training.gradient_checkpointing_kwargs = {"use_reentrant": script.gradient_checkpointing_use_reentrant}
        return tuple(outputs)
