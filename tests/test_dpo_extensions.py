"""DPOTrainer beyond plain DPO, as TRL 0.11.4 has it: every loss_type, BCO's running shift, RPO, TR-DPO,
force_use_ref_model with LoRA, a PeftModel policy with peft_config, the pad-token refusal, dataset_num_proc and
encoder-decoder (T5) DPO."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from rlhf_core.losses import DPO_LOSS_TYPES, bco_batch_reward, dpo_loss
from rlhf_core.models.tiny import tiny_causal_lm, tiny_seq2seq_lm
from rlhf_core.trainers.preference.dpo import DPOConfig, DPOTrainer, response_logprobs
from rlhf_core.trainers.ref_sync import mix_into_reference

ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was"],
    "chosen": [" great and warm", " loved the film", " lovely", " wonderful"],
    "rejected": [" terrible", " hated it and the pacing", " boring and dull", " awful"],
}
LORA = dict(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True)


def config(tmp_path, **overrides) -> DPOConfig:
    """Tiny CPU DPOConfig that reports nowhere and saves nothing."""
    kwargs = dict(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        learning_rate=5e-3, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
        max_length=32, max_prompt_length=8,
    )
    kwargs.update(overrides)
    return DPOConfig(**kwargs)


def trainer_for(tokenizer, tmp_path, model=None, args=None, **kwargs) -> DPOTrainer:
    return DPOTrainer(
        model=model if model is not None else tiny_causal_lm(tokenizer), args=args or config(tmp_path),
        train_dataset=Dataset.from_dict(ROWS), tokenizer=tokenizer, **kwargs,
    )


def first_batch(trainer: DPOTrainer) -> dict:
    return trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# ---- the loss types through the trainer --------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_every_loss_type_trains_from_the_config(loss_type, tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, args=config(tmp_path, loss_type=loss_type, beta=0.5))
    assert trainer.loss_type == loss_type
    before = params_of(trainer.model)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(before) // 2, loss_type


@pytest.mark.parametrize("loss_type", [t for t in DPO_LOSS_TYPES if t != "bco_pair"])
def test_trainer_loss_is_the_pure_loss_of_its_type(loss_type, tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, args=config(tmp_path, loss_type=loss_type, beta=0.5, label_smoothing=0.1)
                          if loss_type in ("sigmoid", "robust", "exo_pair", "aot", "aot_pair") else
                          config(tmp_path, loss_type=loss_type, beta=0.5))
    batch = first_batch(trainer)
    with torch.no_grad():
        loss, _ = trainer.get_batch_loss_metrics(trainer.model, batch)
        pc, pr = trainer.concatenated_forward(trainer.model, batch)[:2]
        rc, rr = trainer.compute_reference_log_probs(batch)
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, loss_type=loss_type, label_smoothing=trainer.label_smoothing)
    torch.testing.assert_close(loss, losses.mean(), atol=0, rtol=0)


def test_label_smoothing_warns_for_a_loss_type_that_ignores_it(tokenizer, tmp_path):
    with pytest.warns(UserWarning, match="does not support label smoothing"):
        trainer_for(tokenizer, tmp_path, args=config(tmp_path, loss_type="hinge", label_smoothing=0.1))


def test_unknown_or_removed_loss_type_is_refused_by_the_config(tmp_path):
    with pytest.raises(ValueError, match="Support for kto_pair has been removed in DPOTrainer. Please use KTOTrainer"):
        config(tmp_path, loss_type="kto_pair")
    with pytest.raises(ValueError, match=r"DPOConfig.loss_type must be one of .*'apo_down'.*got 'bogus'"):
        config(tmp_path, loss_type="bogus")


def test_bco_pair_shifts_by_the_running_mean_of_batch_rewards(tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, args=config(tmp_path, loss_type="bco_pair", beta=0.5))
    batches = [first_batch(trainer), trainer.data_collator([trainer.train_dataset[i] for i in (1, 3)])]
    references = [trainer.compute_reference_log_probs(b) for b in batches]
    with torch.no_grad():  # perturb the policy so the implicit rewards are not all zero
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rewards = []
    for b, (ref_c, ref_r) in zip(batches, references):
        with torch.no_grad():
            loss, _ = trainer.get_batch_loss_metrics(trainer.model, b)
            pc, pr = trainer.concatenated_forward(trainer.model, b)[:2]
        rewards.append(bco_batch_reward(pc - ref_c, pr - ref_r, 0.5).item())
        # the running mean of the batch means so far (RunningMoments starts from a count of 1e-24)
        delta = sum(rewards) / len(rewards)
        losses, _, _ = dpo_loss(pc, pr, ref_c, ref_r, beta=0.5, loss_type="bco_pair", bco_delta=delta)
        torch.testing.assert_close(loss, losses.mean(), atol=1e-6, rtol=0)  # delta in float64 vs float32 (1 ulp)
        assert abs(trainer.running.mean - delta) < 1e-7
    assert rewards[0] != rewards[1]


# ---- RPO ---------------------------------------------------------------------------------------------------


def test_rpo_adds_alpha_times_the_chosen_token_nll(tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, args=config(tmp_path, rpo_alpha=0.5))
    plain = trainer_for(tokenizer, tmp_path)
    batch = first_batch(trainer)
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
        dpo_only, plain_metrics = plain.get_batch_loss_metrics(plain.model, batch)
        # TRL 0.11.4: CrossEntropyLoss(ignore_index=-100) over the chosen half, shifted (tokens < n predict n)
        logits = trainer.model(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
        nll = torch.nn.CrossEntropyLoss(ignore_index=-100)(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch["chosen_labels"][:, 1:].reshape(-1)
        )
    assert abs(metrics["nll_loss"] - nll.item()) < 1e-5 and "nll_loss" not in plain_metrics
    torch.testing.assert_close(loss, dpo_only + 0.5 * nll, atol=1e-5, rtol=0)  # fp32 log-softmax vs cross-entropy
    trainer.train()
    assert all(math.isfinite(e["nll_loss"]) for e in trainer.state.log_history if "loss" in e)
    assert trainer.card_hyperparameters()["rpo_alpha"] == 0.5 and "rpo_alpha" not in plain.card_hyperparameters()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_rpo_alpha_must_be_finite_and_not_negative(bad, tmp_path):
    with pytest.raises(ValueError, match="DPOConfig.rpo_alpha must be None or a finite number >= 0"):
        config(tmp_path, rpo_alpha=bad)


# ---- TR-DPO ------------------------------------------------------------------------------------------------


def test_mix_into_reference_is_alpha_policy_plus_one_minus_alpha_reference(tokenizer):
    policy, reference = tiny_causal_lm(tokenizer, seed=1), tiny_causal_lm(tokenizer, seed=2)
    expected = {n: 0.25 * p.detach() + 0.75 * reference.get_parameter(n).detach() for n, p in policy.named_parameters()}
    mix_into_reference(reference, policy, 0.25)
    for name, value in expected.items():
        torch.testing.assert_close(reference.get_parameter(name), value, atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="different parameters"):
        mix_into_reference(tiny_causal_lm(tokenizer, arch="llama"), policy, 0.5)


class Recorder(TrainerCallback):
    """One policy and one reference weight, at each step's start (reference) and end (policy, before the sync)."""

    def __init__(self, name: str):
        self.name, self.ref_at_begin, self.policy_at_end, self.trainer = name, [], [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.ref_at_begin.append(self.trainer.ref_model.get_parameter(self.name).detach().clone())

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.policy_at_end.append(model.get_parameter(self.name).detach().clone())


def test_tr_dpo_reference_follows_the_policy_every_sync_steps(tokenizer, tmp_path):
    recorder = Recorder("transformer.h.0.attn.c_attn.weight")
    args = config(tmp_path, max_steps=4, sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)
    trainer = trainer_for(tokenizer, tmp_path, args=args, callbacks=[recorder])
    recorder.trainer = trainer
    trainer.train()
    refs = recorder.ref_at_begin + [trainer.ref_model.get_parameter(recorder.name).detach()]  # before steps 1-4, end
    p2, p4 = recorder.policy_at_end[1], recorder.policy_at_end[3]
    assert torch.equal(refs[1], refs[0]) and torch.equal(refs[3], refs[2])  # no sync after steps 1 and 3
    assert torch.equal(refs[2], refs[0].clone().mul_(0.5).add_(p2, alpha=0.5))  # after step 2 (TRL's arithmetic)
    assert torch.equal(refs[4], refs[2].clone().mul_(0.5).add_(p4, alpha=0.5))  # after step 4
    assert not torch.equal(refs[4], refs[0])


def test_tr_dpo_refusals(tokenizer, tmp_path):
    from peft import LoraConfig

    sync = dict(sync_ref_model=True, ref_model_sync_steps=1)
    with pytest.raises(ValueError, match="precompute_ref_log_probs=True` with TR-DPO"):
        trainer_for(tokenizer, tmp_path, args=config(tmp_path, precompute_ref_log_probs=True, **sync))
    with pytest.raises(ValueError, match="cannot use `ref_model=None` with TR-DPO"):
        trainer_for(tokenizer, tmp_path, args=config(tmp_path, **sync), peft_config=LoraConfig(**LORA))
    with pytest.raises(ValueError, match="cannot use `ref_model=None` with TR-DPO"):
        trainer_for(tokenizer, tmp_path, args=config(tmp_path, reference_free=True, **sync))
    with pytest.raises(ValueError, match="sync_ref_model=True with a PEFT policy"):
        trainer_for(tokenizer, tmp_path, args=config(tmp_path, force_use_ref_model=True, **sync),
                    ref_model=tiny_causal_lm(tokenizer), peft_config=LoraConfig(**LORA))
    with pytest.raises(ValueError, match="ref_model_mixup_alpha must be in"):
        config(tmp_path, sync_ref_model=True, ref_model_mixup_alpha=1.5)
    with pytest.raises(ValueError, match="ref_model_sync_steps must be an integer >= 1"):
        config(tmp_path, sync_ref_model=True, ref_model_sync_steps=0)


def test_resume_restores_the_synced_reference_and_the_bco_running_mean(tokenizer, tmp_path):
    args = config(tmp_path / "a", loss_type="bco_pair", sync_ref_model=True, ref_model_sync_steps=1)
    first = trainer_for(tokenizer, tmp_path, args=args)
    first.train()
    first.save_state(tmp_path / "ckpt")
    again = trainer_for(tokenizer, tmp_path, args=config(tmp_path / "b", loss_type="bco_pair", sync_ref_model=True,
                                                          ref_model_sync_steps=1))
    assert again.running.mean == 0.0
    again.load_state(tmp_path / "ckpt")
    again.train()  # at max_steps already: restores the state, takes no step
    assert again.state.global_step == 2
    assert again.running.state_dict() == first.running.state_dict()
    for name, value in first.ref_model.named_parameters():
        assert torch.equal(again.ref_model.get_parameter(name), value), name


# ---- PEFT: force_use_ref_model, a PeftModel given with peft_config --------------------------------------------


def test_force_use_ref_model_uses_the_given_reference_beside_lora(tokenizer, tmp_path):
    from peft import LoraConfig

    reference = tiny_causal_lm(tokenizer, seed=7)  # not the policy's weights: its log-probs tell which one is used
    with pytest.raises(ValueError, match="You passed both a ref_model and a peft_config"):
        trainer_for(tokenizer, tmp_path, ref_model=reference, peft_config=LoraConfig(**LORA))
    trainer = trainer_for(tokenizer, tmp_path, args=config(tmp_path, force_use_ref_model=True),
                          ref_model=reference, peft_config=LoraConfig(**LORA))
    assert trainer.ref_model is reference and not trainer.use_peft_reference
    batch = first_batch(trainer)
    ref_chosen, _ = trainer.compute_reference_log_probs(batch)
    with torch.no_grad():
        logits = reference(input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]).logits
    torch.testing.assert_close(ref_chosen, response_logprobs(logits, batch["chosen_labels"]), atol=1e-5, rtol=1e-5)
    before = params_of(reference)
    trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in reference.named_parameters())


