"""``run_ppo``: the library's PPO loop over the trainer's own dataloader, its checkpoints and exact resume."""

import warnings

import pytest
import torch
from datasets import Dataset

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.checkpointing import Preempted
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.ppo.loop import run_ppo

PROMPTS = ["This movie was", "I", "The plot", "A good film", "The actors", "It", "Honestly the", "My friend",
           "The ending", "What a"]
GEN = {"max_new_tokens": 4, "do_sample": True, "top_k": 0, "top_p": 1.0}


def make_trainer(tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    data = Dataset.from_dict({"query": PROMPTS, "input_ids": [tokenizer.encode(p) for p in PROMPTS]})
    config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, learning_rate=1e-3, seed=3)
    return PPOTrainer(config, model, None, tokenizer, dataset=data)


def reward(queries, responses):
    """Longer responses score higher: a deterministic function of the texts."""
    return [len(r) / 10.0 for r in responses]


def final_weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


@pytest.fixture
def straight(tokenizer):
    trainer = make_trainer(tokenizer)
    result = run_ppo(trainer, reward, total_steps=5, generation_kwargs=GEN)
    return result, final_weights(trainer)


def test_run_returns_one_row_per_step_and_reads_the_trainers_dataloader(tokenizer, straight):
    result, _ = straight
    assert [r["step"] for r in result.curve] == [0, 1, 2, 3, 4] and result.resumed_at is None
    assert all(set(r) == {"step", "reward_mean", "kl", "kl_coef"} for r in result.curve)
    seen = []
    trainer = make_trainer(tokenizer)
    run_ppo(trainer, lambda q, r: seen.extend(q) or [0.0] * len(q), total_steps=3, generation_kwargs=GEN)
    # 12 queries: epoch 0 gives two batches of 4 (2 rows dropped), epoch 1 starts a new shuffle
    assert len(seen) == 12 and set(seen[:8]) <= set(PROMPTS) and len(set(seen[:8])) == 8


def test_stop_request_saves_and_resume_equals_a_straight_run(tokenizer, straight, tmp_path):
    expected, expected_weights = straight
    calls = []
    with pytest.raises(Preempted) as stopped:
        run_ppo(make_trainer(tokenizer), reward, total_steps=5, generation_kwargs=GEN, checkpoint_dir=tmp_path / "c",
                should_stop=lambda: calls.append(1) or len(calls) == 2, stop_reason=lambda: "SIGTERM")
    assert stopped.value.step == 2 and stopped.value.signal_name == "SIGTERM"
    trainer, seen = make_trainer(tokenizer), []
    resumed = run_ppo(trainer, reward, total_steps=5, generation_kwargs=GEN, checkpoint_dir=tmp_path / "c",
                      on_resume=lambda step, path: seen.append((step, path)))
    assert resumed.resumed_at == 2 and resumed.curve == expected.curve and seen == [(2, tmp_path / "c")]
    got = final_weights(trainer)
    assert all(torch.equal(got[k], expected_weights[k]) for k in got)


def test_periodic_checkpoint_survives_a_crash_and_resumes_exactly(tokenizer, straight, tmp_path):
    """A hard kill after step 3 (here: an exception out of step 4) loses only the steps since the last save."""
    expected, expected_weights = straight
    crashing = make_trainer(tokenizer)
    original, n = crashing.step, []

    def step(*args, **kwargs):
        n.append(1)
        if len(n) == 4:
            raise KeyboardInterrupt("killed")
        return original(*args, **kwargs)

    crashing.step = step
    with pytest.raises(KeyboardInterrupt):
        run_ppo(crashing, reward, total_steps=5, generation_kwargs=GEN, checkpoint_dir=tmp_path / "c", save_every=2)
    trainer = make_trainer(tokenizer)
    resumed = run_ppo(trainer, reward, total_steps=5, generation_kwargs=GEN, checkpoint_dir=tmp_path / "c",
                      save_every=2)
    assert resumed.resumed_at == 2 and resumed.curve == expected.curve
    got = final_weights(trainer)
    assert all(torch.equal(got[k], expected_weights[k]) for k in got)


def test_loop_arguments_are_checked(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer)
    with pytest.raises(ValueError, match="save_every"):
        run_ppo(trainer, reward, total_steps=2, generation_kwargs=GEN, save_every=1)
    with pytest.raises(ValueError, match="total_steps"):
        run_ppo(trainer, reward, total_steps=0, generation_kwargs=GEN)
    with pytest.raises(ValueError, match="reward_fn returned 1 scores for 4"):
        run_ppo(trainer, lambda q, r: [1.0], total_steps=1, generation_kwargs=GEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), trainer.accelerator.unwrap_model(trainer.model)
                          .__class__.from_pretrained(tiny_causal_lm(tokenizer, seed=0)), None, tokenizer)
    with pytest.raises(ValueError, match="dataset"):
        run_ppo(bare, reward, total_steps=1, generation_kwargs=GEN)
