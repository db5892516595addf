"""RLOOTrainer on tiny models: TRL 1.16 API and defaults, KL in the reward, leave-one-out advantages, resume."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core import RLOOConfig, RLOOTrainer
from rlhf_core.core import sequence_logprobs
from rlhf_core.losses import rloo_advantages
from rlhf_core.models.tiny import tiny_causal_lm
from tests._online_rl import (LOGGED_KEYS, assert_finite_keys, changed, count_e, online_args,  # noqa: F401
                               prompt_dataset, snapshot, tok, toy_reward_curve, train_logs)  # tok: a fixture

_args = partial(online_args, RLOOConfig)  # _args(tmp_path, **overrides)


def test_config_keeps_trl_116_names_and_defaults(tmp_path):
    args = RLOOConfig(output_dir=str(tmp_path), report_to=[])
    trl_defaults = dict(beta=0.05, num_generations=2, num_iterations=1, epsilon=0.2, epsilon_high=None,
                        normalize_advantages=False, reward_clip_range=None, reward_weights=None,
                        mask_truncated_completions=False, temperature=1.0, top_k=0, top_p=1.0, use_vllm=False)
    assert {k: getattr(args, k) for k in trl_defaults} == trl_defaults
    assert args.bf16 is False and args.learning_rate == 5e-5 and args.disable_dropout is True
    assert not hasattr(args, "loss_type") and not hasattr(args, "scale_rewards")  # GRPO-only fields
    with pytest.raises(ValueError, match="reward_clip_range"):
        RLOOConfig(output_dir=str(tmp_path), reward_clip_range=(1.0, -1.0))


def test_kl_is_sequence_level_in_the_reward_before_the_leave_one_out_baseline(tok, tmp_path):
    model = tiny_causal_lm(tok)
    trainer = RLOOTrainer(model, count_e, args=_args(tmp_path, beta=0.5), train_dataset=prompt_dataset(),
                          processing_class=tok)
    with torch.no_grad():  # move the policy away from the reference, so the KL is not zero
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt": p} for p in ["The film was"] * 4 + ["A good"] * 4]
    rollout = trainer._generate_and_score(rows, "train")
    mask = rollout.batch.response_mask
    kl = sequence_logprobs(rollout.old_logprobs, mask) - sequence_logprobs(rollout.ref_logprobs, mask)  # (B,)
    assert kl.abs().max() > 1e-3
    index = rollout.batch.response_index
    ids = rollout.batch.model_inputs["input_ids"]
    texts = tok.batch_decode([ids[i][index[i] + 1][mask[i].bool()] for i in range(8)], skip_special_tokens=True)
    rewards = torch.tensor(count_e(None, texts)) - 0.5 * kl
    torch.testing.assert_close(rollout.advantages, rloo_advantages(rewards, 4))


def test_logged_stats_are_trl_116s_kl_token_mean_tokens_and_terminated_lengths(tok, tmp_path):
    model = tiny_causal_lm(tok)
    trainer = RLOOTrainer(model, count_e, args=_args(tmp_path, beta=0.5, max_completion_length=8),
                          train_dataset=prompt_dataset(), processing_class=tok)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    sample = trainer._sample

    def some_end_early(prompt_texts, conversational):  # completions of 2..5 tokens end with EOS, odd rows run on
        queries, responses = sample(prompt_texts, conversational)
        eos = torch.tensor([tok.eos_token_id])
        return queries, [torch.cat([r[: 1 + i % 4], eos]) if i % 2 == 0 else r for i, r in enumerate(responses)]

    trainer._sample = some_end_early
    rows = [{"prompt": p} for p in ["The film was"] * 4 + ["A good"] * 4]
    rollout = trainer._generate_and_score(rows, "train")
    mask, old, ref = rollout.batch.response_mask.tolist(), rollout.old_logprobs.tolist(), rollout.ref_logprobs.tolist()
    # naive float64: every real completion token's (logp - ref_logp), averaged over all of them (not per sequence)
    diffs = [float(o) - float(r) for m_row, o_row, r_row in zip(mask, old, ref)
             for m, o, r in zip(m_row, o_row, r_row) if m]
    metrics = trainer._metrics["train"]
    assert metrics["kl"] == [pytest.approx(sum(diffs) / len(diffs), rel=1e-5)]
    # prompt + completion tokens seen; completion lengths of those that ended with EOS
    attention = rollout.batch.model_inputs["attention_mask"]
    assert metrics["num_tokens"] == [float(attention.sum())] == [float(trainer.state.num_input_tokens_seen)]
    index, ids = rollout.batch.response_index, rollout.batch.model_inputs["input_ids"]
    completions = [ids[i][index[i] + 1][rollout.batch.response_mask[i].bool()].tolist() for i in range(8)]
    terminated = [len(c) for c in completions if c[-1] == tok.eos_token_id]
    assert sorted(terminated) == [2, 2, 4, 4]  # rows 0, 2, 4, 6: 1 + i % 4 tokens and EOS
    assert metrics["completions/min_length"] == [min(len(c) for c in completions)]
    assert metrics["completions/mean_terminated_length"] == [pytest.approx(sum(terminated) / len(terminated))]
    assert metrics["completions/min_terminated_length"] == [min(terminated)]
    assert metrics["completions/max_terminated_length"] == [max(terminated)]
    assert metrics["completions/clipped_ratio"] == [pytest.approx(sum(c[-1] != tok.eos_token_id
                                                                     for c in completions) / 8)]


def test_beta_zero_builds_no_reference(tok, tmp_path):
    trainer = RLOOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, beta=0.0),
                          train_dataset=prompt_dataset(), processing_class=tok)
    assert trainer.ref_model is None
    rollout = trainer._generate_and_score([{"prompt": "A good"}] * 8, "train")
    assert rollout.ref_logprobs is None and rollout.old_logprobs is None


def test_train_moves_policy_keeps_reference_and_logs_every_stat(tok, tmp_path):
    model = tiny_causal_lm(tok)
    trainer = RLOOTrainer(model, count_e, args=_args(tmp_path, learning_rate=1e-3), train_dataset=prompt_dataset(),
                          processing_class=tok)
    ref_before, before = snapshot(trainer.ref_model), snapshot(model)
    trainer.train()
    assert changed(model, before) and not changed(trainer.ref_model, ref_before)
    logs = train_logs(trainer)
    assert len(logs) == 2
    assert_finite_keys(logs, LOGGED_KEYS + ["kl"])
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] != 0.0


def test_trl_116_style_script_runs_unchanged(tok, tmp_path):
    path = tmp_path / "policy"
    tiny_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)

    def reward_num_unique_chars(completions, **kwargs):
        return [len(set(c)) for c in completions]

    training_args = RLOOConfig(output_dir=str(tmp_path / "Tiny-RLOO"), per_device_train_batch_size=4,
                               max_completion_length=5, max_steps=2, report_to=[])
    trainer = RLOOTrainer(model=str(path), reward_funcs=reward_num_unique_chars, args=training_args,
                          train_dataset=prompt_dataset())
    trainer.train()
    assert trainer.state.global_step == 2
    assert changed(trainer.model, snapshot(AutoModelForCausalLM.from_pretrained(path)))


def test_resume_from_checkpoint_equals_a_straight_run(tok, tmp_path):
    from tests.test_grpo_trainer import _StopAt

    def run(out, stop=None, resume=None):
        args = _args(tmp_path, output_dir=str(out), max_steps=4, learning_rate=1e-3,
                     save_strategy="steps" if stop else "no", save_steps=2)
        trainer = RLOOTrainer(tiny_causal_lm(tok), count_e, args=args, train_dataset=prompt_dataset(16),
                              processing_class=tok)
        if stop:
            trainer.add_callback(_StopAt(stop))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "interrupted", stop=2)
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "interrupted" / "checkpoint-2"))
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_reward_goes_up_on_a_toy_reward(tok, tmp_path):
    first, last = toy_reward_curve(RLOOTrainer, RLOOConfig, tok, tmp_path)
    assert last > first + 0.5, (first, last)


def test_a_huge_finite_reward_is_an_error_naming_the_reward_before_any_update(tok, tmp_path):
    """Issue 33: a finite reward of 3e38 made every update non-finite and the run then failed without naming the
    reward. RLOO's rewards are bounded as PPO's scores are: an error naming the function, sample and value."""
    def huge_for_sample_2(completions, **kwargs):
        scores = count_e(None, completions)
        scores[2] = 3e38
        return scores

    model = tiny_causal_lm(tok)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = RLOOTrainer(model, huge_for_sample_2, args=_args(tmp_path, beta=0.0), train_dataset=prompt_dataset(),
                          processing_class=tok)
    with pytest.raises(ValueError, match=r"reward function 'huge_for_sample_2' returned 3e\+38 for sample 2 "
                                         r"\(prompt .*\), beyond the bound \|reward\| <= 1e\+06"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was updated
