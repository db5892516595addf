"""PPOTrainer behaviour on tiny offline models: the classic algorithm, its guards and its stats."""

import math
import warnings

import numpy as np
import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core.core import AdaptiveKLController, FixedKLController, RunningMoments
from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm, tiny_seq2seq_lm
from rlhf_core.tracking import MemoryTracker

STAT_KEYS = [
    "objective/kl", "objective/kl_dist", "objective/logprobs", "objective/ref_logprobs", "objective/kl_coef",
    "objective/entropy", "ppo/mean_non_score_reward", "ppo/mean_scores", "ppo/std_scores",
    "tokens/queries_len_mean", "tokens/queries_len_std", "tokens/queries_dist", "tokens/responses_len_mean",
    "tokens/responses_len_std", "tokens/responses_dist", "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total",
    "ppo/policy/entropy", "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac",
    "ppo/policy/advantages", "ppo/policy/advantages_mean", "ppo/policy/ratio", "ppo/returns/mean",
    "ppo/returns/var", "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var",
    "ppo/val/var_explained", "ppo/learning_rate", "time/ppo/forward_pass", "time/ppo/compute_rewards",
    "time/ppo/compute_advantages", "time/ppo/optimize_step", "time/ppo/calc_stats", "time/ppo/total",
]


def make_policy(tokenizer, arch="gpt2", seed=0):
    torch.manual_seed(seed)  # the value head is initialised from the global RNG
    return AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, arch=arch, seed=seed))


def make_trainer(tokenizer, model=None, **config):
    config.setdefault("batch_size", 4)
    config.setdefault("mini_batch_size", 2)
    config.setdefault("learning_rate", 1e-3)
    model = model if model is not None else make_policy(tokenizer)
    return PPOTrainer(PPOConfig(**config), model, None, tokenizer)


def batch_of(tokenizer, n=4, response_lens=(3, 5, 2, 4)):
    """Fixed queries and responses of varied lengths (no EOS, no pad)."""
    g = torch.Generator().manual_seed(7)
    queries = [torch.randint(3, 400, (2 + i % 3,), generator=g) for i in range(n)]
    responses = [torch.randint(3, 400, (response_lens[i % len(response_lens)],), generator=g) for i in range(n)]
    return queries, responses


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- config


def test_config_derived_fields_and_defaults():
    cfg = PPOConfig(batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2)
    assert cfg.backward_batch_size == 4 and cfg.global_batch_size == 8 and cfg.global_backward_batch_size == 4
    assert cfg.total_ppo_epochs == math.ceil(20000 / 8)
    default = PPOConfig()
    assert (default.learning_rate, default.batch_size, default.mini_batch_size, default.target_kl) == (1.41e-5, 128, 128, 1)
    assert (default.init_kl_coef, default.target, default.horizon, default.kl_penalty) == (0.2, 6, 10000, "kl")


def test_config_readme_batch_size_one_fits_the_default_mini_batch():
    with pytest.warns(UserWarning, match="mini_batch_size"):
        cfg = PPOConfig(batch_size=1)
    assert cfg.mini_batch_size == 1 and cfg.backward_batch_size == 1


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"batch_size": 6, "mini_batch_size": 4}, "batch_size"),
        ({"batch_size": 8, "mini_batch_size": 2, "gradient_accumulation_steps": 3}, "gradient_accumulation_steps"),
        ({"kl_penalty": "bogus"}, "kl_penalty"),
        ({"adap_kl_ctrl": True, "target": 0}, "target"),
        ({"adap_kl_ctrl": True, "horizon": -1}, "horizon"),
        ({"batch_size": 0}, "batch_size"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"cliprange": 0}, "cliprange"),
        ({"score_clip": -1.0}, "score_clip"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ],
)
def test_config_rejects_invalid_combinations(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PPOConfig(**kwargs)


def test_fixed_kl_needs_no_target():
    assert PPOConfig(adap_kl_ctrl=False, target=None, horizon=None).target is None


def test_torch_compile_opt_in_compiles_policy_and_reference_in_place(tokenizer):
    """Compiled in place: same parameters and state-dict keys (saving unchanged); eager is the default.
    The compiled step's numbers are checked against classic TRL by bench/test_parity.py (slow)."""
    eager, compiled = make_trainer(tokenizer), make_trainer(tokenizer, torch_compile=True)
    assert eager.model.pretrained_model._compiled_call_impl is None
    assert compiled.model.pretrained_model._compiled_call_impl is not None
    assert compiled.ref_model.pretrained_model._compiled_call_impl is not None
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())


