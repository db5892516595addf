"""Value rules for ``params.yaml``: every bad value fails in the loader, before any stage runs, naming its key.

The loader (``tasks/spec/params.py``) checks keys and types; this module checks values. A section's own rules (sizes
that must be positive, finite learning rates and betas, closed vocabularies such as ``ppo.kl_penalty``) are declared
beside its schema, as the schema class's ``RULES`` (a :class:`ValueRules`); the rules across sections live here:
lengths that must fit the built model's positions, output paths that must stay out of ``.git``/``.dvc``. It also
turns YAML syntax errors into one line naming ``file:line:column``.
"""

from __future__ import annotations

import math
from pathlib import Path, PurePath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlhf_core.data import PROMPT_BYTES_PER_WORD, prompt_token_budget


class ParamsError(ValueError):
    """params.yaml is wrong: an unknown, missing or mistyped key, a bad value, or a YAML syntax error (the message
    names the file and the dotted key). The message is cut at :data:`MAX_ERROR_CHARS`: a value quoted in it can be
    as large as the file (a 99,000-value list once made a 297,000-character error)."""

    def __init__(self, message: str) -> None:
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters cut)"
        super().__init__(message)


MAX_ERROR_CHARS = 600
"""Longest params error message (about two terminal lines of context beyond the key and file:line)."""


# The keys of the paths section that name directories the stages write to (or, for incoming, read and track).
PATH_KEYS = ("data", "models", "metrics", "plots", "incoming")

