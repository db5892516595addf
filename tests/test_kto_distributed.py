"""KTOTrainer with two CPU processes (torchrun, gloo, ``ACCELERATE_USE_CPU=1``), as tests/test_distributed.py does.

Each rank trains the same tiny policy for two steps on its own shard of an 8-row dataset (per-device batch 2),
records what its ``compute_loss`` saw (the rows, its local KL estimate and the reference point z0 it used) and
writes its weights. The test checks: both ranks ran as MULTI_CPU with world size 2; weights identical on both
ranks and moved; the reference unchanged and identical; the ranks saw disjoint rows; every row's KL completion
is its batch neighbour's completion (the sequential pairing survives sharding); z0 is the clamped mean of both
ranks' local estimates, the same on both ranks; and logged train/eval metrics are equal on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _launch import run_two_processes

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was", "The cast was",
               "The script is", "The ending was", "The acting is"],
    "completion": [" great and warm", " hated it and the pacing", " lovely", " awful", " excellent", " a mess",
                   " happy and delightful", " dull"],
    "label": [True, False, True, False, True, False, True, False],
}


def _worker(out: Path) -> None:
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    from rlhf_core import KTOConfig, KTOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()

    class Recording(KTOTrainer):
        seen: list = []

        def kl_reference_point(self, policy_kl_logps, ref_kl_logps):
            z0 = super().kl_reference_point(policy_kl_logps, ref_kl_logps)
            local = float((policy_kl_logps - ref_kl_logps).mean())
            if self.model.training:  # evaluation also calls this; record training steps only
                self.seen[-1].update(local_kl=local, z0=float(z0))
            return z0

        def compute_loss(self, model, inputs, *args, **kwargs):
            rows = [ids[m.bool()].tolist() for ids, m in zip(inputs["input_ids"], inputs["attention_mask"])]
            completions = [ids[m.bool()].tolist() for ids, m in zip(inputs["input_ids"], inputs["completion_mask"])]
            kl_completions = [ids[m.bool()].tolist()
                              for ids, m in zip(inputs["KL_input_ids"], inputs["KL_completion_mask"])]
            self.seen.append({"rows": rows, "completions": completions, "kl_completions": kl_completions})
            return super().compute_loss(model, inputs, *args, **kwargs)

    args = KTOConfig(output_dir=str(out / "kto"), max_steps=2, per_device_train_batch_size=2,
                     per_device_eval_batch_size=2, learning_rate=1e-2, seed=0, use_cpu=True, report_to="none",
                     save_strategy="no", logging_steps=1, disable_tqdm=True, max_length=32, dataloader_num_workers=0)
    dataset = Dataset.from_dict(ROWS)
    trainer = Recording(model=tiny_causal_lm(tokenizer, seed=0), args=args, train_dataset=dataset,
                        eval_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    train_logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    eval_metrics = {k: v for k, v in trainer.evaluate().items() if "runtime" not in k and "per_second" not in k}
    rank = trainer.accelerator.process_index
    for name, module in (("policy", trainer.accelerator.unwrap_model(trainer.model)), ("ref", trainer.ref_model)):
        state = {k: v.detach().clone().contiguous() for k, v in module.state_dict().items() if "attn.bias" not in k}
        seen_ptrs, unique = set(), {}
        for key, value in state.items():
            if value.data_ptr() not in seen_ptrs:
                seen_ptrs.add(value.data_ptr())
                unique[key] = value
        save_file(unique, str(out / f"{name}{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world": trainer.accelerator.num_processes, "type": str(trainer.accelerator.distributed_type),
        "seen": Recording.seen, "train_logs": [{k: v for k, v in e.items() if "runtime" not in k} for e in train_logs],
        "eval": eval_metrics,
    }))


@pytest.mark.slow
def test_two_process_kto_keeps_ranks_identical_and_averages_the_kl_reference_point(tmp_path):
    import torch
    from safetensors.torch import load_file

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    run_two_processes(__file__, "--worker", str(tmp_path), timeout=600)

    meta = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [m["world"] for m in meta] == [2, 2] and "MULTI_CPU" in meta[0]["type"]
    policy = [load_file(str(tmp_path / f"policy{r}.safetensors")) for r in (0, 1)]
    refs = [load_file(str(tmp_path / f"ref{r}.safetensors")) for r in (0, 1)]
    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    for key in policy[0]:
        assert torch.equal(policy[0][key], policy[1][key]), f"ranks differ on {key}"
        assert torch.equal(refs[0][key], refs[1][key]) and torch.equal(refs[0][key], initial[key]), key
    assert any(not torch.equal(policy[0][k], initial[k]) for k in policy[0])

    rows = [[tuple(r) for step in m["seen"] for r in step["rows"]] for m in meta]
    assert len(rows[0]) == len(rows[1]) == 4 and not set(rows[0]) & set(rows[1])  # disjoint halves of the data
    for m in meta:
        for step in m["seen"]:  # KL completion of row i = completion of row i-1 of the same batch
            assert step["kl_completions"] == step["completions"][-1:] + step["completions"][:-1]
    assert meta[0]["seen"][1]["local_kl"] != meta[1]["seen"][1]["local_kl"]  # step 2: ranks' estimates differ
    for step in range(2):
        local = [meta[r]["seen"][step]["local_kl"] for r in (0, 1)]
        want = max(0.0, sum(local) / 2)
        for r in (0, 1):
            assert meta[r]["seen"][step]["z0"] == pytest.approx(want, abs=1e-6)
    assert meta[0]["train_logs"] == meta[1]["train_logs"]
    assert meta[0]["eval"] == meta[1]["eval"]


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(Path(sys.argv[2]))