# ---------------------------------------------------------------------------- KL controllers and moments


def test_adaptive_kl_controller_formula():
    ctl = AdaptiveKLController(0.2, target=6, horizon=10000)
    ctl.update(current=9.0, n_steps=100)  # error clip(9/6 - 1) = 0.2 -> x (1 + 0.2 * 100 / 10000)
    assert ctl.value == pytest.approx(0.2 * 1.002)
    ctl.update(current=6.0, n_steps=100)  # on target: unchanged
    assert ctl.value == pytest.approx(0.2 * 1.002)
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10)
    assert fixed.value == 0.3


def test_running_moments_match_numpy():
    rm = RunningMoments()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([10.0, 20.0])
    mean_a, std_a = rm.update(a)
    rm.update(b)
    everything = np.array([1.0, 2.0, 3.0, 10.0, 20.0])
    assert (mean_a, std_a) == pytest.approx((2.0, 1.0))
    assert rm.mean == pytest.approx(everything.mean())
    assert rm.std == pytest.approx(everything.std(ddof=1), rel=1e-6)


def test_running_moments_start_from_one_value():
    # DPO's bco_pair folds in one batch mean at a time: the first update has a total count of 1 (+ 1e-24), so the
    # unbiased std divides by 0 (inf, as TRL 0.11.4's tensor arithmetic gives) instead of raising
    rm = RunningMoments()
    assert rm.update(torch.tensor(2.0)) == (2.0, 0.0)
    assert rm.mean == 2.0 and rm.std == math.inf
    rm.update(torch.tensor(4.0))
    assert rm.mean == pytest.approx(3.0) and rm.std == pytest.approx(math.sqrt(2.0))


# ---------------------------------------------------------------------------- construction and input checks


def test_trainer_rejects_bad_construction(tokenizer):
    model = make_policy(tokenizer)
    with pytest.raises(ValueError, match="value-head model"):
        PPOTrainer(PPOConfig(batch_size=1), tiny_causal_lm(tokenizer), None, tokenizer)
    with pytest.raises(ValueError, match="same object"):
        PPOTrainer(PPOConfig(batch_size=1), model, model, tokenizer)
    with pytest.raises(ValueError, match="config"):
        PPOTrainer({"batch_size": 1}, model, None, tokenizer)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda q, r, s: (q[:3], r, s), "queries"),
        (lambda q, r, s: (q, r, s[:2]), "scores"),
        (lambda q, r, s: (q, r, [torch.tensor([1.0, 2.0])] + s[1:]), "scalar"),
        (lambda q, r, s: (q, r, [torch.tensor(float("nan"))] + s[1:]), "not finite"),
        (lambda q, r, s: (q, r, [torch.tensor(float("inf"))] + s[1:]), "not finite"),
        (lambda q, r, s: (q, [torch.tensor([], dtype=torch.long)] + r[1:], s), "empty"),
        (lambda q, r, s: (q, [r[0].float()] + r[1:], s), "integer"),
        (lambda q, r, s: (q, [torch.tensor([10**6])] + r[1:], s), "outside"),
        (lambda q, r, s: ([q[0][None, :]] + q[1:], r, s), "1-d"),
        (lambda q, r, s: (torch.stack([x[:2] for x in q]), r, s), "list"),
        # issue 24: a finite score PPO's squares overflow: refused up front (it was three skipped updates, then an error)
        (lambda q, r, s: (q, r, s[:3] + [torch.tensor(3e38)]), r"scores\[3\] is 3e\+38, beyond the bound"),
        (lambda q, r, s: (q, r, [-1.5e6] + s[1:]), r"scores\[0\] is -1.5e\+06, beyond the bound \|score\| <= 1e\+06"),
        # issue 24: queries on the meta device (no values to move) are named with both devices, not a raw .item() error
        (lambda q, r, s: (q[:1] + [q[1].to("meta")] + q[2:], r, s), r"queries\[1\] is on device meta, the model on cpu"),
        (lambda q, r, s: (q, r, s[:2] + [s[2].to("meta")] + s[3:]), r"scores\[2\] is on device meta, the model on cpu"),
    ],
)
def test_step_rejects_bad_input_before_any_weight_change(tokenizer, mutate, message):
    trainer = make_trainer(tokenizer)
    before = weights(trainer.model)
    queries, responses = batch_of(tokenizer)
    scores = [torch.tensor(1.0)] * 4
    with pytest.raises(ValueError, match=message):
        trainer.step(*mutate(queries, responses, scores))
    after = weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_the_score_bound_is_inclusive_and_the_step_stays_finite_there(tokenizer):
    from rlhf_core.trainers.ppo.validation import MAX_ABS_SCORE

    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(MAX_ABS_SCORE), torch.tensor(-MAX_ABS_SCORE), 0.0, 1.0])
    assert trainer.current_step == 1 and stats["ppo/skipped_updates"] == 0  # the bound itself trains, nothing skipped
    assert all(torch.isfinite(torch.as_tensor(v)).all() for k, v in stats.items() if not k.startswith("time/"))


