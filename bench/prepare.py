"""Build the cached, library-neutral inputs of the benchmarks (run once by bench/run.py, in .venv).

- ``.cache/tokenizers/default.json``: byte-level BPE on a fixed built-in corpus (workloads a-c, parity).
- ``.cache/models/{tiny,gpt2s}-seed0``: GPT-2-shaped models built from configs with a fixed seed.
- ``.cache/tokenizers/rt.json`` and ``.cache/models/rt-sft``: for workload (d), a tokenizer trained on
  the rt-polarity snippets (read in place from ../shared/data/rt-polarity, never copied) and a small
  policy fine-tuned on them with a plain causal-LM loop.
Only plain files come out (safetensors, JSON, a ``tokenizers`` tokenizer), so both environments load the
results identically; the corpus constant is shared with ``rlhf_core.models.tiny``.
"""

from __future__ import annotations

import json
import random
import time

import common
from rlhf_core.models.tiny import DEFAULT_CORPUS

# The same built-in sentences the offline tiny models use (a constant: both libraries read the files).
CORPUS = list(DEFAULT_CORPUS)

RT_ARCH = {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 128, "vocab_size": 2048, **common.NO_DROPOUT}


def ensure_default_tokenizer() -> None:
    path = common.tokenizer_json_path("default")
    if not path.exists():
        common.train_tokenizer(CORPUS, 512, path)


def ensure_models() -> None:
    for size in common.SIZES:
        common.ensure_random_checkpoint(size, seed=0)


def ensure_sentiment_policy(steps: int = 300, batch: int = 32, seed: int = 0) -> dict:
    """Fine-tune a small GPT-2-shaped LM on the rt-polarity snippets (cached); returns its info."""
    out = common.checkpoint_dir("rt-sft")
    info_path = out / "sft.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    lines = common.rt_polarity_lines()
    if not lines:
        return {"skipped": f"no rt-polarity data at {common.RT_POLARITY}"}
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    tok_path = common.tokenizer_json_path("rt")
    if not tok_path.exists():
        common.train_tokenizer(lines, RT_ARCH["vocab_size"], tok_path)
    tokenizer = common.load_tokenizer(tok_path)
    eos = tokenizer.eos_token_id
    encoded = [ids[:63] + [eos] for ids in tokenizer(lines)["input_ids"]]
    rng = random.Random(seed)
    rng.shuffle(encoded)
    model, head = common.build_random(RT_ARCH, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1 - s / steps))
    t0, losses = time.time(), []
    for step in range(steps):
        rows = [encoded[(step * batch + i) % len(encoded)] for i in range(batch)]
        width = max(map(len, rows))
        ids = torch.full((batch, width), tokenizer.pad_token_id)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    info = {"steps": steps, "batch": batch, "snippets": len(lines), "first_loss": sum(losses[:20]) / 20,
            "last_loss": sum(losses[-20:]) / 20, "seconds": time.time() - t0, "arch": RT_ARCH}
    common.save_neutral(model, head, RT_ARCH, out)
    info_path.write_text(json.dumps(info, indent=1))
    return info


def main(sentiment: bool = True, models: bool = True) -> dict:
    """Build the cached inputs: the random checkpoints when workloads a-c or parity run (``models``), the
    rt-polarity SFT policy when workload (d) runs (``sentiment``). Workload (e) builds its own model."""
    ensure_default_tokenizer()
    if models:
        ensure_models()
    return {"sft": ensure_sentiment_policy()} if sentiment else {"sft": {"skipped": "workload (d) not selected"}}


if __name__ == "__main__":
    print(json.dumps(main()))
