"""Issue 36.1: two processes compute what one does. Every trainer (PPO, GRPO, RLOO, DPO, KTO, SFT, reward) takes
one optimizer step on the same GLOBAL batch twice: in one process (``torchrun --nproc_per_node 1``, the batch whole)
and in two gloo processes (each rank half of it, DDP averaging the gradients). The weights after the step must
agree.

The optimizer is plain SGD (lr 0.5) so the weights' change is the gradient itself: Adam's first step is about
``lr * sign(grad)``, which would turn a rounding-level gradient difference on a near-zero entry into a full step.
Tolerance: the two runs sum the same per-token terms in a different order (two half-batch means averaged by the
all-reduce instead of one mean), so fp32 rounding differs at ~1e-7 relative per operation; after one step of a
2-layer model we allow 1e-5 absolute on weights of order 0.1 (measured differences are ~1e-8). A trainer that
normalised per rank instead of globally (a per-rank token mean of unequal token counts, a per-rank advantage
baseline, an unscaled loss under DDP) misses by 1e-3 or more.

Sampling differs by rank (one seed per process), so GRPO and RLOO train on a FIXED batch of completions: the
trainer's ``_sample`` is replaced by a table lookup keyed by the row's position in the global batch. PPO's ``step``
takes its completions as arguments already. Rows have unequal lengths on purpose (token means over ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import ROOT, WORKER_ENV, free_port

GLOBAL_BATCH = 4
LR = 0.5
TOLERANCE = 1e-5  # see the module docstring
TRAINERS = ("sft", "reward", "dpo", "kto", "grpo", "rloo", "ppo")
SHARDING = os.environ.get("RLHF_TEST_SHARDING")
"""Unset: CPU ranks (gloo). ``ddp`` or ``fsdp2``: the same runs on CUDA devices, plain or through accelerate's FSDP2
plugin (tests/test_fsdp2.py compares the two; on CPU ranks accelerate ignores the plugin)."""
FSDP2_CONFIG = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "reshard_after_forward": True}


def _sharding_args() -> dict:
    """TrainingArguments for ``SHARDING``: the CPU, or CUDA with accelerate's FSDP2 plugin."""
    if SHARDING is None:
        return {"use_cpu": True}
    return {"use_cpu": False, **({"fsdp": "full_shard", "fsdp_config": FSDP2_CONFIG} if SHARDING == "fsdp2" else {})}


def _ppo_accelerator_kwargs() -> dict:
    if SHARDING != "fsdp2":
        return {}
    from accelerate.utils import FullyShardedDataParallelPlugin

    return {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                          transformer_cls_names_to_wrap=["GPT2Block"])}

SFT_TEXTS = ["a lovely film with a warm story", "great acting", "the music was wonderful and the cast excellent",
             "a boring mess"]
PAIRS = {"prompt": ["Review: "] * 4, "chosen": ["a lovely film", "great acting and a warm story", "wonderful",
                                                "an excellent cast"],
         "rejected": ["a boring film and slow", "awful", "dull music", "I hated the characters and the ending"]}
DPO_ROWS = {"prompt": ["The film was", "This morning I", "The story is", "The music was"],
            "chosen": [" great and warm", " loved the film", " lovely", " wonderful and happy"],
            "rejected": [" terrible", " hated it and the pacing", " boring and dull", " awful"]}
KTO_ROWS = {"prompt": ["The film was", "This morning I", "The story is", "The music was"],
            "completion": [" great and warm", " hated it and the pacing", " lovely", " awful"],
            "label": [True, False, True, False]}
COMPLETIONS = [" the end is near", " e", " we see the eerie tree", " fine"]
"""GRPO/RLOO: the completion of the row at each position of the global batch (one prompt group of 4)."""


def _hf_args(out: Path, name: str, world: int, **extra):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(out / name), max_steps=1, per_device_train_batch_size=GLOBAL_BATCH // world,
                             learning_rate=LR, optim="sgd", lr_scheduler_type="constant", seed=0, report_to=[],
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **_sharding_args(), **extra)


def _sft(out, tok, world):
    from datasets import Dataset

    from rlhf_core.models.tiny import tiny_causal_lm
    from rlhf_core.trainers.sft import SFTTrainer

    return SFTTrainer(model=tiny_causal_lm(tok, seed=0), args=_hf_args(out, "sft", world), tokenizer=tok,
                      train_dataset=Dataset.from_dict({"text": SFT_TEXTS}), dataset_text_field="text", max_seq_length=32)


def _reward(out, tok, world):
    from datasets import Dataset

    from rlhf_core.models.tiny import tiny_reward_model
    from rlhf_core.trainers.preference.reward import RewardTrainer

    return RewardTrainer(model=tiny_reward_model(tok, seed=0), args=_hf_args(out, "reward", world), tokenizer=tok,
                         train_dataset=Dataset.from_dict(PAIRS), max_length=32)


def _dpo(out, tok, world):
    from datasets import Dataset

    from rlhf_core.models.tiny import tiny_causal_lm
    from rlhf_core.trainers.preference.dpo import DPOTrainer

    return DPOTrainer(model=tiny_causal_lm(tok, seed=0), args=_hf_args(out, "dpo", world), tokenizer=tok,
                      train_dataset=Dataset.from_dict(DPO_ROWS), max_length=32, max_prompt_length=8)


def _kto(out, tok, world):
    from datasets import Dataset

    from rlhf_core import KTOConfig, KTOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    args = KTOConfig(output_dir=str(out / "kto"), max_steps=1, per_device_train_batch_size=GLOBAL_BATCH // world,
                     learning_rate=LR, optim="sgd", lr_scheduler_type="constant", seed=0, report_to="none",
                     save_strategy="no", disable_tqdm=True, max_length=32, dataloader_num_workers=0, **_sharding_args())
    return KTOTrainer(model=tiny_causal_lm(tok, seed=0), args=args, train_dataset=Dataset.from_dict(KTO_ROWS),
                      processing_class=tok)