def test_generate_names_a_meta_query_and_both_devices(tokenizer):
    trainer = make_trainer(tokenizer)
    query = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match=r"query_tensor\[1\] is on device meta, the model on cpu"):
        trainer.generate([query, query.to("meta")], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"query_tensor\[0\] is on device meta"):
        trainer.generate(query.to("meta"), max_new_tokens=2)


# ---------------------------------------------------------------------------- forward passes


LAYOUTS = pytest.mark.parametrize("padding_side, arch", [(side, arch) for arch in ("gpt2", "llama")
                                                         for side in ("left", "right")])
"""Both padding sides, with absolute (GPT-2) and rotary (Llama) positions."""


def batch_in_layout(padding_side, arch):
    """A trainer over a tiny ``arch`` policy and ``batch_of``'s rows padded on ``padding_side``."""
    tok = build_tokenizer(padding_side=padding_side)
    trainer = make_trainer(tok, model=make_policy(tok, arch=arch))
    queries, responses = batch_of(tok)
    return trainer, queries, responses, trainer.prepare_model_inputs(queries, responses)


@LAYOUTS
def test_padded_batch_matches_single_sequences(padding_side, arch):
    trainer, queries, responses, batch = batch_in_layout(padding_side, arch)
    with torch.no_grad():
        out = trainer._forward_batch(trainer.model, batch)
        logprobs, values = out.logprobs, out.values
        for i in range(4):
            single = trainer.prepare_model_inputs([queries[i]], [responses[i]])
            out = trainer._forward_batch(trainer.model, single)
            lp, v = out.logprobs, out.values
            n = len(responses[i])
            assert torch.allclose(logprobs[i, :n], lp[0, :n], atol=1e-4)
            assert torch.allclose(values[i, :n], v[0, :n], atol=1e-4)
            assert batch.response_mask[i].sum() == n


def test_forward_logprobs_match_a_manual_computation(tokenizer):
    trainer = make_trainer(tokenizer)
    q, r = torch.tensor([5, 6, 7]), torch.tensor([8, 9])
    with torch.no_grad():
        lp = trainer._forward_batch(trainer.model, trainer.prepare_model_inputs([q], [r])).logprobs
        logits = trainer.model.pretrained_model(torch.cat([q, r])[None]).logits[0]
    expected = torch.log_softmax(logits, -1)[[2, 3], [8, 9]]  # token 8 scored at position 2, token 9 at 3
    assert torch.allclose(lp[0], expected, atol=1e-5)


# ---------------------------------------------------------------------------- the step


def test_step_returns_every_documented_stat_finite(tokenizer):
    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(s) for s in (1.0, -0.5, 0.3, 2.0)])
    missing = [k for k in STAT_KEYS if k not in stats]
    assert not missing
    for key in STAT_KEYS:
        assert np.all(np.isfinite(np.asarray(stats[key], dtype=np.float64))), key
        assert not isinstance(stats[key], torch.Tensor)  # detached to numpy / float
    assert stats["ppo/mean_scores"] == pytest.approx(0.7)


class RetrainsAfterEachUpdate(PPOTrainer):
    """A subclass that puts the policy back in train mode after every update (as custom loops do)."""

    def train_minibatch(self, *args):
        stats = super().train_minibatch(*args)
        self.model.train()
        return stats


