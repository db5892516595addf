"""GRPO and RLOO under two CPU processes (torchrun, gloo): prompt groups split across ranks, identical weights.

The test launches this file as the worker (as tests/test_distributed.py does). Each rank trains the same tiny
policy for two steps with ``per_device_train_batch_size=2`` and ``num_generations=4``, so every prompt group is
split over the two ranks: advantages must come from the rewards of both (gathered), the ranks must sample
different completions (one seed per process), and DDP must keep the weights identical on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from _launch import run_two_processes

ROOT = Path(__file__).resolve().parents[1]


def _worker(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from rlhf_core import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    sys.path.insert(0, str(ROOT))
    from tests._online_rl import count_e, prompt_dataset

    torch.set_num_threads(1)
    tok = build_tokenizer()
    for name, trainer_cls, config_cls, extra in (("grpo", GRPOTrainer, GRPOConfig, {"scale_rewards": "none"}),
                                                  ("rloo", RLOOTrainer, RLOOConfig, {"beta": 0.0})):
        args = config_cls(output_dir=str(out / name), report_to=[], per_device_train_batch_size=2, num_generations=4,
                          max_completion_length=6, max_steps=2, logging_steps=1, save_strategy="no",
                          learning_rate=1e-3, seed=0, **extra)
        model = tiny_causal_lm(tok)
        trainer = trainer_cls(model, count_e, args=args, train_dataset=prompt_dataset(), processing_class=tok)
        rollouts = []
        original = trainer._generate_and_score

        def recording(rows, mode, _original=original, _rollouts=rollouts):
            rollout = _original(rows, mode)
            _rollouts.append({"prompts": [r["prompt"] for r in rows], "advantages": rollout.advantages.tolist(),
                              "responses": rollout.batch.model_inputs["input_ids"].tolist()})
            return rollout

        trainer._generate_and_score = recording
        trainer.train()
        rank = trainer.args.process_index
        save_file({k: v.clone().contiguous() for k, v in model.state_dict().items()}, str(out / f"{name}-{rank}.safetensors"))
        summary = {"world_size": trainer.args.world_size, "rollouts": rollouts,
                   "reward": [h["reward"] for h in trainer.state.log_history if "reward" in h]}
        (out / f"{name}-{rank}.json").write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("online-ddp")
    run_two_processes(__file__, "--worker", str(out))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["grpo", "rloo"])
def test_two_processes_split_groups_gather_rewards_and_keep_weights_identical(run, name):
    import torch
    from safetensors.torch import load_file

    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    w0, w1 = (load_file(str(run / f"{name}-{rank}.safetensors")) for rank in (0, 1))
    s0, s1 = (json.loads((run / f"{name}-{rank}.json").read_text()) for rank in (0, 1))
    assert s0["world_size"] == s1["world_size"] == 2
    for key in w0:
        assert torch.equal(w0[key], w1[key]), key
    initial = tiny_causal_lm(build_tokenizer()).state_dict()
    assert any(not torch.equal(initial[k], w0[k]) for k in w0)
    assert s0["reward"] == s1["reward"]  # logged rewards are gathered over both ranks
    for r0, r1 in zip(s0["rollouts"], s1["rollouts"]):
        assert r0["prompts"] == r1["prompts"] and len(set(r0["prompts"])) == 1  # one group, split over the ranks
        assert r0["responses"] != r1["responses"]  # one seed per process: different samples
        both = torch.tensor(r0["advantages"] + r1["advantages"])
        # the advantages centre on the whole group's mean (GRPO, scale none; RLOO leave-one-out): sum is 0
        assert abs(float(both.sum())) < 1e-5


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    _worker(Path(sys.argv[2]))
