"""Bytes a training forward keeps for its backward, per token and per layer (issue 23, docs/scale.md).

    .venv/bin/python bench/activation_bytes.py [--hidden 896 --heads 14 --kv-heads 2 --ffn 4864 --vocab 151936]

Builds Qwen2 models of the given width (random weights, 2 and 4 layers), runs the shared training forward
(``forward.response_forward``, gradients on) over ``--rows`` x ``--tokens`` tokens, all of them scored, and sums the
bytes of every tensor autograd saves (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once):
the activation memory of a micro-batch, which a GPU holds in the same dtypes. Two precisions: bf16 weights (PPO's
GPU default, ``bf16_weights``) and fp32 weights under bf16 autocast (the Trainer-based configs' ``bf16``); and what a
GPU run of this library does beyond that (issue 35): the fused RMSNorm (``models.fused_kernels``, applied on CUDA)
with bf16 weights, and activation checkpointing (``gradient_checkpointing=True``, the eval-mode forward of PPO /
GRPO / RLOO). Under checkpointing the saved-tensor hooks see what autograd keeps outside the checkpointed layers;
each layer's input (hidden x 2 bytes per token in bf16), which the checkpoint keeps to recompute from, is added
to the per-layer figure by hand (``checkpoint_inputs``). Each at two
lengths (``--tokens`` / 2 and ``--tokens``) and two depths: the differences cancel what does not grow with tokens
(the weights, autocast's bf16 casts of them). Prints one JSON line: bytes per layer per token, and the rest
(embedding, final norm, LM head, log-softmax) per token, every token being scored.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf_core.trainers.experience import build_causal_batch  # noqa: E402
from rlhf_core.trainers.forward import response_forward  # noqa: E402


def saved_bytes(model, batch, autocast: bool) -> int:
    """Bytes of the distinct storages autograd saves during one forward with gradients."""
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        response_forward(model, batch, positions="span")
    return sum(seen.values())


def main() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    parser = argparse.ArgumentParser()
    for name, default in (("hidden", 896), ("heads", 14), ("kv-heads", 2), ("ffn", 4864), ("vocab", 151936),
                          ("rows", 2), ("tokens", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    a = parser.parse_args()
    torch.manual_seed(0)
    out = {"shape": vars(a)}
    from rlhf_core.models.fused_kernels import fuse_kernels

    modes = (("bf16_weights", torch.bfloat16, False, ""), ("autocast", torch.float32, True, ""),
             ("bf16_weights_fused", torch.bfloat16, False, "fused"),
             ("bf16_weights_fused_checkpointing", torch.bfloat16, False, "fused,checkpointing"),
             ("autocast_checkpointing", torch.float32, True, "checkpointing"))
    for label, dtype, autocast, extras in modes:
        saved = {}  # (layers, tokens) -> bytes
        for layers in (2, 4):
            config = Qwen2Config(hidden_size=a.hidden, num_hidden_layers=layers, num_attention_heads=a.heads,
                                 num_key_value_heads=a.kv_heads, intermediate_size=a.ffn, vocab_size=a.vocab,
                                 tie_word_embeddings=True, attn_implementation="sdpa")
            model = Qwen2ForCausalLM(config).to(dtype).train()
            if "fused" in extras:
                fuse_kernels(model)
            if "checkpointing" in extras:  # as PPO / GRPO / RLOO run it: eval mode, checkpointing enabled
                model.gradient_checkpointing_enable()
                model.eval()
            for tokens in (a.tokens // 2, a.tokens):
                saved[layers, tokens] = saved_bytes(model, token_batch(a.rows, tokens, a.vocab), autocast)
        # differences cancel what does not grow with tokens (weights, autocast's casts of them) or with layers
        added = a.rows * (a.tokens - a.tokens // 2)
        grow = {layers: saved[layers, a.tokens] - saved[layers, a.tokens // 2] for layers in (2, 4)}
        per_layer = (grow[4] - grow[2]) / (2 * added)
        out[label] = {"per_layer_per_token": per_layer, "rest_per_token": (grow[2] - 2 * per_layer * added) / added}
        if "checkpointing" in extras:
            out[label]["checkpoint_inputs"] = a.hidden * 2
            out[label]["per_layer_per_token"] += a.hidden * 2
    print(json.dumps(out))


def token_batch(rows: int, tokens: int, vocab: int):
    """``rows`` random rows of ``tokens`` tokens: a one-token query, the rest a response (every position scored)."""
    ids = torch.randint(0, vocab, (rows, tokens))
    return build_causal_batch([row[:1] for row in ids], [row[1:] for row in ids], pad_token_id=0, left_pad=False)


if __name__ == "__main__":
    main()