def test_every_forward_of_a_step_runs_without_dropout(tokenizer):
    model = make_policy(tokenizer).train()  # handed over in train mode
    trainer = RetrainsAfterEachUpdate(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-3), model, None,
                                      tokenizer)
    modes = []
    for network in (trainer.model, trainer.ref_model):
        for module in network.modules():
            module.register_forward_pre_hook(lambda m, _: modes.append(m.training))
    queries, responses = batch_of(tokenizer)
    trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert len(modes) > 100 and not any(modes)  # every module of every forward, the rollout's and the updates'


def test_first_minibatch_ratio_is_one_and_kl_zero_when_policy_equals_reference(tokenizer):
    trainer = make_trainer(tokenizer, ppo_epochs=1, batch_size=4, mini_batch_size=4)
    seen = []
    original = trainer.loss

    def spy(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns):
        seen.append(((logprobs - old_logprobs) * mask).abs().max().item())
        return original(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)

    trainer.loss = spy
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert seen[0] == 0.0  # ratio exactly 1: the first mini-batch re-uses the rollout's own log-probs
    assert stats["ppo/policy/approxkl"] == 0.0
    # The KL compares two forwards of equal weights that do not run the same kernels: the policy's first
    # mini-batch forward (with gradients, rows in the mini-batch's shuffled order) and the reference's no-grad
    # forward of the batch. AVX2 kernels happen to round both alike; AVX-512 ones do not (measured 1.2e-7 and
    # 3.6e-7 nats), so "zero" means zero up to float32 rounding of ~10 summed log-probs.
    assert abs(stats["objective/kl"]) < 1e-5
    assert np.all(np.abs(stats["objective/kl_dist"]) < 1e-5)


@pytest.mark.parametrize("kl_penalty", ["kl", "full"])
def test_the_rollout_forward_is_typed_and_holds_the_vocabulary_only_for_the_full_penalty(tokenizer, kl_penalty):
    trainer = make_trainer(tokenizer, kl_penalty=kl_penalty)
    queries, responses = batch_of(tokenizer)
    batch = trainer.prepare_model_inputs(queries, responses)
    trainer._dropout_off()
    old = trainer._rollout_forward(batch)
    rows, width = batch.response_mask.shape  # (B, A)
    assert old.logprobs.shape == old.values.shape == old.ref_logprobs.shape == (rows, width)
    # the reference is a copy of the policy: the same forward, but its weights live at other addresses, and BLAS
    # kernels may block unaligned operands differently (MKL's CNR mode needs aligned memory): equal up to rounding
    torch.testing.assert_close(old.ref_logprobs, old.logprobs, rtol=0, atol=1e-5)
    if kl_penalty == "kl":
        assert old.full_logprobs is None and old.ref_full_logprobs is None
        return
    vocab = trainer.model.pretrained_model.config.vocab_size
    assert old.full_logprobs.shape == old.ref_full_logprobs.shape == (rows, width, vocab)
    tokens = torch.gather(batch.model_inputs["input_ids"][:, 1:], 1, batch.response_index)  # (B, A)
    picked = torch.gather(old.full_logprobs, 2, tokens[..., None])[..., 0]  # (B, A)
    mask = batch.response_mask.bool()  # padding slots hold no scored token
    # the same log-softmax, gathered before or after: equal up to float rounding of the two reductions
    torch.testing.assert_close(picked[mask], old.logprobs[mask], rtol=0, atol=1e-5)


def test_the_first_minibatch_is_drawn_before_the_rollout_and_its_forward_handed_over_once(tokenizer):
    trainer = make_trainer(tokenizer)  # batch_size 4, mini_batch_size 2
    np.random.seed(3)
    first = trainer._first_minibatch()
    np.random.seed(3)
    assert torch.equal(first.order, torch.from_numpy(np.random.permutation(4)))  # the draw _optimise would make
    assert torch.equal(first.rows, first.order[:2]) and first.forward is None
    queries, responses = batch_of(tokenizer)
    batch = trainer.prepare_model_inputs(queries, responses)
    trainer._dropout_off()
    old = trainer._rollout_forward(batch, first)
    kept = first.take_forward()
    logprobs, values = kept.logprobs, kept.values
    assert logprobs.requires_grad and logprobs.shape == values.shape == kept.entropy.shape == (2, batch.response_mask.shape[1])
    assert torch.equal(old.logprobs[first.rows], logprobs.detach())
    assert first.forward is None and first.take_forward() is None  # no graph kept past the first update