@dataclass(frozen=True)
class ValueRules:
    """The value rules of one params.yaml section, declared beside its schema (the schema class's ``RULES``): each
    field names the section's keys that follow that rule."""

    positive_ints: tuple[str, ...] = ()
    """Sizes and counts that must be >= 1 (0 divides by zero or trains nothing; negatives make no sense)."""
    non_negative_ints: tuple[str, ...] = ()
    """Counts where 0 has a meaning (all reviews, no samples shown, no sample windows)."""
    positive_floats: tuple[str, ...] = ()
    """Finite and > 0 (NaN, inf, 0 and negatives rejected)."""
    non_negative_floats: tuple[str, ...] = ()
    """Finite and >= 0."""
    at_least_one_floats: tuple[str, ...] = ()
    """Finite and >= 1."""
    unit_interval: tuple[str, ...] = ()
    """Finite and in [0, 1]."""
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Closed vocabularies: key -> the values the code implements."""

    def check(self, section: Mapping[str, Any], name: str, source: str) -> None:
        """Raise ``ParamsError`` naming ``source`` and ``<name>.<key>`` of the first bad value of ``section``."""
        _check_range(section, name, source, self.positive_ints, 1, math.inf, False, integer=True)
        _check_range(section, name, source, self.non_negative_ints, 0, math.inf, False, integer=True)
        _check_range(section, name, source, self.positive_floats, 0.0, math.inf, True, integer=False)
        _check_range(section, name, source, self.non_negative_floats, 0.0, math.inf, False, integer=False)
        _check_range(section, name, source, self.unit_interval, 0.0, 1.0, False, integer=False)
        _check_range(section, name, source, self.at_least_one_floats, 1.0, math.inf, False, integer=False)
        for key, allowed in self.choices.items():
            if section[key] not in allowed:
                _fail(source, f"{name}.{key}", f"must be one of {', '.join(allowed)}, got {section[key]!r}")


NO_RULES = ValueRules()
"""A section without value rules of its own (its keys' types are still checked)."""

FORBIDDEN_DIRS = (".git", ".dvc")
"""Output paths may not lie inside these: a stage would overwrite git or DVC internals."""


def _fail(source: str, key: str, message: str) -> None:
    raise ParamsError(f"{source}: {key}: {message}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(section: Mapping[str, Any], name: str, source: str, keys: tuple[str, ...], low: float, high: float,
                 low_open: bool, integer: bool) -> None:
    """Every key of ``keys`` in ``section`` is a finite number in [low, high] (``(low, high]`` when ``low_open``)."""
    for key in keys:
        value, dotted = section[key], f"{name}.{key}"
        if not _number(value) or (integer and not isinstance(value, int)):
            _fail(source, dotted, f"expected a {'whole ' if integer else ''}number, got {value!r}")
        if not math.isfinite(value):
            _fail(source, dotted, f"must be finite, got {value!r}")
        if value < low or (low_open and value == low) or value > high:
            bound = f"> {low}" if low_open else f">= {low}"
            _fail(source, dotted, f"must be {bound}" + (f" and <= {high}" if high != math.inf else "")
                  + f", got {value!r}")


def _check_positions(raw: dict, source: str) -> None:
    """With the built model (``sft.model_name: ''``), every token length must fit ``sft.max_positions``; a prompt
    (at most ``prompt_token_budget`` tokens, see ``rlhf_core/data.py``) plus the sampled tokens too."""
    if raw["sft"]["model_name"]:
        return  # a hub/local model: its positions are only known once loaded
    positions = raw["sft"]["max_positions"]
    lengths = {"sft.max_seq_length": raw["sft"]["max_seq_length"], "dpo.max_length": raw["dpo"]["max_length"],
               "ppo.max_new_tokens": raw["ppo"]["max_new_tokens"],
               "evaluate.max_new_tokens": raw["evaluate"]["max_new_tokens"], "kto.max_length": raw["kto"]["max_length"],
               "grpo.max_completion_length": raw["grpo"]["max_completion_length"],
               "rloo.max_completion_length": raw["rloo"]["max_completion_length"]}
    if raw["reward_model"]["init_from"] == "sft":
        lengths["reward_model.max_length"] = raw["reward_model"]["max_length"]
    for key, value in lengths.items():
        if value > positions:
            _fail(source, key, f"{value} tokens exceed the model's positions (sft.max_positions: {positions})")
    prompt = prompt_token_budget(raw["prepare"]["prompt_max_words"])  # prepare drops longer prompts
    for key in ("ppo.max_new_tokens", "evaluate.max_new_tokens", "grpo.max_completion_length",
                "rloo.max_completion_length"):
        if prompt + lengths[key] > positions:
            words = raw["prepare"]["prompt_max_words"]
            _fail(source, key, f"{lengths[key]} tokens after a prompt of up to {prompt} tokens (prepare.prompt_max_"
                               f"words {words} x {PROMPT_BYTES_PER_WORD} bytes) exceed the model's positions "
                               f"(sft.max_positions: {positions})")


def _check_paths(raw: dict, source: str) -> None:
    for key in PATH_KEYS:
        value = raw["paths"][key]
        parts = PurePath(str(value)).parts
        if not str(value).strip() or any(p in FORBIDDEN_DIRS for p in parts):
            _fail(source, f"paths.{key}", f"{value!r} is empty or inside {' or '.join(FORBIDDEN_DIRS)}")


def check(params: dict, sections: Mapping[str, type], source: str = "params.yaml") -> None:
    """Raise ``ParamsError`` naming ``source`` and the dotted key of the first bad value in ``params`` (the raw
    mapping of params.yaml, already checked for keys and types): each section's own rules (the ``RULES`` beside
    its schema in ``sections``), then the rules across sections (lengths within the model's positions, paths)."""
    for name, schema in sections.items():
        getattr(schema, "RULES", NO_RULES).check(params[name], name, source)
    _check_positions(params, source)
    _check_paths(params, source)


MAX_PARAMS_BYTES = 64 * 1024
"""Largest params file read (64 KiB; ours is about 7 KB). A 100 MB file took 80 s per load before any limit, and a
99,000-value list (300 KB, under the earlier 1 MiB limit) 17 s: at this size every refusal takes well under 1 s."""
MAX_YAML_VALUES = 100_000
"""Most values a params file may expand to once its aliases are followed (ours: about 200). A 6.4 KB file of nested
aliases (an "alias bomb") expands to billions: it ran 98 s into a MemoryError before this limit."""


def load_yaml(path: str | Path) -> Any:
    """Parse a params file, refusing with a ``ParamsError`` that names the file (and line) what no params file
    needs: over ``MAX_PARAMS_BYTES``, not UTF-8, a YAML syntax error (``file:line:column``), a key given twice in
    one mapping (YAML would keep the last silently; DVC refuses the file), aliases that expand to more than
    ``MAX_YAML_VALUES`` values or refer to themselves. Each check runs on the parsed node graph, before any value
    is built, so every refusal takes milliseconds."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_PARAMS_BYTES:
        raise ParamsError(f"{path}: {size} bytes, over the {MAX_PARAMS_BYTES}-byte limit of a params file")
    text = _utf8_text(path, path.read_bytes())
    try:
        loader = _LOADER(text)  # its reader refuses control characters (a NUL byte) here
    except yaml.reader.ReaderError as err:
        raise ParamsError(f"{_position(path, text, err.position)}: {err.reason} (character "
                          f"{_char_name(err.character)}); remove it") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(path, node)
        return loader.construct_document(node)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ParamsError(f"{where}: YAML syntax error: {err.problem or err.context}") from None
    except yaml.reader.ReaderError as err:
        raise ParamsError(f"{_position(path, text, err.position)}: {err.reason} (character "
                          f"{_char_name(err.character)}); remove it") from None
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: YAML error: {err}") from None
    except RecursionError:
        raise ParamsError(f"{path}: YAML nested too deeply") from None
    finally:
        loader.dispose()


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser where PyYAML has it (same values: the constructors are PyYAML's own; the scanner and parser run
in C, a few times faster on a large file)."""


def _position(path: Path, text: str, position: int) -> str:
    """``file:line:column`` of a character offset."""
    line = text.count("\n", 0, position) + 1
    return f"{path}:{line}:{position - (text.rfind(chr(10), 0, position) + 1) + 1}"


def _char_name(character) -> str:
    code = ord(character) if isinstance(character, str) else character  # libyaml gives the code point
    return f"#x{code:04x}" if isinstance(code, int) else repr(code)


def _utf8_text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ParamsError(f"{path}:{line}: not UTF-8 (byte 0x{data[err.start]:02x} at column {column}); save the "
                          "file as UTF-8") from None


def _check_nodes(path: Path, root: yaml.Node) -> None:
    """Duplicate keys, self-referring aliases and the expanded size, over the node graph (an alias is the same node
    object as its anchor, so each node is visited once and the expanded size is summed per node)."""
    expanded: dict[int, int] = {}  # id(node) -> values it expands to
    active: set[int] = set()  # nodes on the current path: meeting one again is an alias to an enclosing anchor
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            active.discard(key)
            expanded[key] = 1 + sum(expanded[id(child)] for child in _children(node))
            if expanded[key] > MAX_YAML_VALUES:
                raise ParamsError(f"{path}:{node.start_mark.line + 1}: YAML aliases expand to more than "
                                  f"{MAX_YAML_VALUES} values (limit of a params file)")
            continue
        if key in expanded:
            continue
        if key in active:
            raise ParamsError(f"{path}:{node.start_mark.line + 1}: a YAML alias refers to the value that contains it")
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            _check_duplicate_keys(path, node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_duplicate_keys(path: Path, node: yaml.MappingNode) -> None:
    first: dict[str, int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        line = key.start_mark.line + 1
        if key.value in first:
            raise ParamsError(f"{path}:{line}: duplicate key {key.value!r} (first at line {first[key.value]}); YAML "
                              "would keep only the last value: remove one")
        first[key.value] = line