def test_force_use_ref_model_as_a_trainer_keyword(tokenizer, tmp_path):
    from peft import LoraConfig

    trainer = trainer_for(tokenizer, tmp_path, ref_model=tiny_causal_lm(tokenizer), peft_config=LoraConfig(**LORA),
                          force_use_ref_model=True)
    assert trainer.ref_model is not None and not trainer.use_peft_reference


def test_a_peft_model_with_peft_config_is_merged_then_trained_and_saved(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    tiny_causal_lm(tokenizer).save_pretrained(base_dir)  # the adapter's base_model_name_or_path: loadable offline
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(**LORA))
    with torch.no_grad():  # a trained-looking first adapter, so merging it changes the base weights
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn_like(p))
    merged = copy.deepcopy(peft_model).merge_and_unload()
    trainer = trainer_for(tokenizer, tmp_path, model=peft_model, args=config(tmp_path, precompute_ref_log_probs=True),
                          peft_config=LoraConfig(**LORA))
    base = trainer.model.get_base_model()
    for name, p in merged.named_parameters():  # the new adapter sits on the merged weights
        assert torch.equal(base.get_parameter(name.replace("c_attn.weight", "c_attn.base_layer.weight")), p), name
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # TRL's test_dpo_lora_save: loads, no OSError
    assert loaded.config.n_embd == merged.config.n_embd