@pytest.mark.parametrize("kl_penalty", ["kl", "full"])
def test_reusing_the_rollout_forward_for_the_first_minibatch_changes_nothing_but_the_forward_count(
        tokenizer, kl_penalty, monkeypatch):
    """The first mini-batch's update runs on the rollout's policy forward: one policy forward fewer per step,
    the same stats and updated weights as forwarding it again (up to float rounding of other chunkings)."""
    queries, responses = batch_of(tokenizer)
    scores = [torch.tensor(s) for s in (1.0, -0.5, 0.3, 2.0)]
    results = {}
    for reuse in (True, False):
        monkeypatch.setattr(PPOTrainer, "_reuses_rollout_forward", lambda self, reuse=reuse: reuse)
        trainer = make_trainer(tokenizer, kl_penalty=kl_penalty, ppo_epochs=2)
        calls = []
        trainer.model.pretrained_model.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
        stats = trainer.step(queries, responses, scores)
        results[reuse] = stats, weights(trainer.model), calls
    (stats, after, calls), (plain_stats, plain_after, plain_calls) = results[True], results[False]
    # policy forwards: rollout 2 chunks + 2 epochs x 2 mini-batches; reusing drops one with-gradient forward
    assert plain_calls == [False, False] + [True] * 4
    assert calls == [True, False] + [True] * 3
    for key in after:
        torch.testing.assert_close(after[key], plain_after[key], rtol=1e-5, atol=1e-6)
    for key in STAT_KEYS:
        if not key.startswith("time/"):
            np.testing.assert_allclose(np.asarray(stats[key], dtype=np.float64),
                                       np.asarray(plain_stats[key], dtype=np.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["kl", "abs", "mse", "full"])
def test_each_kl_penalty_mode_steps_and_is_zero_at_start(tokenizer, mode):
    trainer = make_trainer(tokenizer, kl_penalty=mode)
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert np.isfinite(stats["objective/kl"]) and stats["objective/kl"] != 0.0
    if mode in ("abs", "mse", "full"):
        assert stats["objective/kl"] > 0


def test_reference_model_stays_bit_identical_and_policy_changes(tokenizer):
    trainer = make_trainer(tokenizer)
    ref_before, policy_before = weights(trainer.ref_model), weights(trainer.model)
    queries, responses = batch_of(tokenizer)
    for _ in range(3):
        trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(-1.0), torch.tensor(2.0)])
    ref_after, policy_after = weights(trainer.ref_model), weights(trainer.model)
    assert all(torch.equal(ref_before[k], ref_after[k]) for k in ref_before)
    assert any(not torch.equal(policy_before[k], policy_after[k]) for k in policy_before)
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def _one_step_weights(tokenizer, mini_batch_size, accumulation):
    policy = make_policy(tokenizer, seed=3)
    # SGD, not Adam: Adam's first step is lr * sign(grad), which turns float noise on near-zero
    # gradients into full-size updates and would hide (or fake) a real difference.
    config = PPOConfig(batch_size=2, mini_batch_size=mini_batch_size, gradient_accumulation_steps=accumulation,
                       ppo_epochs=1, seed=11)
    trainer = PPOTrainer(config, policy, None, tokenizer, optimizer=torch.optim.SGD(policy.parameters(), lr=0.5))
    queries, responses = batch_of(tokenizer, n=2, response_lens=(4, 4))  # equal lengths: token mean = row mean
    trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])
    return weights(trainer.model)


def test_minibatch_two_equals_minibatch_one_with_accumulation_two(tokenizer):
    full = _one_step_weights(tokenizer, mini_batch_size=2, accumulation=1)
    accumulated = _one_step_weights(tokenizer, mini_batch_size=1, accumulation=2)
    start = weights(make_policy(tokenizer, seed=3))
    assert any(not torch.equal(full[k], start[k]) for k in full)  # something was learned
    for key in full:
        assert torch.allclose(full[key], accumulated[key], atol=1e-6), key


class RecordingSGD(torch.optim.SGD):
    """SGD that records the global gradient norm it is asked to apply."""

    norms: list

    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())
        return super().step(closure)


