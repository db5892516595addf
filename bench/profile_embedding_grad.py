"""Profile one GPT-2-small forward + backward (4 x 40 tokens) with the tied embedding's lookup gradient dense
(transformers' default) and sparse (``rlhf_core.models.embedding_grads``): the evidence in bench/analysis.md (a).

    OMP_NUM_THREADS=1 .venv/bin/python bench/profile_embedding_grad.py

Prints, per mode, the operators over (50257, 768) tensors and the total self CPU time.
"""

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf_core.models.embedding_grads import sparse_tied_embedding_grad


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 40))

    def step(sparse: bool) -> None:
        with sparse_tied_embedding_grad(model) if sparse else torch.enable_grad():
            logits = model(ids, logits_to_keep=28).logits
        logits.float().log_softmax(-1)[..., 0].mean().backward()
        model.zero_grad(set_to_none=True)

    for sparse in (False, True):
        step(sparse)  # warm-up
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            step(sparse)
        rows = [e for e in prof.key_averages(group_by_input_shape=True) if "50257, 768" in str(e.input_shapes)]
        total = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
        print(f"lookup gradient {'sparse' if sparse else 'dense'}: self CPU {total:.0f} ms")
        for e in sorted(rows, key=lambda e: -e.self_cpu_time_total)[:4]:
            print(f"  {e.key:28s} {e.self_cpu_time_total / 1e3:8.1f} ms  {e.input_shapes}")


if __name__ == "__main__":
    main()