# ---- refusals TRL makes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [{}, {"dataset_num_proc": 2}])
def test_a_tokenizer_without_pad_token_is_refused_with_trls_words(extra, tokenizer, tmp_path):
    # as TRL 0.11.4: the trainer builds (tests that never train construct one so), the first batch is refused
    no_pad = copy.deepcopy(tokenizer)
    no_pad.pad_token = None
    model = tiny_causal_lm(tokenizer)
    trainer = DPOTrainer(model=model, args=config(tmp_path, **extra), tokenizer=no_pad,
                         train_dataset=Dataset.from_dict(ROWS))
    before = params_of(model)
    with pytest.raises(ValueError, match=r"Padding is enabled, but the tokenizer is not configured with a padding "
                                         r"token. Explicitly set `tokenizer.pad_token` \(e.g. `tokenizer.pad_token = "
                                         r"tokenizer.eos_token`\) before calling the trainer."):
        trainer.train()
    assert trainer.state.global_step == 0 and all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with_padding = DPOTrainer(model=tiny_causal_lm(tokenizer), args=config(tmp_path, padding_value=0), tokenizer=no_pad,
                              train_dataset=Dataset.from_dict(ROWS))
    with_padding.train()  # an explicit padding_value needs no pad token
    assert with_padding.state.global_step == 2