@pytest.mark.parametrize("max_grad_norm", [None, 0.05])
def test_gradients_are_clipped_to_max_grad_norm(tokenizer, max_grad_norm):
    model = make_policy(tokenizer)
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    optimizer.norms = []
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, max_grad_norm=max_grad_norm), model, None, tokenizer,
                         optimizer=optimizer)
    queries, responses = batch_of(tokenizer)
    trainer.step(queries, responses, [torch.tensor(5.0), torch.tensor(-5.0), torch.tensor(3.0), torch.tensor(-3.0)])
    assert len(optimizer.norms) == 8  # 4 epochs x 2 mini-batches
    if max_grad_norm is None:
        assert max(optimizer.norms) > 0.05  # the bound below is really binding
    else:
        assert max(optimizer.norms) <= max_grad_norm * (1 + 1e-4)


def test_ratio_threshold_skips_the_update(tokenizer):
    trainer = make_trainer(tokenizer, ratio_threshold=0.5)  # every ratio (about 1) exceeds it
    before = weights(trainer.model)
    queries, responses = batch_of(tokenizer)
    with pytest.warns(UserWarning, match="ratio_threshold"):
        stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert stats["ppo/loss/total"] == 0.0
    after = weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_early_stopping_on_target_kl(tokenizer):
    calls = []
    trainer = make_trainer(tokenizer, early_stopping=True, target_kl=1e-9, ppo_epochs=4, learning_rate=1e-2)
    original = trainer.train_minibatch
    trainer.train_minibatch = lambda *a: calls.append(1) or original(*a)
    queries, responses = batch_of(tokenizer)
    trainer.step(queries, responses, [torch.tensor(3.0), torch.tensor(-3.0), torch.tensor(2.0), torch.tensor(-1.0)])
    assert len(calls) < 8  # stopped before the 4 x 2 mini-batches


def test_adaptive_kl_updated_once_per_step_and_scheduler_steps(tokenizer):
    model = make_policy(tokenizer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, target=6, horizon=100), model, None, tokenizer,
                         optimizer=optimizer, lr_scheduler=scheduler)
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    # kl = 0 at the first step -> error clipped to -0.2 -> 0.2 * (1 - 0.2 * 4 / 100)
    assert trainer.kl_ctl.value == pytest.approx(0.2 * (1 - 0.2 * 4 / 100))
    assert stats["ppo/learning_rate"] == pytest.approx(1e-3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_score_scaling_normalisation_and_clipping(tokenizer):
    trainer = make_trainer(tokenizer, use_score_scaling=True, use_score_norm=True, score_clip=0.5)
    scores = torch.tensor([1.0, 2.0, 3.0, 10.0])
    processed = trainer._process_scores(scores)
    expected = ((scores - scores.mean()) / (scores.std() + torch.finfo(torch.float32).eps)).clamp(-0.5, 0.5)
    assert torch.allclose(processed, expected, atol=1e-5)


def test_whiten_rewards_and_response_masks_run(tokenizer):
    trainer = make_trainer(tokenizer, whiten_rewards=True)
    queries, responses = batch_of(tokenizer)
    masks = [torch.ones_like(r) for r in responses]
    masks[1][0] = 0
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4, response_masks=masks)
    assert np.isfinite(stats["ppo/loss/total"])


def test_negative_kl_warning(tokenizer):
    trainer = make_trainer(tokenizer)
    mask = torch.ones(2, 3)
    with pytest.warns(UserWarning, match="negative"):
        trainer.record_step_stats(
            kl_coef=0.2, scores=torch.ones(2), logprobs=torch.zeros(2, 3), ref_logprobs=torch.zeros(2, 3),
            non_score_reward=torch.zeros(2, 3), masks=mask, kls=-torch.ones(2, 3),
            queries=[torch.ones(2)] * 2, responses=[torch.ones(3)] * 2,
            train_stats={"val/error": torch.ones(1), "returns/var": torch.ones(1)},
        )


def test_stats_are_detached_over_many_steps(tokenizer):
    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    for _ in range(3):
        stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
        assert not any(isinstance(v, torch.Tensor) for v in stats.values())
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in trainer.model.parameters())


def test_seq2seq_policy_steps(tokenizer):
    model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(tiny_seq2seq_lm(tokenizer))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, learning_rate=1e-3), model, None, tokenizer)
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    responses = trainer.generate(queries, max_new_tokens=4, do_sample=True)
    assert all(r[0] == tokenizer.pad_token_id for r in responses)  # decoder start token first
    stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert np.isfinite(stats["ppo/loss/total"])


