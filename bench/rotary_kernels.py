"""Kernels of the rotary embedding, transformers' eager one against ``fused_rotary`` (issue 35, docs/scale.md).

    .venv/bin/python bench/rotary_kernels.py [--layers 2 --tokens 64]

Counts the operators that compute (writes of memory: leaf ``aten::`` calls of torch.profiler, views and allocations
left out) in (1) one ``apply_rotary_pos_emb`` call on Qwen2-0.5B-shaped q / k (14 query heads, 2 key/value heads,
head width 64) and (2) one forward of a small random Qwen2 with those heads, eager and with only the rotary fused
(``fused_kernels._fuse_rotary``), forward and backward. The CPU's operator count is the count of kernels a GPU
launches for these element-wise operators (one each); their time on the CPU says nothing about a GPU. Prints JSON.
"""

import argparse
import copy
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rlhf_core.models import fused_kernels  # noqa: E402

# operators that only make views or allocate: no kernel on a GPU
NO_KERNEL = {"aten::unsqueeze", "aten::as_strided", "aten::slice", "aten::narrow", "aten::view", "aten::unflatten",
             "aten::flatten", "aten::transpose", "aten::expand", "aten::reshape", "aten::_unsafe_view", "aten::t",
             "aten::select", "aten::split", "aten::chunk", "aten::empty", "aten::empty_like", "aten::empty_strided",
             "aten::detach", "aten::alias", "aten::permute", "aten::lift_fresh", "aten::resolve_conj",
             "aten::resolve_neg", "aten::result_type", "aten::is_nonzero", "aten::_reshape_alias", "aten::zeros_like",
             "aten::zero_", "aten::fill_", "aten::ones_like", "aten::squeeze", "aten::contiguous", "aten::to",
             "aten::_to_copy"}


def _computes(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NO_KERNEL


def _below(event) -> bool:
    """Some operator under ``event`` computes (then ``event`` is a wrapper, counted through it)."""
    return any(_computes(child) or _below(child) for child in event.cpu_children)


def kernels(run) -> int:
    """Computing operators ``run()`` calls: aten events outside ``NO_KERNEL`` with no computing operator below them
    (``aten::linear`` is counted as its ``addmm``; ``aten::cat``, whose children are views, as itself)."""
    run()  # warm: lazy initialisation is not counted
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(_computes(event) and not _below(event) for event in prof.events())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 14, args.tokens, 64), torch.randn(2, 2, args.tokens, 64)
    angles = torch.randn(2, args.tokens, 32)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    call = {"eager": kernels(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
            "fused": kernels(lambda: fused_kernels.fused_rotary(q, k, cos, sin))}

    config = Qwen2Config(hidden_size=896, intermediate_size=1024, num_hidden_layers=args.layers,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=512)
    eager = Qwen2ForCausalLM(config).eval()
    fused = copy.deepcopy(eager)
    assert fused_kernels._fuse_rotary(fused) == args.layers
    ids = torch.randint(0, 512, (2, args.tokens))

    def forward(model, backward):
        def run():
            logits = model(input_ids=ids).logits
            if backward:
                model.zero_grad(set_to_none=True)
                logits.float().logsumexp(-1).sum().backward()
        return run

    model = {}
    for name, m in (("eager", eager), ("fused", fused)):
        with torch.no_grad():
            model[f"{name}_forward"] = kernels(forward(m, False))
        model[f"{name}_forward_backward"] = kernels(forward(m, True))
    print(json.dumps({"layers": args.layers, "tokens": args.tokens, "torch": torch.__version__,
                      "one_call": call, "model": model}))


if __name__ == "__main__":
    main()
