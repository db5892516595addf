"""How far a measured row is from the card: model FLOPs per phase (for MFU) and the bytes a decode step must read.

Conventions (the usual ones, so numbers compare with published MFU figures):
- a forward pass costs ``2 N`` FLOPs per token through the matmul weights (``N``: linear layers and LM head,
  ``common.matmul_params``) plus ``4 x layers x hidden`` per (query, key) pair of attention; a backward twice that;
- all positions count (padding is not useful work and is not counted; the LM head is counted on every token);
- a decode step reads every matmul weight once and the KV cache of every row once: ``bytes / HBM bandwidth`` is
  the floor of its time (activations, logits and launch gaps ignored: the real floor is higher).
Shapes are the bench's own model configs (``common.SIZES``, the online workload's ``ARCHS``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    kv_width: int
    """Width of one token's keys (= values) in one layer: KV heads x head size."""


def shape(name: str) -> Shape:
    """The shape of a bench model: a ``common.SIZES`` size (GPT-2) or an online ``ARCHS`` name."""
    import common

    if name in common.SIZES:
        config = common.SIZES[name]
    else:
        import importlib.util

        spec = importlib.util.spec_from_file_location("online_workload", os.path.join(BENCH, "workloads", "online.py"))
        online = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(online)
        config = online.ARCHS[name][1]
    if "n_embd" in config:  # GPT-2: as many KV heads as heads
        return Shape(config["n_layer"], config["n_embd"], config["n_embd"])
    head = config["hidden_size"] // config["num_attention_heads"]
    return Shape(config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"] * head)


def forward_flops(matmul_params: int, s: Shape, tokens: float, pairs: float) -> float:
    """FLOPs of a forward over ``tokens`` tokens whose attention spans ``pairs`` (query, key) pairs in all."""
    return 2.0 * matmul_params * tokens + 4.0 * s.layers * s.hidden * pairs


def sequence_pairs(rows: int, length: float) -> float:
    """Causal (query, key) pairs of ``rows`` sequences of ``length`` tokens."""
    return rows * length * (length + 1) / 2


def decode_pairs(rows: int, prompt: float, new: float) -> float:
    """Pairs of ``new`` decoded tokens per row after a ``prompt``-token prefix (the t-th sees prompt + t keys)."""
    return rows * (new * prompt + new * (new + 1) / 2)


def phase_flops(kind: str, matmul_params: int, s: Shape, rows: int, prompt_tokens: float, completion_tokens: float,
                ppo_epochs: int = 1) -> dict[str, float]:
    """Model FLOPs of each phase of one GRPO/RLOO (``kind="online"``) or PPO (``kind="ppo"``) step.

    ``prompt_tokens`` / ``completion_tokens`` are the step's totals over its ``rows`` sequences. The policy update
    is a forward and a backward per optimisation pass (``ppo_epochs`` passes for PPO, one for GRPO/RLOO with one
    iteration per generation); PPO's rollout adds a policy forward (old log-probs and values)."""
    prompt, new = prompt_tokens / rows, completion_tokens / rows
    full = forward_flops(matmul_params, s, prompt_tokens + completion_tokens, sequence_pairs(rows, prompt + new))
    out = {"generation": forward_flops(matmul_params, s, completion_tokens, decode_pairs(rows, prompt, new)),
           "reward": 0.0, "reference forward": full, "policy update": 3.0 * full * ppo_epochs}
    if kind == "ppo":
        out["policy forward"] = full
    return out


def decode_bytes(matmul_params: int, s: Shape, rows: int, prompt: float, new: int, bytes_per_value: int) -> float:
    """Bytes ``new`` decode steps of ``rows`` rows must read at least: all matmul weights and the KV cache, per step."""
    weights = matmul_params * bytes_per_value * new
    kv = 2.0 * s.layers * s.kv_width * bytes_per_value * decode_pairs(rows, prompt, new)  # K and V of every key read
    return weights + kv
