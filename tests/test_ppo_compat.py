"""PPOTrainer against classic TRL 0.11's surface: spec signatures, the inputs its own tests pass, stats layout,
and the input holes of issue 12.6 (each test failed before its fix)."""

import warnings

import numpy as np
import pytest
import torch

from rlhf_core import PPOConfig, PPOTrainer
from rlhf_core.trainers.experience import Experience, ModelBatch
from rlhf_core.trainers.timing import phase_timer
from tests.test_ppo_trainer import batch_of, make_policy, make_trainer, weights


class PairDataset(torch.utils.data.Dataset):
    """Rows are (query, response) tuples of equal-length tensors, as classic TRL's tests build them."""

    def __init__(self, n=4, length=5):
        g = torch.Generator().manual_seed(1)
        self.rows = [(torch.randint(3, 400, (length,), generator=g), torch.randint(3, 400, (length,), generator=g))
                     for _ in range(n)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def trainer_with(tokenizer, dataset, **config):
    config = {"batch_size": 2, "mini_batch_size": 1, "learning_rate": 1e-3, **config}
    return PPOTrainer(PPOConfig(**config), make_policy(tokenizer), None, tokenizer, dataset=dataset)


# ---------------------------------------------------------------------------- inputs classic TRL's tests pass


@pytest.mark.parametrize("scores", [[torch.tensor(1.0), torch.tensor(0.0)], [torch.tensor([1.0]), torch.tensor([0.0])],
                                    [1.0, 0]])
def test_tuple_dataset_rows_collate_and_step_as_in_classic_trl(tokenizer, scores):
    trainer = trainer_with(tokenizer, PairDataset())
    for query_tensor, response_tensor in trainer.dataloader:
        assert query_tensor.shape == (2, 5)  # default_collate stacked the tuples, as a plain DataLoader does
        stats = trainer.step(list(query_tensor), list(response_tensor), scores)
        break
    assert np.isfinite(stats["ppo/loss/total"])


def test_scalar_score_of_wrong_rank_is_refused(tokenizer):
    trainer = trainer_with(tokenizer, PairDataset())
    query_tensor, response_tensor = next(iter(trainer.dataloader))
    with pytest.raises(ValueError, match=r"scores\[0\]"):
        trainer.step(list(query_tensor), list(response_tensor), [torch.tensor([[1.0]]), torch.tensor([[0.0]])])


def test_breaking_out_of_the_dataloader_starts_a_fresh_epoch_but_a_loaded_position_resumes(tokenizer, tmp_path):
    trainer = trainer_with(tokenizer, PairDataset(n=6))
    rows = lambda batch: [tuple(q.tolist()) for q in batch[0]]  # noqa: E731
    first = next(iter(trainer.dataloader))  # break after one batch of epoch 0
    trainer.save_state(str(tmp_path / "state"))
    epoch1 = [rows(b) for b in trainer.dataloader]  # a new loop: the whole of the next epoch
    assert len(epoch1) == 3 and len({r for b in epoch1 for r in b}) == 6
    assert trainer.dataloader.state_dict()["epoch"] == 2

    resumed = trainer_with(tokenizer, PairDataset(n=6))
    resumed.load_state(str(tmp_path / "state"))
    rest = [rows(b) for b in resumed.dataloader]  # continues epoch 0 after the saved batch
    assert len(rest) == 2 and not set(rows(first)) & {r for b in rest for r in b}


def test_no_dataset_warns_and_trainer_sets_config_flags(tokenizer):
    config = PPOConfig(batch_size=2, mini_batch_size=1)
    with pytest.warns(UserWarning, match="No dataset is provided"):
        PPOTrainer(config, make_policy(tokenizer), None, tokenizer)
    assert config.is_encoder_decoder is False and config.is_peft_model is False


def test_kl_penalty_private_method_follows_the_config(tokenizer):
    lp = torch.tensor([[0.5, 0.2, 0.1], [0.6, 0.2, 0.1]])
    ref = torch.tensor([[0.4, 0.3, 0.0], [0.7, 0.1, 0.3]])
    d = torch.tensor([[0.1, -0.1, 0.1], [-0.1, 0.1, -0.2]])  # lp - ref
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = {"kl": d, "abs": d.abs(), "mse": 0.5 * d**2}
        for mode, want in expected.items():
            trainer = make_trainer(tokenizer, kl_penalty=mode, batch_size=2, mini_batch_size=1)
            assert torch.allclose(trainer._kl_penalty(lp, ref), want, atol=1e-6), mode
        full = make_trainer(tokenizer, kl_penalty="full", batch_size=2, mini_batch_size=1)
    p = torch.tensor([[[0.98, 0.01, 0.01]]]).log()
    q = torch.tensor([[[0.01, 0.01, 0.98]]]).log()
    # KL(p || q) = 0.98 ln 98 + 0.01 ln 1 + 0.01 ln(1/98) = 0.97 ln 98 = 4.4474
    assert torch.allclose(full._kl_penalty(p, q), torch.tensor([[0.97 * np.log(98)]], dtype=torch.float32), atol=1e-4)


# ---------------------------------------------------------------------------- spec signatures and layout


def test_batched_forward_pass_has_the_classic_signature_and_padded_layout(tokenizer):
    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    width = max(len(q) + len(r) for q, r in zip(queries, responses)) - 1  # T-1
    inputs = trainer.prepare_model_inputs(queries, responses)
    with torch.no_grad():
        logprobs, logits, values, masks = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
        out = trainer._forward_batch(trainer.model, inputs)
        lp_fast, v_fast = out.logprobs, out.values
        _, logits_full, _, _ = trainer.batched_forward_pass(trainer.model, queries, responses, {}, return_logits=True)
    assert logits is None and logits_full.shape == (4, width, trainer.model.pretrained_model.config.vocab_size)
    assert logprobs.shape == values.shape == masks.shape == (4, width)
    for i, (q, r) in enumerate(zip(queries, responses)):
        cols = masks[i].nonzero().flatten()
        assert len(cols) == len(r)
        if tokenizer.padding_side == "right":  # no left padding: token t+1 scored at column t
            assert cols.tolist() == list(range(len(q) - 1, len(q) - 1 + len(r)))
        assert torch.allclose(logprobs[i, cols], lp_fast[i, : len(r)], atol=1e-6)
        assert torch.allclose(values[i, cols], v_fast[i, : len(r)], atol=1e-6)
        assert float(logprobs[i][masks[i] == 0].abs().sum()) == 0.0


def test_train_minibatch_takes_the_classic_arguments_and_updates_weights(tokenizer):
    trainer = make_trainer(tokenizer, batch_size=2, mini_batch_size=2)
    queries, responses = batch_of(tokenizer, n=2)
    inputs = trainer.prepare_model_inputs(queries, responses)
    with torch.no_grad():
        old_logprobs, _, old_values, mask = trainer.batched_forward_pass(trainer.model, queries, responses, inputs)
    logprobs, logits, vpreds, _ = trainer.batched_forward_pass(trainer.model, queries, responses, inputs,
                                                               return_logits=True)
    advantages = mask * torch.tensor([[1.0], [-1.0]])
    before = weights(trainer.model)
    stats = trainer.train_minibatch(old_logprobs, old_values, logprobs, logits, vpreds, mask, advantages,
                                    old_values + advantages)
    assert {"loss/policy", "loss/value", "loss/total"} <= set(stats)
    after = weights(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_step_calls_an_overridden_train_minibatch_with_the_eight_classic_arguments(tokenizer):
    calls = []

    class Spy(PPOTrainer):
        def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns):
            calls.append((logprobs.shape, logits.shape, mask.shape))
            return super().train_minibatch(old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Spy(PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1), make_policy(tokenizer), None, tokenizer)
    queries, responses = batch_of(tokenizer)
    trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert len(calls) == 2 and all(lp == m and lg[:2] == lp for lp, lg, m in calls)


def test_objective_logprobs_have_classic_trls_padded_shape(tokenizer):
    trainer = make_trainer(tokenizer)
    queries, responses = batch_of(tokenizer)
    width = max(len(q) + len(r) for q, r in zip(queries, responses)) - 1
    with torch.no_grad():
        expected, _, _, masks = trainer.batched_forward_pass(trainer.model, queries, responses)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert stats["objective/logprobs"].shape == stats["objective/ref_logprobs"].shape == (4, width)
    assert np.allclose(stats["objective/logprobs"], expected.numpy(), atol=1e-5)  # rollout = pre-update policy
    assert stats["objective/kl_dist"].shape == (4,)
    n = trainer.config.ppo_epochs * 4 * width  # every mini-batch's (b, T-1) values, flattened
    assert stats["ppo/policy/advantages"].shape == stats["ppo/policy/ratio"].shape == (n,)


def test_experience_and_model_batch_are_keyword_only():
    t = torch.zeros(1, 1)
    with pytest.raises(TypeError):
        Experience(t, t, t, t, t, t, t, t)
    with pytest.raises(TypeError):
        ModelBatch({}, t, t, "input_ids")


def test_phase_timer_records_under_time_ppo():
    timing = {}
    with phase_timer(timing, "forward_pass"):
        pass
    assert list(timing) == ["time/ppo/forward_pass"] and timing["time/ppo/forward_pass"] >= 0


# ---------------------------------------------------------------------------- issue 12.6: input holes


def test_scores_that_require_grad_are_detached_with_two_minibatches(tokenizer):
    trainer = make_trainer(tokenizer, batch_size=4, mini_batch_size=2)
    queries, responses = batch_of(tokenizer)
    raw = torch.tensor([1.0, -0.5, 0.3, 2.0], requires_grad=True)
    stats = trainer.step(queries, responses, [s * 1.0 for s in raw])  # each score carries a graph
    assert np.isfinite(stats["ppo/loss/total"]) and raw.grad is None


@pytest.mark.parametrize("bad,message", [
    (float("nan"), r"response_masks\[1\]\[0\] is nan"),
    (5.0, r"response_masks\[1\]\[0\] is 5.0"),
    ("zeros", r"response_masks\[1\] is all zeros"),
])
def test_bad_response_masks_are_refused_naming_mask_and_index(tokenizer, bad, message):
    trainer = make_trainer(tokenizer)
    before = weights(trainer.model)
    queries, responses = batch_of(tokenizer)
    masks = [torch.ones(len(r)) for r in responses]
    if bad == "zeros":
        masks[1] = torch.zeros(len(responses[1]))
    else:
        masks[1][0] = bad
    with pytest.raises(ValueError, match=message):
        trainer.step(queries, responses, [torch.tensor(1.0)] * 4, response_masks=masks)
    assert all(torch.equal(before[k], weights(trainer.model)[k]) for k in before)


def test_generate_refuses_a_query_that_cannot_fit_max_new_tokens(tokenizer):
    trainer = make_trainer(tokenizer)
    limit = trainer.model.pretrained_model.config.n_positions
    long_query = torch.full((limit - 4,), 10)
    with pytest.raises(ValueError, match=r"query_tensor\[1\].*max_new_tokens \(8\).*128 positions"):
        trainer.generate([torch.tensor([5, 6]), long_query], max_new_tokens=8, do_sample=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        trainer.generate(long_query, max_new_tokens=8, do_sample=False)
    out = trainer.generate([long_query], max_new_tokens=4, do_sample=False, return_prompt=False)
    assert len(out[0]) <= 4


# ---------------------------------------------------------------------------- tracking, hub, device cache


class _FakeWandb:
    """Stands in for the wandb package: records init kwargs and logged rows."""

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    def __init__(self):
        self.inits, self.logged, self.config = [], [], {}
        outer = self

        class Run:
            config = type("Config", (), {"update": lambda self, d, allow_val_change=False: outer.config.update(d)})()

            def log(self, row, step=None):
                outer.logged.append((step, row))

            def finish(self):
                pass

        self._run = Run()

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self._run


def test_log_with_wandb_is_lazy_offline_and_honours_logging_dir(tokenizer, monkeypatch, tmp_path):
    import sys

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    trainer = make_trainer(tokenizer, log_with="wandb", tracker_project_name="proj",
                           project_kwargs={"logging_dir": str(tmp_path / "logs")})
    assert fake.inits == [{"project": "proj", "mode": "offline", "dir": str(tmp_path / "logs")}]
    assert fake.config["batch_size"] == 4
    queries, responses = batch_of(tokenizer)
    stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    trainer.log_stats(stats, {"query": ["a"] * 4, "response": ["b"] * 4}, [torch.tensor(1.0)] * 4)
    scalars = [row for _, row in fake.logged if "env/reward_mean" in row]
    assert scalars and scalars[0]["env/reward_mean"] == 1.0
    assert any(isinstance(row.get("game_log"), _FakeWandb.Table) for _, row in fake.logged)


def test_log_with_wandb_without_the_package_names_the_extra(tokenizer, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install wandb"):
        make_trainer(tokenizer, log_with="wandb")


def test_project_kwargs_logging_dir_is_where_tensorboard_writes(tokenizer, tmp_path):
    pytest.importorskip("tensorboard")
    trainer = make_trainer(tokenizer, log_with="tensorboard", tracker_project_name="tb",
                           project_kwargs={"logging_dir": str(tmp_path / "tblogs")})
    trainer.tracker.log({"x": 1.0}, step=0)
    trainer.tracker.finish()
    assert list((tmp_path / "tblogs" / "tb").iterdir())
    assert trainer.accelerator.project_configuration.logging_dir == str(tmp_path / "tblogs")


def test_push_to_hub_if_best_pushes_on_a_new_best_every_compare_steps(tokenizer, monkeypatch):
    trainer = make_trainer(tokenizer, push_to_hub_if_best_kwargs={"repo_id": "me/ppo"}, compare_steps=2)
    pushed = []
    monkeypatch.setattr(trainer, "push_to_hub", lambda **kw: pushed.append((trainer.compare_step, kw)))
    queries, responses = batch_of(tokenizer)
    for mean in (1.0, 5.0, 0.5, 2.0, 3.0):  # compared at steps 0, 2, 4: 1.0 (best), 0.5 (no), 3.0 (best)
        trainer.step(queries, responses, [torch.tensor(mean)] * 4)
    assert pushed == [(0, {"repo_id": "me/ppo"}), (4, {"repo_id": "me/ppo"})]
    with pytest.raises(ValueError, match="repo_id"):
        make_trainer(tokenizer, push_to_hub_if_best_kwargs={"private": True})


def test_push_if_best_state_lives_on_one_object_under_classic_names(tokenizer):
    trainer = make_trainer(tokenizer, push_to_hub_if_best_kwargs={"repo_id": "me/ppo"}, compare_steps=2)
    assert not {"push_to_hub_kwargs", "compare_step", "highest_reward"} & set(vars(trainer))
    state = trainer.push_if_best
    assert trainer.push_to_hub_kwargs is state.push_to_hub_kwargs == {"repo_id": "me/ppo"}
    assert trainer.compare_step == 0 and float(trainer.highest_reward) == -float("inf")
    trainer.compare_step = 3  # classic TRL's attributes could be set by scripts: they still can
    assert state.compare_step == 3
    pushed = []
    state.update(torch.tensor([1.0, 3.0]), lambda **kw: pushed.append(kw))  # step 3: not a compare step
    state.update(torch.tensor([1.0, 3.0]), lambda **kw: pushed.append(kw))  # step 4: mean 2.0 is the best yet
    assert pushed == [{"repo_id": "me/ppo"}] and float(trainer.highest_reward) == 2.0 and trainer.compare_step == 5


def test_push_to_hub_offline_is_a_clear_error_before_any_weight_change(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = make_trainer(tokenizer, push_to_hub_if_best_kwargs={"repo_id": "me/ppo"})
    before = weights(trainer.model)
    queries, responses = batch_of(tokenizer)
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE"):
        trainer.step(queries, responses, [torch.tensor(1.0)] * 4)
    assert all(torch.equal(before[k], weights(trainer.model)[k]) for k in before)


def test_optimize_device_cache_empties_the_cache_after_each_step(tokenizer, monkeypatch):
    from rlhf_core.trainers.ppo import setup as ppo_setup

    calls = []
    monkeypatch.setattr(ppo_setup, "empty_device_cache", lambda: calls.append(1))
    queries, responses = batch_of(tokenizer)
    make_trainer(tokenizer).step(queries, responses, [torch.tensor(1.0)] * 4)
    assert calls == []
    make_trainer(tokenizer, optimize_device_cache=True).step(queries, responses, [torch.tensor(1.0)] * 4)
    assert calls == [1]


def test_training_data_collator_pads_the_model_inputs_and_changes_no_value(tokenizer):
    def pad_left_to_multiple_of_8(rows):
        width = -(-max(len(r["input_ids"]) for r in rows) // 8) * 8
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r["input_ids"]):], mask[i, width - len(r["input_ids"]):] = r["input_ids"], 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}

    queries, responses = batch_of(tokenizer)
    plain = make_trainer(tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        custom = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), make_policy(tokenizer), None, tokenizer,
                            training_data_collator=pad_left_to_multiple_of_8)
    batch = custom.prepare_model_inputs(queries, responses)
    assert batch.model_inputs["input_ids"].shape[1] % 8 == 0 and "labels" not in batch.model_inputs
    with torch.no_grad():
        out = plain._forward_batch(plain.model, plain.prepare_model_inputs(queries, responses))
        lp_plain, v_plain = out.logprobs, out.values
        out = custom._forward_batch(custom.model, batch)
        lp_custom, v_custom = out.logprobs, out.values
    real = batch.response_mask.bool()  # padding slots of short responses hold no value
    assert torch.equal(real, plain.prepare_model_inputs(queries, responses).response_mask.bool())
    assert torch.allclose(lp_plain[real], lp_custom[real], atol=1e-5)
    assert torch.allclose(v_plain[real], v_custom[real], atol=1e-5)
