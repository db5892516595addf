"""PPO, SFT, reward and DPO training under ``accelerate launch`` with two CPU processes (gloo).

The tests launch this very file as the worker with ``torchrun`` (two processes, gloo) and
``ACCELERATE_USE_CPU=1``, which is exactly what ``Accelerator`` needs to pick ``MULTI_CPU``.
(``accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`` starts CPU ranks through
``mpirun`` when MPI is installed; without MPI it silently starts ONE process, so the tests do not
rely on it.)

PPO: each rank builds the same tiny policy, steps twice on its OWN batch (different queries and scores
per rank), and writes its weights and returned stats. The test then checks that DDP kept both ranks'
weights identical, that the weights moved, and that the returned stats are gathered across ranks (the
mean score both ranks report is the mean of the two local means, and equal on both ranks). The same again with
``bf16_weights=True``: bf16 weights on both ranks, and identical fp32 master weights.

SFT, reward, DPO (``transformers.Trainer`` subclasses): ONE launch runs the three trainers in sequence
(imports cost more than training). Each trains ``HF_STEPS`` steps, per-device batch 2, on an 8-example
dataset, i.e. exactly one epoch shared by the two ranks through the Trainer's own dataloader sharding.
Every rank records the rows its ``compute_loss`` actually received, and writes its weights and a JSON
summary. The tests check world size 2 and ``MULTI_CPU`` on both ranks, identical weights on both ranks,
moved weights, and that the ranks trained on disjoint halves of the dataset (a rank that iterated the
whole dataset would see the other rank's rows); SFT also runs with packing (an IterableDataset, which
accelerate dispatches from rank 0). Reward and DPO also evaluate, and the eval metrics must
be gathered (equal on both ranks); DPO's reference model must stay frozen and identical on both ranks.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from _launch import run_two_processes

from rlhf_core.models.tiny import DEFAULT_CORPUS

ROOT = Path(__file__).resolve().parents[1]
STEPS = 2
HF_STEPS = 2  # x 2 ranks x batch 2 = 8 rows = one epoch of each dataset below
PACKED_LENGTH = 12  # SFT_TEXTS pack into 9 blocks of 12 tokens: 8 are trained on

SFT_TEXTS = list(DEFAULT_CORPUS[:8])  # the tiny tokenizer's own review sentences
PAIRS = {  # distinct chosen texts and margins, so each row is identifiable from what compute_loss sees
    "prompt": ["Review: "] * 8,
    "chosen": ["a lovely film", "great acting", "a good story, warm", "wonderful music", "a brilliant script",
               "an excellent cast", "funny and charming", "a happy ending"],
    "rejected": ["a boring film", "awful acting and bad", "terrible", "dull music and slow", "a mess",
                 "I hated the characters", "slow and dull", "the ending is bad"],
    "margin": [0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5],
}
DPO_ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was", "The cast was",
               "The script is", "The ending was", "The acting is"],
    "chosen": [" great and warm", " loved the film", " lovely", " wonderful", " excellent", " brilliant",
               " happy and delightful", " good"],
    "rejected": [" terrible", " hated it and the pacing", " boring and dull", " awful", " bad", " a mess",
                 " slow", " dull"],
}


def _local_scores(rank: int, step: int) -> list[float]:
    """Per-rank, per-step scores: rank 0 positive, rank 1 negative, so the gathered mean is distinctive."""
    return [(1.0 if rank == 0 else -3.0) + 0.25 * i + 0.1 * step for i in range(4)]


def _worker(out: Path, bf16_weights: bool = False) -> None:
    import torch
    from safetensors.torch import save_file

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=0,
                       bf16_weights=bf16_weights)
    trainer = PPOTrainer(config, policy, None, tokenizer)
    rank = trainer.accelerator.process_index
    g = torch.Generator().manual_seed(100 + rank)  # different data on each rank
    records = []
    for step in range(STEPS):
        queries = [torch.randint(3, 400, (3 + i % 2,), generator=g) for i in range(4)]
        responses = [torch.randint(3, 400, (2 + i,), generator=g) for i in range(4)]
        scores = _local_scores(rank, step)
        stats = trainer.step(queries, responses, [torch.tensor(s) for s in scores])
        records.append({key: float(stats[key]) for key in ("ppo/mean_scores", "objective/kl", "ppo/loss/total",
                                                             "objective/kl_coef")})
    model = trainer.accelerator.unwrap_model(trainer.model)
    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(out / f"rank{rank}.safetensors"))
    if bf16_weights:  # the fp32 masters the bf16 weights are rounded from
        save_file({k: v.clone().contiguous() for k, v in trainer._master.state_dict().items()},
                  str(out / f"masters{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"world": trainer.accelerator.num_processes,
                                                      "type": str(trainer.accelerator.distributed_type),
                                                      "stats": records}))


# ---- SFT / reward / DPO worker -----------------------------------------------------------------


def _recording(trainer_cls: type, ids_key: str, mask_key: str | None) -> type:
    """``trainer_cls`` whose ``compute_loss`` records, per training batch, the unpadded rows it received."""
    import torch

    class Recording(trainer_cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            if model.training:
                masks = inputs[mask_key] if mask_key else torch.ones_like(inputs[ids_key])
                rows = [ids[mask.bool()].tolist() for ids, mask in zip(inputs[ids_key], masks)]
                margins = inputs["margin"].tolist() if "margin" in inputs else None
                self.seen.append({"rows": rows, "margins": margins})
            return super().compute_loss(model, inputs, *args, **kwargs)

    Recording.seen = []  # one trainer per class in the worker: a class attribute is enough
    return Recording


def _hf_args(out: Path, name: str, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=str(out / name), max_steps=HF_STEPS, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        learning_rate=1e-2, seed=0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _summary(trainer, train_output, eval_metrics=None, **extra) -> dict:
    return {
        "world": trainer.args.world_size,
        "num_processes": trainer.accelerator.num_processes,
        "process_index": trainer.accelerator.process_index,
        "type": str(trainer.accelerator.distributed_type),
        "parallel_mode": str(trainer.args.parallel_mode),
        "model_wrapped": type(trainer.model_wrapped).__name__,
        "train_loss": train_output.training_loss,
        "global_step": train_output.global_step,
        "seen": type(trainer).seen,
        "log_history": trainer.state.log_history,
        "eval": eval_metrics,
        **extra,
    }


def _save(out: Path, name: str, rank: int, model, summary: dict, suffix: str = "") -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()},
              str(out / f"{name}{suffix}_rank{rank}.safetensors"))
    if summary is not None:
        (out / f"{name}_rank{rank}.json").write_text(json.dumps(summary))


def _run_sft(out: Path, tokenizer) -> None:
    from datasets import Dataset

    from rlhf_core.models.tiny import tiny_causal_lm
    from rlhf_core.trainers.sft import SFTTrainer

    trainer = _recording(SFTTrainer, "input_ids", "attention_mask")(
        model=tiny_causal_lm(tokenizer, seed=0), args=_hf_args(out, "sft"), tokenizer=tokenizer,
        train_dataset=Dataset.from_dict({"text": SFT_TEXTS}), dataset_text_field="text", max_seq_length=32,
    )
    result = trainer.train()
    rank = trainer.accelerator.process_index
    _save(out, "sft", rank, trainer.accelerator.unwrap_model(trainer.model), _summary(trainer, result))

    # packing: an IterableDataset (ConstantLengthDataset), which accelerate shards differently (rank 0 reads
    # each global batch and dispatches the slices)
    trainer = _recording(SFTTrainer, "input_ids", None)(
        model=tiny_causal_lm(tokenizer, seed=0), args=_hf_args(out, "sft_packed"), tokenizer=tokenizer,
        train_dataset=Dataset.from_dict({"text": SFT_TEXTS}), dataset_text_field="text", packing=True,
        max_seq_length=PACKED_LENGTH,
    )
    result = trainer.train()
    _save(out, "sft_packed", rank, trainer.accelerator.unwrap_model(trainer.model), _summary(trainer, result))


def _run_reward(out: Path) -> None:
    import torch
    from datasets import Dataset

    from rlhf_core.losses import pairwise_reward_loss
    from rlhf_core.models.tiny import build_tokenizer, tiny_reward_model
    from rlhf_core.trainers.preference.reward import RewardTrainer

    # left padding: the reward must be read at the last real token whatever the padding side, also when the
    # model the Trainer hands compute_loss is the DDP wrapper
    tokenizer = build_tokenizer(padding_side="left")
    dataset = Dataset.from_dict(PAIRS)
    trainer = _recording(RewardTrainer, "input_ids_chosen", "attention_mask_chosen")(
        model=tiny_reward_model(tokenizer, seed=0), args=_hf_args(out, "reward"), tokenizer=tokenizer,
        train_dataset=dataset, eval_dataset=dataset, max_length=32,
    )
    result = trainer.train()
    eval_metrics = trainer.evaluate()
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    full = trainer._prepare_inputs(trainer.data_collator([trainer.eval_dataset[i] for i in range(len(dataset))]))
    with torch.no_grad():
        wrapped_rewards = torch.stack(trainer.pair_rewards(trainer.model_wrapped, full))  # (2, 8) through DDP
        local_rewards = torch.stack(trainer.pair_rewards(unwrapped, full))  # (2, 8) plain module
        full_loss = pairwise_reward_loss(local_rewards[0], local_rewards[1], margin=full["margin"]).item()
    rank = trainer.accelerator.process_index
    _save(out, "reward", rank, unwrapped, _summary(
        trainer, result, eval_metrics, full_eval_loss=full_loss,
        wrapped_vs_unwrapped_reward_diff=(wrapped_rewards - local_rewards).abs().max().item(),
    ))


def _run_dpo(out: Path, tokenizer) -> None:
    from datasets import Dataset

    from rlhf_core.models.tiny import tiny_causal_lm
    from rlhf_core.trainers.preference.dpo import DPOTrainer

    dataset = Dataset.from_dict(DPO_ROWS)
    trainer = _recording(DPOTrainer, "chosen_input_ids", "chosen_attention_mask")(
        model=tiny_causal_lm(tokenizer, seed=0), args=_hf_args(out, "dpo", learning_rate=5e-3), tokenizer=tokenizer,
        train_dataset=dataset, eval_dataset=dataset, max_length=32, max_prompt_length=8,
    )
    result = trainer.train()
    eval_metrics = trainer.evaluate()
    rank = trainer.accelerator.process_index
    ref = trainer.ref_model
    _save(out, "dpo", rank, trainer.accelerator.unwrap_model(trainer.model), _summary(
        trainer, result, eval_metrics, ref_trainable=[n for n, p in ref.named_parameters() if p.requires_grad],
        ref_training_mode=ref.training,
    ))
    _save(out, "dpo", rank, ref, None, suffix="_ref")


def _trainers_worker(out: Path) -> None:
    import torch

    from rlhf_core.models.tiny import build_tokenizer

    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    _run_sft(out, tokenizer)
    _run_reward(out)
    _run_dpo(out, tokenizer)


# ---- launching -----------------------------------------------------------------------------------


def _launch(flag: str, out: Path) -> None:
    """Run this file as a two-process torchrun job (gloo, CPU) with ``flag out`` and require success."""
    run_two_processes(__file__, flag, str(out))


@pytest.mark.parametrize("bf16_weights", [False, True])
def test_two_process_ppo_keeps_ranks_identical_and_gathers_stats(tmp_path, bf16_weights):
    _launch("--worker-bf16" if bf16_weights else "--worker", tmp_path)

    from safetensors.torch import load_file

    import torch

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    meta = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [m["world"] for m in meta] == [2, 2] and "MULTI_CPU" in meta[0]["type"]
    w0, w1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    assert set(w0) == set(w1)
    for key in w0:
        assert torch.equal(w0[key], w1[key]), f"ranks differ on {key}"
    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    moved = w0["transformer.h.0.mlp.c_fc.weight"]  # compared in its own dtype: bf16 rounding alone is no move
    assert not torch.equal(moved, initial["transformer.h.0.mlp.c_fc.weight"].to(moved.dtype))
    if bf16_weights:  # DDP reduced the bf16 gradients; both ranks' fp32 masters took the same updates
        assert {t.dtype for t in w0.values() if t.is_floating_point()} == {torch.bfloat16}
        m0, m1 = (load_file(str(tmp_path / f"masters{r}.safetensors")) for r in (0, 1))
        assert m0 and set(m0) == set(m1) and all(torch.equal(m0[k], m1[k]) for k in m0)
        assert {t.dtype for t in m0.values()} == {torch.float32}

    for step in range(STEPS):
        expected = (sum(_local_scores(0, step)) / 4 + sum(_local_scores(1, step)) / 4) / 2
        for rank in (0, 1):
            assert meta[rank]["stats"][step]["ppo/mean_scores"] == pytest.approx(expected, abs=1e-5)
        for key in ("objective/kl", "ppo/loss/total", "objective/kl_coef"):
            assert meta[0]["stats"][step][key] == pytest.approx(meta[1]["stats"][step][key], abs=1e-6), key


# ---- SFT / reward / DPO checks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainers_run(tmp_path_factory) -> Path:
    """One two-process launch that trains SFT, reward and DPO in sequence; its output directory."""
    out = tmp_path_factory.mktemp("trainers_2proc")
    _launch("--trainers-worker", out)
    return out


def _load_run(out: Path, name: str, suffix: str = "") -> tuple[list[dict], list[dict]]:
    from safetensors.torch import load_file

    meta = [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]
    weights = [load_file(str(out / f"{name}{suffix}_rank{r}.safetensors")) for r in (0, 1)]
    return meta, weights


def _expected_rows(name: str) -> list[list[int]]:
    """The token rows each trainer's compute_loss should see for the 8 dataset examples (order of the dataset)."""
    from rlhf_core.models.tiny import build_tokenizer
    from rlhf_core.trainers.preference.dpo import tokenize_dpo_row
    from rlhf_core.trainers.preference.reward import tokenize_pair
    from rlhf_core.trainers.sft import tokenize_texts

    tokenizer = build_tokenizer()
    if name == "sft":
        return tokenize_texts(SFT_TEXTS, tokenizer, 32)["input_ids"]
    if name == "sft_packed":
        from datasets import Dataset

        from rlhf_core.trainers.collators import ConstantLengthDataset

        blocks = [b["input_ids"].tolist() for b in ConstantLengthDataset(
            tokenizer, Dataset.from_dict({"text": SFT_TEXTS}), dataset_text_field="text", seq_length=PACKED_LENGTH)]
        assert len(blocks) >= 4 * HF_STEPS and len(set(map(tuple, blocks))) == len(blocks)
        return blocks[: 4 * HF_STEPS]
    if name == "reward":
        rows = [{k: v[i] for k, v in PAIRS.items()} for i in range(8)]
        return [tokenize_pair(row, tokenizer)["input_ids_chosen"] for row in rows]
    rows = [{k: v[i] for k, v in DPO_ROWS.items()} for i in range(8)]
    return [tokenize_dpo_row(row, tokenizer, 32, 8)["chosen_input_ids"] for row in rows]