def _online(out, tok, world, name):
    import torch

    from rlhf_core import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    sys.path.insert(0, str(ROOT))
    from tests._online_rl import count_e, prompt_dataset

    config_cls, trainer_cls = {"grpo": (GRPOConfig, GRPOTrainer), "rloo": (RLOOConfig, RLOOTrainer)}[name]
    args = config_cls(output_dir=str(out / name), report_to=[], per_device_train_batch_size=GLOBAL_BATCH // world,
                      num_generations=4, max_completion_length=8, max_steps=1, save_strategy="no", learning_rate=LR,
                      optim="sgd", lr_scheduler_type="constant", seed=0, beta=0.04, **_sharding_args())
    trainer = trainer_cls(tiny_causal_lm(tok, seed=0), count_e, args=args, train_dataset=prompt_dataset(),
                          processing_class=tok)

    def fixed_sample(prompt_texts, conversational):  # the row at global position p gets COMPLETIONS[p]
        first = trainer.accelerator.process_index * len(prompt_texts)
        device = trainer.args.device
        queries = [torch.tensor(ids, device=device) for ids in tok(prompt_texts)["input_ids"]]
        responses = [torch.tensor(tok(COMPLETIONS[first + i])["input_ids"] + [tok.eos_token_id], device=device)
                     for i in range(len(prompt_texts))]
        return queries, responses

    trainer._sample = fixed_sample
    return trainer


def _ppo_step(tok, world, rank):
    """One PPO step on this rank's slice of a fixed global batch (queries, responses, scores); the model."""
    import torch

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    local = GLOBAL_BATCH // world
    torch.manual_seed(0)  # the value head's initial weights are drawn from the global RNG
    policy = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tok, seed=0))
    config = PPOConfig(batch_size=local, mini_batch_size=local, ppo_epochs=1, learning_rate=LR, seed=0,
                       accelerator_kwargs=_ppo_accelerator_kwargs())
    trainer = PPOTrainer(config, policy, None, tok, optimizer=torch.optim.SGD(policy.parameters(), lr=LR))
    g = torch.Generator().manual_seed(7)
    queries = [torch.randint(3, 300, (3 + i % 2,), generator=g) for i in range(GLOBAL_BATCH)]
    responses = [torch.randint(3, 300, (2 + i,), generator=g) for i in range(GLOBAL_BATCH)]
    scores = [torch.tensor(1.5 - i) for i in range(GLOBAL_BATCH)]
    mine = slice(rank * local, (rank + 1) * local)
    trainer.step(queries[mine], responses[mine], scores[mine])
    return trainer.accelerator.unwrap_model(trainer.model)


def _full_state(model) -> dict:
    """The model's floating-point weights, whole (FSDP2 shards gathered), tied weights once, on the CPU."""
    from torch.distributed.tensor import DTensor

    state, seen = {}, set()
    for key, value in model.state_dict().items():
        storage = (value.to_local() if isinstance(value, DTensor) else value).data_ptr()
        if storage not in seen and value.is_floating_point():
            seen.add(storage)
            value = value.full_tensor() if isinstance(value, DTensor) else value
            state[key] = value.detach().to("cpu", copy=True).contiguous()
    return state


def _worker(out: Path, names: list[str]) -> None:
    import torch
    from safetensors.torch import save_file

    from rlhf_core.models.tiny import build_tokenizer

    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    builders = {"sft": _sft, "reward": _reward, "dpo": _dpo, "kto": _kto,
                "grpo": lambda o, t, w: _online(o, t, w, "grpo"), "rloo": lambda o, t, w: _online(o, t, w, "rloo")}
    for name in names:
        tok = build_tokenizer(padding_side="left") if name == "reward" else build_tokenizer()
        if name == "ppo":
            model = _ppo_step(tok, world, rank)
        else:
            trainer = builders[name](out, tok, world)
            trainer.train()
            model = trainer.accelerator.unwrap_model(trainer.model)
        state = _full_state(model)  # every rank: gathering FSDP2 shards is a collective
        if rank == 0:
            save_file(state, str(out / f"{name}-world{world}.safetensors"))
    (out / f"done-{world}-{rank}.json").write_text(json.dumps(names))


def _launch(out: Path, world: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", str(out), ",".join(TRAINERS)]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **WORKER_ENV, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp-equivalence")
    _launch(out, 1)
    _launch(out, 2)
    return out


@pytest.mark.parametrize("name", TRAINERS)
def test_two_processes_step_as_one_on_the_same_global_batch(runs, name):
    import torch
    from safetensors.torch import load_file

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm, tiny_reward_model

    one, two = (load_file(str(runs / f"{name}-world{w}.safetensors")) for w in (1, 2))
    assert set(one) == set(two)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < TOLERANCE, f"{name}: 1 vs 2 processes differ by {worst:.3g}"
    # the step moved the weights by far more than the tolerance (the comparison is not vacuous)
    initial = (tiny_reward_model if name == "reward" else tiny_causal_lm)(build_tokenizer(), seed=0).state_dict()
    key = next(k for k in one if k.endswith("h.0.mlp.c_fc.weight"))
    assert (one[key] - initial[key]).abs().max().item() > 100 * TOLERANCE


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(Path(sys.argv[sys.argv.index("--worker") + 1]), sys.argv[sys.argv.index("--worker") + 2].split(","))
