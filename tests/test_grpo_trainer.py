"""GRPOTrainer on tiny models: TRL 1.16 API, shapes, reference handling, dropout, resume, logged stats."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf_core import GRPOConfig, GRPOTrainer
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm, tiny_reward_model
from rlhf_core.trainers.online import trainer as online
from rlhf_core.trainers.experience import build_causal_batch
from rlhf_core.trainers.online.trainer import GroupRepeatSampler, token_logprobs_and_entropy
from tests._online_rl import (LOGGED_KEYS, assert_finite_keys, changed, count_e, online_args,  # noqa: F401
                               prompt_dataset, snapshot, tok, toy_reward_curve, train_logs)  # tok: a fixture

_args = partial(online_args, GRPOConfig)  # _args(tmp_path, **overrides)


# ---- config

def test_config_keeps_trl_116_names_and_defaults_with_cpu_deviations(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), report_to=[])
    trl_defaults = dict(beta=0.0, loss_type="dapo", scale_rewards="group", num_generations=8, num_iterations=1,
                        epsilon=0.2, epsilon_high=None, delta=None, importance_sampling_level="token",
                        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                        reward_weights=None, mask_truncated_completions=False, use_vllm=False,
                        use_bias_correction_kl=True, shuffle_dataset=True, remove_unused_columns=False,
                        logging_steps=10, sync_ref_model=False, ref_model_mixup_alpha=0.6, ref_model_sync_steps=512,
                        multi_objective_aggregation="sum_then_normalize", entropy_coef=0.0, log_completions=False)
    assert {k: getattr(args, k) for k in trl_defaults} == trl_defaults
    # documented deviations (CPU): fp32, no checkpointing, a learning rate that moves a small model, no dropout
    assert args.bf16 is False and not args.gradient_checkpointing
    assert args.learning_rate == 5e-5 and args.disable_dropout is True and args.max_completion_length == 128
    # TRL's derived sizes: one generation per optimizer step by default
    assert (args.generation_batch_size, args.steps_per_generation) == (8, 1)
    assert GRPOConfig(output_dir=str(tmp_path), scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig(output_dir=str(tmp_path), scale_rewards=True).scale_rewards == "group"


# Every field of TRL 1.16.0's GRPOConfig / RLOOConfig (and its _BaseConfig overrides), read from its source.
TRL_116_GRPO_FIELDS = [
    "learning_rate", "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "disable_dropout",
    "cast_lm_head_to_fp32", "remove_unused_columns", "num_generations", "num_generations_eval", "max_completion_length",
    "ds3_gather_for_generation", "shuffle_dataset", "pad_to_multiple_of", "generation_batch_size",
    "steps_per_generation", "temperature", "top_p", "top_k", "min_p", "generation_kwargs", "chat_template_kwargs",
    "repetition_penalty", "cache_implementation", "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode",
    "vllm_structured_outputs_regex", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
    "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization", "vllm_max_model_length",
    "vllm_tensor_parallel_size", "beta", "num_iterations", "epsilon", "delta", "epsilon_high", "sapo_temperature_neg",
    "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg",
    "importance_sampling_level", "reward_weights", "multi_objective_aggregation", "scale_rewards", "loss_type",
    "mask_truncated_completions", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max",
    "entropy_coef_delta", "entropy_target", "max_tool_calling_iterations", "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min",
    "off_policy_mask_threshold", "use_bias_correction_kl", "log_completions", "log_multimodal",
    "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo", "use_transformers_continuous_batching",
    "transformers_continuous_batching_config", "use_transformers_paged", "vllm_importance_sampling_cap",
    "logging_steps", "gradient_checkpointing", "bf16", "lr_scheduler_kwargs", "use_liger_kernel",
    "torch_empty_cache_steps",
]
GRPO_ONLY = {"cast_lm_head_to_fp32", "delta", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos",
             "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "importance_sampling_level",
             "multi_objective_aggregation", "scale_rewards", "loss_type", "top_entropy_quantile", "entropy_coef",
             "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
             "max_tool_calling_iterations", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
             "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "off_policy_mask_threshold",
             "use_bias_correction_kl", "log_completions_hub_repo", "vllm_importance_sampling_cap"}
TRL_116_RLOO_FIELDS = [n for n in TRL_116_GRPO_FIELDS if n not in GRPO_ONLY] + ["normalize_advantages",
                                                                                  "reward_clip_range"]


def test_every_trl_116_field_exists_and_ours_are_documented(tmp_path):
    import ast
    import dataclasses
    import inspect

    from rlhf_core import RLOOConfig
    from rlhf_core.trainers.online import config as online_config

    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert [name for name in TRL_116_GRPO_FIELDS if name not in grpo] == []
    rloo = {f.name for f in dataclasses.fields(RLOOConfig)}
    assert [name for name in TRL_116_RLOO_FIELDS if name not in rloo] == []
    # a docstring line under every field this project declares (house style)
    from rlhf_core.trainers.online import grpo_config, rloo_config

    for module in (online_config, grpo_config, rloo_config):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ClassDef):
                body = node.body
                for i, item in enumerate(body):
                    if isinstance(item, ast.AnnAssign):
                        doc = body[i + 1] if i + 1 < len(body) else None
                        assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), item.target.id
    # the accepted-but-unused options keep their meaning: vLLM settings are ignored without vLLM (as in TRL)
    assert GRPOConfig(output_dir=str(tmp_path), vllm_mode="server", vllm_server_port=9000).use_vllm is False


@pytest.mark.parametrize("overrides, match", [
    (dict(use_vllm=True), "use_vllm"), (dict(loss_type="cispo"), "loss_type"), (dict(scale_rewards="x"), "scale_rewards"),
    (dict(num_generations=3), "divisible by num_generations"), (dict(num_generations=1), "num_generations must be"),
    (dict(generation_batch_size=16, steps_per_generation=2), "cannot both"), (dict(top_entropy_quantile=0.2), "top_entropy"),
    (dict(use_adaptive_entropy=True), "use_adaptive_entropy"), (dict(use_transformers_paged=True), "use_transformers_paged"),
    (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32"),
])
def test_config_rejects_bad_or_unsupported_options(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(output_dir=str(tmp_path), **overrides)


def test_sampler_groups_prompts_and_repeats_generation_batches():
    sampler = GroupRepeatSampler(5, num_generations=2, prompts_per_batch=2, repeat_count=2, shuffle=False)
    # the trailing fifth prompt cannot fill a batch and is dropped
    assert list(sampler) == [0, 0, 1, 1, 0, 0, 1, 1, 2, 2, 3, 3, 2, 2, 3, 3]
    assert len(sampler) == 16
    a, b = GroupRepeatSampler(8, 4, 2, seed=3), GroupRepeatSampler(8, 4, 2, seed=3)
    assert list(a) == list(b)  # seeded: every process (and a resumed run) sees the same groups


# ---- where TRL 1.16 is weak

def test_left_padded_logprobs_equal_each_row_alone(tok):
    model = tiny_causal_lm(tok).eval()
    queries = [torch.tensor(tok("The film was great")["input_ids"]), torch.tensor(tok("A")["input_ids"])]
    responses = [torch.tensor(tok(" and good")["input_ids"]), torch.tensor(tok(" lovely film today")["input_ids"])]
    together = build_causal_batch(queries, responses, tok.pad_token_id, left_pad=True)
    with torch.no_grad():
        batched, _ = token_logprobs_and_entropy(model, together)
        for i in range(2):
            alone = build_causal_batch([queries[i]], [responses[i]], tok.pad_token_id, left_pad=True)
            single, _ = token_logprobs_and_entropy(model, alone)
            n = len(responses[i])
            torch.testing.assert_close(batched[i, :n], single[0, :n], atol=1e-5, rtol=1e-5)
        # without position ids (TRL 1.16's forward) the padded short row is scored at shifted positions
        no_pos = dict(together.model_inputs)
        no_pos.pop("position_ids")
        without = type(together)(model_inputs=no_pos, response_index=together.response_index,
                                 response_tokens=together.response_tokens, response_mask=together.response_mask,
                                 token_ids_key="input_ids")
        shifted, _ = token_logprobs_and_entropy(model, without)
    padded = int((together.model_inputs["attention_mask"][:, 0] == 0).nonzero()[0])
    n = len(responses[padded])
    assert (shifted[padded, :n] - batched[padded, :n]).abs().max() > 1e-2


def test_beta_zero_loads_no_reference_model_and_beta_copies_in_memory(tok, tmp_path, monkeypatch):
    path = tmp_path / "policy"
    tiny_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)
    loads = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def counting(cls, name, *args, **kwargs):
        loads.append(str(name))
        return real(cls, name, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(counting))
    trainer = GRPOTrainer(str(path), count_e, args=_args(tmp_path, beta=0.0), train_dataset=prompt_dataset())
    assert trainer.ref_model is None and loads == [str(path)]
    loads.clear()
    trainer = GRPOTrainer(str(path), count_e, args=_args(tmp_path, beta=0.1), train_dataset=prompt_dataset())
    assert trainer.ref_model is not None and loads == [str(path)]  # the reference is a copy, not a re-load
    for ref_p, p in zip(trainer.ref_model.parameters(), trainer.model.parameters()):
        assert torch.equal(ref_p, p) and ref_p.data_ptr() != p.data_ptr() and not ref_p.requires_grad


def test_dropout_is_off_in_every_forward_unless_asked(tok, tmp_path):
    def modes_during_training(disable_dropout: bool) -> set[bool]:
        model = tiny_causal_lm(tok, dropout=0.3)
        seen: set[bool] = set()
        model.register_forward_hook(lambda module, args, out: seen.add(module.training))
        trainer = GRPOTrainer(model, count_e, args=_args(tmp_path, disable_dropout=disable_dropout, max_steps=1),
                              train_dataset=prompt_dataset(), processing_class=tok)
        trainer.train()
        return seen

    assert modes_during_training(True) == {False}
    assert True in modes_during_training(False)  # TRL 1.16 behaviour on request: dropout in the loss forward


# ---- training

def test_train_moves_policy_keeps_reference_and_logs_every_stat(tok, tmp_path):
    model = tiny_causal_lm(tok)
    trainer = GRPOTrainer(model, count_e, args=_args(tmp_path, beta=0.04, learning_rate=1e-3),
                          train_dataset=prompt_dataset(), processing_class=tok)
    ref_before, before = snapshot(trainer.ref_model), snapshot(model)
    trainer.train()
    assert changed(model, before) and not changed(trainer.ref_model, ref_before)
    logs = train_logs(trainer)
    assert len(logs) == 2
    assert_finite_keys(logs, LOGGED_KEYS + ["kl", "completions/mean_terminated_length"])
    assert logs[0]["kl"] == 0.0  # the first step's policy is the reference
    assert logs[1]["kl"] > 0.0
    assert "entropy_coef" not in logs[0]  # TRL 1.16 logs it only with an entropy bonus


def test_entropy_bonus_logs_its_coefficient(tok, tmp_path):
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, entropy_coef=0.01, max_steps=1),
                          train_dataset=prompt_dataset(), processing_class=tok)
    trainer.train()
    assert train_logs(trainer)[0]["entropy_coef"] == 0.01


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_loss_stats_reduce_over_processes_as_trl_116(tok, tmp_path, level):
    # Two processes, simulated: this one holds 3 completion tokens, the other 1. TRL 1.16 reduces token means
    # as sum / count over all tokens, per-sequence clip fractions by min/max, and the rest by a plain mean.
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, beta=0.1, importance_sampling_level=level),
                          train_dataset=prompt_dataset(), processing_class=tok)
    other = {"kl": torch.tensor([[4.0 * 1.0, 1.0]]), "entropy": torch.tensor([[2.0 * 1.0, 1.0]]),
             "clip_ratio/low_min": torch.tensor([0.25, float("nan")]), "policy_loss": torch.tensor([3.0])}

    def gather(value):  # this process's value, then the other's (same layout)
        key = next(k for k in order if k not in seen)
        seen.append(key)
        theirs = other[key]
        if key not in trainer.token_mean_stats():
            theirs = theirs.reshape(-1) if key.endswith("_min") else theirs.reshape(1)
        return torch.cat([value, theirs.to(value.dtype)])

    stats = {"kl": torch.tensor(1.0), "entropy": torch.tensor(6.0), "clip_ratio/low_min": torch.tensor([0.5, 0.0]),
             "policy_loss": torch.tensor(1.0)}
    order, seen = list(stats), []
    trainer.accelerator.gather = gather
    trainer._log_loss_stats("train", stats, torch.tensor(3.0))
    metrics = trainer._metrics["train"]
    assert metrics["kl"] == [pytest.approx((1.0 * 3 + 4.0) / 4)]  # token-weighted
    assert metrics["entropy"] == [pytest.approx((6.0 * 3 + 2.0) / 4)]
    assert metrics["clip_ratio/low_min"] == [0.0]  # min over both processes' sequences, NaN ignored
    assert metrics["policy_loss"] == [2.0]  # plain mean over processes
    clip_means = {"clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"}
    assert clip_means <= set(trainer.token_mean_stats()) if level == "token" else not clip_means & set(
        trainer.token_mean_stats())


def test_rollout_shapes_and_group_advantages(tok, tmp_path):
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, beta=0.1, scale_rewards="none"),
                          train_dataset=prompt_dataset(), processing_class=tok)
    rows = [{"prompt": p, "row_id": i} for i, p in enumerate(["The film was"] * 4 + ["A good"] * 4)]
    rollout = trainer._generate_and_score(rows, "train")
    B, A = rollout.batch.response_mask.shape
    assert B == 8 and 1 <= A <= 6
    assert rollout.ref_logprobs.shape == (B, A) and rollout.old_logprobs is None  # on-policy: no old log-probs
    assert rollout.batch.model_inputs["position_ids"].shape == rollout.batch.model_inputs["input_ids"].shape
    texts = tok.batch_decode([rollout.batch.model_inputs["input_ids"][i][rollout.batch.response_index[i] + 1]
                              [rollout.batch.response_mask[i].bool()] for i in range(B)], skip_special_tokens=True)
    scores = torch.tensor(count_e(None, texts))
    expected = scores - scores.view(2, 4).mean(1).repeat_interleave(4)  # scale_rewards="none": mean-centred
    torch.testing.assert_close(rollout.advantages, expected)
    assert int(rollout.num_items) == int(rollout.batch.response_mask.sum())


def test_num_iterations_reuse_one_generation_with_importance_ratios(tok, tmp_path, monkeypatch):
    calls = []
    real = online.generate_batched
    monkeypatch.setattr(online, "generate_batched", lambda *a, **k: calls.append(1) or real(*a, **k))
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, num_iterations=2, max_steps=4,
                                                                   learning_rate=1e-2),
                          train_dataset=prompt_dataset(), processing_class=tok)
    trainer.train()
    assert len(calls) == 2  # 4 optimizer steps, one generation per 2 iterations
    assert trainer._buffered[0].old_logprobs is not None
    logs = train_logs(trainer)
    # first iteration on a generation: ratio exactly 1, nothing clipped; the second reuses moved weights
    assert logs[0]["clip_ratio/region_mean"] == 0.0 and logs[2]["clip_ratio/region_mean"] == 0.0


def test_trl_116_style_script_runs_unchanged(tok, tmp_path):
    """A TRL 1.16 GRPO quick-start: model path, reward function with an extra dataset column, prompt dataset."""
    path = tmp_path / "policy"
    tiny_causal_lm(tok).save_pretrained(path)
    tok.save_pretrained(path)
    seen_columns = []

    def reward_len(completions, row_id, **kwargs):
        seen_columns.extend(row_id)
        return [-abs(4 - len(c)) for c in completions]

    training_args = GRPOConfig(output_dir=str(tmp_path / "Tiny-GRPO"), per_device_train_batch_size=4,
                               num_generations=4, max_completion_length=5, max_steps=2, report_to=[])
    trainer = GRPOTrainer(model=str(path), reward_funcs=reward_len, args=training_args,
                          train_dataset=prompt_dataset())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert trainer.state.global_step == 2 and len(seen_columns) == 8
    assert (tmp_path / "final" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert changed(reloaded, snapshot(AutoModelForCausalLM.from_pretrained(path)))


def test_conversational_prompts_use_the_chat_template_or_fail_clearly(tok, tmp_path):
    from datasets import Dataset

    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in ["Hi", "Tell", "ok", "no"] * 2]})
    plain_tok = build_tokenizer()
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, max_steps=1), train_dataset=chat,
                          processing_class=plain_tok)
    with pytest.raises(ValueError, match="chat_template"):
        trainer.train()
    chat_tok = build_tokenizer()
    chat_tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                             "{% if add_generation_prompt %}assistant:{% endif %}"
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    trainer = GRPOTrainer(tiny_causal_lm(tok), reward, args=_args(tmp_path, max_steps=1), train_dataset=chat,
                          processing_class=chat_tok)
    trainer.train()
    assert seen and all(c[0]["role"] == "assistant" for c in seen)


def test_several_reward_functions_and_a_reward_model_with_weights(tok, tmp_path):
    reward_model = tiny_reward_model(tok)

    def const(completions, **kwargs):
        return [1.0] * len(completions)

    trainer = GRPOTrainer(tiny_causal_lm(tok), [count_e, const, reward_model],
                          args=_args(tmp_path, reward_weights=[1.0, 0.5, 2.0], max_steps=1),
                          train_dataset=prompt_dataset(), processing_class=tok,
                          reward_processing_classes=[None, None, tok])
    rows = [{"prompt": p} for p in ["The film was"] * 4 + ["A good"] * 4]
    prompts = [r["prompt"] for r in rows]
    completions = [" nice", " bad", " eee", "", " e", " ok", " fine", " yes"]
    per_func = trainer._rewards(rows, prompts, completions, [[0]] * 8)
    assert per_func.shape == (8, 3)
    assert per_func[:, 0].tolist() == [float(c.count("e")) for c in completions]
    assert per_func[:, 1].tolist() == [1.0] * 8
    texts = [p + c for p, c in zip(prompts, completions)]
    with torch.no_grad():
        inputs = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        torch.testing.assert_close(per_func[:, 2], reward_model(**inputs).logits[:, 0])
    trainer.train()
    assert_finite_keys(train_logs(trainer), ["rewards/count_e/mean", "rewards/const/mean"])
    with pytest.raises(ValueError, match="reward_weights"):
        GRPOTrainer(tiny_causal_lm(tok), [count_e, const], args=_args(tmp_path, reward_weights=[1.0]),
                    train_dataset=prompt_dataset(), processing_class=tok)


def test_missing_prompt_column_and_bad_reward_are_named(tok, tmp_path):
    from datasets import Dataset

    with pytest.raises(ValueError, match="'prompt' column"):
        GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path), train_dataset=Dataset.from_dict({"text": ["a"]}),
                    processing_class=tok)
    trainer = GRPOTrainer(tiny_causal_lm(tok), lambda completions, **k: [1.0], args=_args(tmp_path),
                          train_dataset=prompt_dataset(), processing_class=tok)
    with pytest.raises(ValueError, match="returned 1 rewards for 8"):
        trainer.train()


def test_resume_from_checkpoint_equals_a_straight_run(tok, tmp_path):
    def run(out, steps, resume=None, save_steps=None):
        args = _args(tmp_path, output_dir=str(out), max_steps=4, beta=0.04, learning_rate=1e-3,
                     save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500)
        trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=args, train_dataset=prompt_dataset(16),
                              processing_class=tok)
        if steps < 4:
            trainer.add_callback(_StopAt(steps))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "interrupted", 2, save_steps=2)
    checkpoint = tmp_path / "interrupted" / "checkpoint-2"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == 2
    resumed = run(tmp_path / "resumed", 4, resume=str(checkpoint))
    assert resumed.state.global_step == 4
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    # the resumed history starts with the checkpoint's two steps; the two new ones sampled the same completions
    assert [h["reward"] for h in train_logs(straight)] == [h["reward"] for h in train_logs(resumed)]


class _StopAt(online.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


@pytest.mark.slow
def test_reward_goes_up_on_a_toy_reward(tok, tmp_path):
    torch.manual_seed(0)
    first, last = toy_reward_curve(GRPOTrainer, GRPOConfig, tok, tmp_path)
    assert last > first + 0.5, (first, last)


# ---- shared reliability: tracker, evaluation, non-finite guard, SIGTERM

def test_tracker_receives_train_and_eval_stats_and_params(tok, tmp_path):
    from rlhf_core.tracking import MemoryTracker

    tracker = MemoryTracker()
    args = _args(tmp_path, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=8)
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=args, train_dataset=prompt_dataset(),
                          eval_dataset=prompt_dataset(4), processing_class=tok, log_with=tracker)
    trainer.train()
    assert tracker.params["num_generations"] == 4 and tracker.params["loss_type"] == "dapo"
    train_steps = [m for _, m in tracker.metrics if "loss" in m]
    assert len(train_steps) == 2 and all(k in train_steps[0] for k in ("reward", "entropy", "policy_loss"))
    evals = [m for _, m in tracker.metrics if "eval_reward" in m]
    assert len(evals) == 1 and "eval_loss" in evals[0] and "eval_completions/mean_length" in evals[0]
    with pytest.raises(ValueError, match="global eval batch"):
        _args(tmp_path, eval_strategy="steps", per_device_eval_batch_size=3)


def test_a_non_finite_loss_skips_the_update(tok, tmp_path):
    model = tiny_causal_lm(tok)
    trainer = GRPOTrainer(model, count_e, args=_args(tmp_path, max_steps=1, learning_rate=1e-2),
                          train_dataset=prompt_dataset(), processing_class=tok)
    real = trainer._policy_loss
    trainer._policy_loss = lambda *a: (real(*a)[0] * float("nan"), real(*a)[1])
    before = snapshot(model)
    with pytest.warns(UserWarning, match="non-finite"):
        trainer.train()
    assert not changed(model, before)
    assert train_logs(trainer)[-1]["skipped_updates"] == 1.0


def test_sigterm_saves_a_checkpoint_that_resumes(tok, tmp_path):
    import os
    import signal

    from rlhf_core import checkpointing as ckpt
    from rlhf_core.trainers.base import GracefulStopCallback

    class SigtermAtStep1(online.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGTERM)

    def make(callbacks):
        return GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, max_steps=3), callbacks=callbacks,
                           train_dataset=prompt_dataset(), processing_class=tok)

    with ckpt.GracefulStop() as stop:
        guard = GracefulStopCallback(stop)
        first = make([guard, SigtermAtStep1()])
        first.train()
    assert guard.stopped and first.state.global_step == 2
    assert (tmp_path / "out" / "checkpoint-2" / "trainer_state.json").is_file()
    second = make([])
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 3


def test_peft_policy_uses_its_disabled_adapter_as_reference(tok, tmp_path):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e, args=_args(tmp_path, beta=0.1, learning_rate=1e-2),
                          train_dataset=prompt_dataset(), processing_class=tok, peft_config=peft_config)
    assert trainer.ref_model is None  # no copy: the base model with the adapter off
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora" not in k}
    trainer.train()
    assert all(torch.equal(base[k], v) for k, v in trainer.model.state_dict().items() if k in base)
    logs = train_logs(trainer)
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0


def test_mask_truncated_completions_and_reference_sync(tok, tmp_path):
    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e,
                          args=_args(tmp_path, beta=0.1, mask_truncated_completions=True, max_completion_length=2,
                                     sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.25),
                          train_dataset=prompt_dataset(), processing_class=tok)
    eos, word = tok.eos_token_id, tok(" film")["input_ids"][0]
    fixed = [[word, eos], [word, word], [eos], [word, word]] * 2  # rows 1, 3, 5, 7 hit the 2-token limit
    real_sample = trainer._sample
    trainer._sample = lambda texts, conv: (real_sample(texts, conv)[0], [torch.tensor(r) for r in fixed])
    rollout = trainer._generate_and_score([{"prompt": "A good"}] * 8, "train")
    assert rollout.batch.response_mask.sum(1).tolist() == [2.0, 0.0, 1.0, 0.0] * 2
    trainer._sample = real_sample
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)
    ref_before = snapshot(trainer.ref_model)
    trainer.sync_reference(0.25)
    for (name, ref), policy in zip(trainer.ref_model.state_dict().items(), trainer.model.state_dict().values()):
        torch.testing.assert_close(ref, 0.25 * policy + 0.75 * ref_before[name])


def test_constructor_parameters_follow_trl_116_order():
    import inspect

    from rlhf_core import RLOOTrainer

    trl_grpo = ["model", "reward_funcs", "args", "train_dataset", "eval_dataset", "processing_class",
                "reward_processing_classes", "callbacks", "optimizers", "quantization_config", "peft_config", "tools",
                "rollout_func", "environment_factory"]
    assert list(inspect.signature(GRPOTrainer.__init__).parameters)[1:len(trl_grpo) + 1] == trl_grpo
    trl_rloo = trl_grpo[:11]
    assert list(inspect.signature(RLOOTrainer.__init__).parameters)[1:len(trl_rloo) + 1] == trl_rloo


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_equals_the_full_batch(tok, tmp_path, loss_type):
    """One generation of 8 trained as 2 micro-batches of 4 (accumulated) or as one batch of 8: the same step."""
    def one_step(per_device: int, accumulation: int) -> dict[str, torch.Tensor]:
        model = tiny_causal_lm(tok)
        args = _args(tmp_path, per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                     max_steps=1, loss_type=loss_type, learning_rate=1e-1, beta=0.1, optim="sgd", max_grad_norm=0.0)
        trainer = GRPOTrainer(model, count_e, args=args, train_dataset=prompt_dataset(), processing_class=tok)
        trainer.train()
        return snapshot(model)

    full, accumulated = one_step(8, 1), one_step(4, 2)
    initial = snapshot(tiny_causal_lm(tok))
    assert any(not torch.equal(initial[k], full[k]) for k in full)
    for key in full:
        torch.testing.assert_close(accumulated[key], full[key], atol=1e-6, rtol=1e-5)


def test_an_infinite_reward_is_masked_as_unscorable_with_a_warning_naming_the_sample(tok, tmp_path):
    """Issue 24: a reward function returning inf was accepted and ``reward: inf`` logged every step. It is now
    masked like TRL masks a None reward (NaN: out of its group's mean and std, advantage 0), with a warning."""
    def count_e_but_inf_for_sample_5(completions, **kwargs):
        scores = count_e(None, completions)
        scores[5] = float("inf")
        return scores

    trainer = GRPOTrainer(tiny_causal_lm(tok), count_e_but_inf_for_sample_5,
                          args=_args(tmp_path, beta=0.0, scale_rewards="none"), train_dataset=prompt_dataset(),
                          processing_class=tok)
    rows = [{"prompt": p, "row_id": i} for i, p in enumerate(["The film was"] * 4 + ["A good"] * 4)]
    with pytest.warns(RuntimeWarning, match=r"reward function 'count_e_but_inf_for_sample_5' returned inf for "
                                            r"sample 5 \(prompt 'A good'\): masked as unscorable") as caught:
        rollout = trainer._generate_and_score(rows, "train")
    assert sum("masked as unscorable" in str(w.message) for w in caught) == 1
    assert torch.isfinite(rollout.advantages).all() and rollout.advantages[5] == 0
    B = len(rows)
    texts = tok.batch_decode([rollout.batch.model_inputs["input_ids"][i][rollout.batch.response_index[i] + 1]
                              [rollout.batch.response_mask[i].bool()] for i in range(B)], skip_special_tokens=True)
    scores = torch.tensor(count_e(None, texts))
    second = scores[[4, 6, 7]]  # the second group's mean over its scorable samples only
    torch.testing.assert_close(rollout.advantages[[4, 6, 7]], second - second.mean())
    with pytest.warns(RuntimeWarning, match="masked as unscorable"):
        trainer.train()
    logged = [log["reward"] for log in train_logs(trainer) if "reward" in log]
    assert logged and all(torch.isfinite(torch.tensor(logged)))  # the logged mean reward stays finite


def test_a_huge_finite_reward_is_an_error_naming_the_reward(tok, tmp_path):
    """Issue 33: GRPO's rewards are bounded as PPO's scores are (|reward| <= 1e6), naming function, sample, value."""
    def huge_for_sample_1(completions, **kwargs):
        scores = count_e(None, completions)
        scores[1] = -2e7
        return scores

    trainer = GRPOTrainer(tiny_causal_lm(tok), huge_for_sample_1, args=_args(tmp_path, beta=0.0),
                          train_dataset=prompt_dataset(), processing_class=tok)
    rows = [{"prompt": p, "row_id": i} for i, p in enumerate(["The film was"] * 4 + ["A good"] * 4)]
    with pytest.raises(ValueError, match=r"'huge_for_sample_1' returned -2e\+07 for sample 1 \(prompt 'The film was'\)"):
        trainer._generate_and_score(rows, "train")


def test_online_rewards_have_ppos_bound():
    from rlhf_core.trainers.online.trainer import MAX_ABS_REWARD
    from rlhf_core.trainers.ppo.validation import MAX_ABS_SCORE

    assert MAX_ABS_REWARD == MAX_ABS_SCORE