def _check_common(out: Path, name: str, initial: dict, moved_keys: tuple[str, ...]) -> list[dict]:
    """World size, distributed type, identical and moved weights, disjoint per-rank data: the shared checks."""
    import torch

    meta, (w0, w1) = _load_run(out, name)
    for rank, m in enumerate(meta):
        assert m["process_index"] == rank
        assert m["world"] == m["num_processes"] == 2, m
        assert m["type"] == "DistributedType.MULTI_CPU", m["type"]
        assert m["parallel_mode"] == "ParallelMode.DISTRIBUTED", m["parallel_mode"]
        assert m["model_wrapped"] == "DistributedDataParallel", m["model_wrapped"]
        assert m["global_step"] == HF_STEPS
        assert math.isfinite(m["train_loss"]) and m["train_loss"] > 0

    assert set(w0) == set(w1) == set(initial)
    for key in w0:
        assert torch.equal(w0[key], w1[key]), f"{name}: ranks differ on {key}"
    for key in moved_keys:
        assert not torch.equal(w0[key], initial[key]), f"{name}: {key} did not move"

    # each rank got HF_STEPS batches of 2 rows; together they are the whole dataset, each row exactly once.
    # If every rank iterated the whole dataset (no sharding), both would see the same rows in the same order.
    expected = sorted(map(tuple, _expected_rows(name)))
    seen = [[tuple(row) for batch in m["seen"] for row in batch["rows"]] for m in meta]
    for rank in (0, 1):
        assert len(meta[rank]["seen"]) == HF_STEPS and len(seen[rank]) == 2 * HF_STEPS, meta[rank]["seen"]
    assert not set(seen[0]) & set(seen[1]), f"{name}: both ranks trained on the same rows"
    assert sorted(seen[0] + seen[1]) == expected, f"{name}: the two ranks together did not see one epoch"
    return meta