def test_dataset_num_proc_tokenises_in_processes_to_the_same_rows(tokenizer, tmp_path):
    serial = trainer_for(tokenizer, tmp_path)
    parallel = trainer_for(tokenizer, tmp_path, args=config(tmp_path, dataset_num_proc=2))
    assert parallel.dataset_num_proc == 2
    assert parallel.train_dataset.to_list() == serial.train_dataset.to_list()


# ---- encoder-decoder (T5) ----------------------------------------------------------------------------------


def test_encoder_decoder_dpo_trains_on_a_tiny_t5(tokenizer, tmp_path):
    model = tiny_seq2seq_lm(tokenizer)
    trainer = trainer_for(tokenizer, tmp_path, model=model, args=config(tmp_path, max_steps=3, rpo_alpha=1.0))
    assert trainer.is_encoder_decoder and trainer.max_completion_length == 128
    row = trainer.train_dataset[0]
    assert row["prompt_input_ids"] == tokenizer(ROWS["prompt"][0])["input_ids"]
    assert row["chosen_labels"] == tokenizer(ROWS["chosen"][0])["input_ids"]  # the decoder's targets
    batch = first_batch(trainer)
    with torch.no_grad():  # each response's log-prob: decoder logits gathered at its labels, no causal shift
        pc, pr, chosen_logits, _, nll = trainer.concatenated_forward(trainer.model, batch)
        for side, got in (("chosen", pc), ("rejected", pr)):
            labels = batch[f"{side}_labels"]  # (B, L), -100 padded
            logits = model(input_ids=batch["prompt_input_ids"], attention_mask=batch["prompt_attention_mask"],
                           labels=labels).logits
            logp = logits.log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            torch.testing.assert_close(got, (logp * (labels != -100)).sum(-1), atol=1e-5, rtol=1e-5)
    widest = max(batch["chosen_labels"].shape[1], batch["rejected_labels"].shape[1])
    assert chosen_logits.shape[:2] == (4, widest)  # one decoder position per (padded) label
    before, ref_before = params_of(trainer.model), params_of(trainer.ref_model)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    # step 1: policy == reference, so the DPO part is log 2 and the rest the chosen NLL (rpo_alpha 1)
    assert abs(logs[0]["loss"] - (math.log(2) + logs[0]["nll_loss"])) < 1e-4
    assert logs[-1]["rewards/margins"] > 0
    assert sum(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()) > len(before) // 2
    assert all(torch.equal(p, ref_before[n]) for n, p in trainer.ref_model.named_parameters())


def test_encoder_decoder_precomputed_reference_matches_live(tokenizer, tmp_path):
    trainer = trainer_for(tokenizer, tmp_path, model=tiny_seq2seq_lm(tokenizer),
                          args=config(tmp_path, precompute_ref_log_probs=True, max_completion_length=3))
    batch = first_batch(trainer)
    assert max(len(r) for r in trainer.train_dataset["rejected_labels"]) <= 3  # cut to max_completion_length
    live_chosen, live_rejected = trainer.compute_reference_log_probs(batch)
    torch.testing.assert_close(batch["reference_chosen_logps"], live_chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch["reference_rejected_logps"], live_rejected, atol=1e-5, rtol=1e-5)
    trainer.train()
    assert trainer.state.global_step == 2


def test_max_target_length_is_the_deprecated_max_completion_length(tmp_path):
    with pytest.warns(FutureWarning, match="max_target_length"):
        args = config(tmp_path, max_target_length=7)
    assert args.max_completion_length == 7