def test_peft_policy_uses_adapter_disabled_reference(tokenizer):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM")
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer), peft_config=lora)
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-2), model, None, tokenizer)
    assert trainer.ref_model is None
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "v_head" in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    queries, responses = batch_of(tokenizer)
    first = trainer.step(queries, responses, [torch.tensor(2.0), torch.tensor(-2.0), torch.tensor(1.0), torch.tensor(0.0)])
    assert first["objective/kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA starts as the identity
    second = trainer.step(queries, responses, [torch.tensor(2.0), torch.tensor(-2.0), torch.tensor(1.0), torch.tensor(0.0)])
    assert second["objective/kl"] != 0.0
    assert all(torch.equal(base_before[n], p) for n, p in model.named_parameters() if n in base_before)


# ---------------------------------------------------------------------------- generation


def test_batched_greedy_generation_equals_one_by_one(tokenizer):
    trainer = make_trainer(tokenizer)
    queries = [torch.tensor(tokenizer.encode(t)) for t in ("This movie was", "I", "The plot is boring and", "A")]
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    batched = trainer.generate(queries, batch_size=4, return_prompt=False, **kwargs)
    for query, response in zip(queries, batched):
        alone = trainer.generate([query], batch_size=1, return_prompt=False, **kwargs)[0]
        assert torch.equal(response, alone)
    with_prompt = trainer.generate(queries, batch_size=3, **kwargs)
    assert all(torch.equal(w[: len(q)], q) for w, q in zip(with_prompt, queries))


def test_generated_responses_stop_at_eos_and_hold_no_padding(tokenizer):
    trainer = make_trainer(tokenizer)
    # make EOS likely so some rows finish early while others continue (padding after EOS)
    bias = {(tokenizer.eos_token_id,): 4.0}
    queries = [torch.tensor(tokenizer.encode(t)) for t in ("This movie", "I", "The plot", "A good film")] * 2
    torch.manual_seed(0)
    responses = trainer.generate(queries, batch_size=8, return_prompt=False, max_new_tokens=12, do_sample=True,
                                 sequence_bias=bias)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for r in responses:
        assert pad not in r.tolist()
        hits = (r == eos).nonzero()
        if len(hits):
            assert hits[0].item() == len(r) - 1  # cut right after the first EOS
    assert any(r[-1] == eos for r in responses) and len({len(r) for r in responses}) > 1


def test_generate_single_tensor_and_shape_check(tokenizer):
    trainer = make_trainer(tokenizer)
    query = torch.tensor([5, 6, 7])
    out = trainer.generate(query, return_prompt=False, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 3)
    with pytest.raises(ValueError, match="1-d"):
        trainer.generate(query[None, :], max_new_tokens=3)
    response, ref_response = trainer.generate([query], return_prompt=False, generate_ref_response=True,
                                              max_new_tokens=3, do_sample=False)
    assert torch.equal(response[0], ref_response[0])  # policy == reference before training


# ---------------------------------------------------------------------------- dataloader, logging, saving


def test_dataloader_from_datasets_removes_unused_columns(tokenizer):
    from datasets import Dataset

    data = Dataset.from_dict({"query": ["a", "b", "c", "d", "e"], "input_ids": [[1], [2], [3], [4], [5]], "junk": [0] * 5})
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1), make_policy(tokenizer), None, tokenizer, dataset=data)
    batches = list(trainer.dataloader)
    assert len(batches) == 2 and set(batches[0]) == {"query", "input_ids"}


def test_log_stats_sends_scalars_and_a_table(tokenizer):
    trainer = make_trainer(tokenizer)
    trainer.tracker = MemoryTracker()
    queries, responses = batch_of(tokenizer)
    rewards = [torch.tensor(1.0), torch.tensor(0.0), torch.tensor(2.0), torch.tensor(1.0)]
    stats = trainer.step(queries, responses, rewards)
    batch = {"query": ["q1", "q2", "q3", "q4"], "response": ["r1", "r2", "r3", "r4"]}
    trainer.log_stats(stats, batch, rewards)
    step, logged = trainer.tracker.metrics[-1]
    assert logged["env/reward_mean"] == 1.0 and "objective/kl" in logged and "ppo/loss/total" in logged
    name, columns, rows, _ = trainer.tracker.tables[-1]
    assert columns == ["query", "response", "reward"] and rows[2] == ["q3", "r3", 2.0]
    with pytest.raises(ValueError, match="not present"):
        trainer.log_stats(stats, {"query": batch["query"]}, rewards)