def test_two_process_sft_shards_data_and_keeps_ranks_identical(trainers_run):
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    for name in ("sft", "sft_packed"):
        _check_common(trainers_run, name, initial, ("transformer.h.0.mlp.c_fc.weight",
                                                    "transformer.h.1.attn.c_attn.weight", "transformer.wte.weight"))


def test_two_process_reward_shards_data_keeps_margin_and_gathers_eval(trainers_run):
    from rlhf_core.models.tiny import build_tokenizer, tiny_reward_model

    initial = tiny_reward_model(build_tokenizer(), seed=0).state_dict()
    meta = _check_common(trainers_run, "reward", initial, ("transformer.h.0.mlp.c_fc.weight", "score.weight"))

    # the margin column reaches compute_loss under DDP, with each row's own margin
    margin_of = {tuple(row): m for row, m in zip(_expected_rows("reward"), PAIRS["margin"])}
    for m in meta:
        for batch in m["seen"]:
            assert batch["margins"] is not None, "margin column dropped"
            assert batch["margins"] == pytest.approx([margin_of[tuple(row)] for row in batch["rows"]])
        # rewards through the DDP wrapper equal the plain module's (left padding: read at the last real token)
        assert m["wrapped_vs_unwrapped_reward_diff"] < 1e-5
    # eval is gathered: both ranks report the loss over all 8 pairs, as computed locally over the full set
    for m in meta:
        assert m["eval"]["eval_loss"] == pytest.approx(m["full_eval_loss"], abs=1e-5)
    for key in ("eval_loss", "eval_accuracy"):
        assert meta[0]["eval"][key] == pytest.approx(meta[1]["eval"][key], abs=1e-6), key


def test_two_process_dpo_shards_data_keeps_reference_frozen_and_gathers_metrics(trainers_run):
    import torch

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    initial = tiny_causal_lm(build_tokenizer(), seed=0).state_dict()
    meta = _check_common(trainers_run, "dpo", initial, ("transformer.h.0.mlp.c_fc.weight", "transformer.wte.weight"))

    _, (r0, r1) = _load_run(trainers_run, "dpo", suffix="_ref")
    assert set(r0) == set(r1) == set(initial)
    for key in r0:  # the reference never moved, on either rank
        assert torch.equal(r0[key], initial[key]) and torch.equal(r1[key], initial[key]), f"reference moved: {key}"
    for m in meta:
        assert m["ref_trainable"] == [] and m["ref_training_mode"] is False

    # DPO's own metrics are averaged over both ranks' batches: the ranks trained on different rows, yet log the
    # same values at every step (and in eval)
    logs = [[entry for entry in m["log_history"] if "rewards/margins" in entry] for m in meta]
    assert len(logs[0]) == len(logs[1]) == HF_STEPS
    for a, b in zip(*logs):
        for key in ("loss", "rewards/margins", "rewards/chosen", "logps/chosen", "logits/rejected"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/rejected"):
        assert meta[0]["eval"][key] == pytest.approx(meta[1]["eval"][key], abs=1e-6), key


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]))
if __name__ == "__main__" and "--worker-bf16" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker-bf16") + 1]), bf16_weights=True)
if __name__ == "__main__" and "--trainers-worker" in sys.argv:
    _trainers_worker(Path(sys.argv[sys.argv.index("--trainers-worker") + 1]))