def test_gather_stats_is_identity_in_one_process(tokenizer):
    trainer = make_trainer(tokenizer)
    stats = {"a": torch.tensor([1.0, 2.0]), "b": 3.0}
    gathered = trainer.gather_stats(stats)
    assert torch.equal(gathered["a"], stats["a"]) and gathered["b"] == 3.0


def test_save_pretrained_writes_model_tokenizer_and_card(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    trainer.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "README.md").exists()
    assert (tmp_path / "tokenizer.json").exists()
    reloaded = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path))
    for key, value in trainer.model.state_dict().items():
        assert torch.equal(value, reloaded.state_dict()[key]), key
    assert "PPO" in (tmp_path / "README.md").read_text()


# ---------------------------------------------------------------------------- it learns


def test_ppo_raises_the_mean_score_of_a_simple_reward(tokenizer):
    """Reward: the fraction of response tokens from the lower half of the vocabulary (random start: ~0.5)."""
    half = len(tokenizer) // 2
    model = make_policy(tokenizer, seed=1)
    config = PPOConfig(batch_size=16, mini_batch_size=8, learning_rate=3e-3, ppo_epochs=4, init_kl_coef=0.01, seed=1,
                       adap_kl_ctrl=False)
    trainer = PPOTrainer(config, model, None, tokenizer)
    queries = [torch.tensor(tokenizer.encode(t)) for t in ("This movie was", "I", "The plot", "A good film")] * 4
    means = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(30):
            responses = trainer.generate(queries, batch_size=16, return_prompt=False, max_new_tokens=8, do_sample=True,
                                         top_k=0, top_p=1.0, min_new_tokens=8)
            scores = [(r < half).float().mean() for r in responses]
            stats = trainer.step(queries, responses, scores)
            means.append(stats["ppo/mean_scores"])
    first, last = np.mean(means[:5]), np.mean(means[-5:])
    assert last > first + 0.2, (first, last)


# ---------------------------------------------------------------------------- numerical guards


def test_nonfinite_gradients_skip_updates_and_leave_state_unchanged(tokenizer):
    trainer = make_trainer(tokenizer, max_nonfinite_updates=100)
    before = weights(trainer.model)
    trainer.model.v_head.summary.weight.register_hook(lambda grad: grad * float("inf"))
    queries, responses = batch_of(tokenizer)
    with pytest.warns(UserWarning, match="non-finite gradient norm"):
        stats = trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)] * 2)
    assert stats["ppo/skipped_updates"] == 8.0  # 4 epochs x 2 mini-batches
    after = weights(trainer.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # Adam as if it never stepped: the fused kernel skipped on the device (step count back to 0, moments 0)
    for state in trainer.optimizer.state_dict()["state"].values():
        assert float(state["step"]) == 0 and not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_too_many_nonfinite_updates_in_a_row_stop_the_run(tokenizer):
    trainer = make_trainer(tokenizer, max_nonfinite_updates=3)
    original = trainer.loss
    trainer.loss = lambda *a: (lambda p, v, s: (p * float("nan"), v, s))(*original(*a))
    queries, responses = batch_of(tokenizer)
    with pytest.warns(UserWarning, match="non-finite loss"), pytest.raises(RuntimeError, match="3 PPO updates in a row"):
        trainer.step(queries, responses, [torch.tensor(1.0)] * 4)


def test_a_finite_update_resets_the_nonfinite_count(tokenizer):
    trainer = make_trainer(tokenizer, max_nonfinite_updates=2)
    original, calls = trainer.loss, []

    def every_other_nan(*args):
        pg, vf, stats = original(*args)
        calls.append(1)
        return (pg * float("nan") if len(calls) % 2 else pg), vf, stats

    trainer.loss = every_other_nan
    queries, responses = batch_of(tokenizer)
    with pytest.warns(UserWarning, match="non-finite loss"):
        stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert stats["ppo/skipped_updates"] == 4.0
