"""KTOTrainer and KTOConfig: TRL 1.16's contract, data preparation, padding-exact log-probs, training, guards,
resume after SIGKILL, and (about a second, so not marked slow) the desirable completions gaining log-prob over the undesirable ones."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from rlhf_core import KTOConfig, KTOTrainer
from rlhf_core.losses import kto_loss
from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers.preference.kto import (
    DataCollatorForUnpairedPreference,
    add_kl_completions,
    completion_logps,
    prepare_kto_dataset,
    tokenize_kto_row,
    unpair_rows,
    weight_advice,
)

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "prompt": ["The film was", "This morning I", "The story is", "The music was"],
    "completion": [" great and warm", " hated it and the pacing", " lovely", " awful"],
    "label": [True, False, True, False],
}
PAIRS = {
    "prompt": ["The film was", "The music was"],
    "chosen": [" great", " wonderful"],
    "rejected": [" terrible", " awful and dull"],
}
METRIC_KEYS = ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy")

# TRL 1.16.0's KTOConfig: every KTO-specific field and its default (read from trl/trainer/kto_config.py)
TRL_KTO_FIELDS = {
    "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": None, "disable_dropout": True,
    "dataset_num_proc": None, "max_length": 1024, "pad_to_multiple_of": "auto", "precompute_ref_log_probs": False,
    "precompute_ref_batch_size": None, "loss_type": "kto", "beta": 0.1, "desirable_weight": 1.0,
    "undesirable_weight": 1.0, "activation_offloading": False, "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6, "ref_model_sync_steps": 512, "logging_steps": 10,
    "train_sampling_strategy": "sequential",
}
# defaults that differ on purpose (TRL's assume a GPU); each is documented in the field's docstring
CPU_DEVIATIONS = {"learning_rate": (1e-6, 5e-5), "bf16": (True, False), "gradient_checkpointing": (True, False)}


def config(tmp_path, **overrides) -> KTOConfig:
    kwargs = dict(output_dir=str(tmp_path / "kto"), max_steps=3, per_device_train_batch_size=4,
                  per_device_eval_batch_size=4, learning_rate=5e-3, report_to="none", use_cpu=True,
                  save_strategy="no", logging_steps=1, disable_tqdm=True, max_length=32)
    kwargs.update(overrides)
    return KTOConfig(**kwargs)


def make_trainer(tokenizer, tmp_path, rows=ROWS, model=None, **kwargs) -> KTOTrainer:
    kwargs.setdefault("args", config(tmp_path))
    return KTOTrainer(model=model if model is not None else tiny_causal_lm(tokenizer, seed=0),
                      train_dataset=Dataset.from_dict(rows), eval_dataset=Dataset.from_dict(rows),
                      processing_class=tokenizer, **kwargs)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---- config ----------------------------------------------------------------------------------


def test_config_has_trl_1_16_fields_and_defaults(tmp_path):
    cfg = KTOConfig(output_dir=str(tmp_path))
    for name, default in TRL_KTO_FIELDS.items():
        want = None if name == "pad_to_multiple_of" else default  # "auto" resolves to None off Neuron
        assert getattr(cfg, name) == want, name
    for name, (_trl, ours) in CPU_DEVIATIONS.items():
        assert getattr(cfg, name) == ours, name
    fields = {f.name for f in dataclasses.fields(KTOConfig)}
    assert set(TRL_KTO_FIELDS) <= fields


@pytest.mark.parametrize("overrides, match", [
    ({"loss_type": "sigmoid"}, "loss_type"),
    ({"beta": 0.0}, "beta"),
    ({"desirable_weight": -1.0}, "desirable_weight"),
    ({"train_sampling_strategy": "random"}, "train_sampling_strategy"),
    ({"per_device_train_batch_size": 1}, "per_device_train_batch_size"),
    ({"pad_to_multiple_of": "0"}, "pad_to_multiple_of"),
])
def test_config_rejects_bad_values_naming_the_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        KTOConfig(output_dir=str(tmp_path), **overrides)


def test_config_accepts_random_sampling_and_batch_one_without_a_kl_term(tmp_path):
    cfg = KTOConfig(output_dir=str(tmp_path), loss_type="apo_zero_unpaired", train_sampling_strategy="random",
                    per_device_train_batch_size=1, pad_to_multiple_of="8")
    assert cfg.pad_to_multiple_of == 8


@pytest.mark.parametrize("field", ["sync_ref_model", "activation_offloading"])
def test_config_rejects_unsupported_switches(tmp_path, field):
    with pytest.raises(NotImplementedError, match=field):
        KTOConfig(output_dir=str(tmp_path), **{field: True})


# ---- data ------------------------------------------------------------------------------------


def test_unpair_rows_puts_chosen_then_rejected_and_repeats_other_columns():
    out = unpair_rows({"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", "r2"], "id": [1, 2]})
    assert out == {"completion": ["c1", "c2", "r1", "r2"], "label": [True, True, False, False],
                   "prompt": ["p1", "p2", "p1", "p2"], "id": [1, 2, 1, 2]}


def test_kl_completions_rotate_by_one_within_the_batch():
    assert add_kl_completions({"completion_ids": [[1], [2, 2], [3]]}) == {"KL_completion_ids": [[3], [1], [2, 2]]}


def test_tokenize_plain_row_appends_eos_once(tokenizer):
    row = tokenize_kto_row({"prompt": "The film was", "completion": " great"}, tokenizer)
    assert row["prompt_ids"] == tokenizer("The film was")["input_ids"]
    assert row["prompt_ids"] + row["completion_ids"] == tokenizer("The film was great" + tokenizer.eos_token)["input_ids"]
    assert row["completion_ids"][-1] == tokenizer.eos_token_id
    again = tokenize_kto_row({"prompt": "The film was", "completion": " great" + tokenizer.eos_token}, tokenizer)
    assert again == row


def test_tokenize_conversational_row_uses_the_chat_template(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    prompt = [{"role": "user", "content": "The film was"}]
    completion = [{"role": "assistant", "content": "great"}]
    row = tokenize_kto_row({"prompt": prompt, "completion": completion}, chat)
    full = chat("user: The film was\nassistant: great\n")["input_ids"]
    assert row["prompt_ids"] + row["completion_ids"] == full
    assert chat.decode(row["prompt_ids"]).startswith("user: The film was")
    assert "great" in chat.decode(row["completion_ids"])


def test_prepare_unpairs_pairs_drops_long_prompts_and_adds_kl(tokenizer):
    data = prepare_kto_dataset(Dataset.from_dict(PAIRS), tokenizer, max_length=1024, kl_batch_size=2)
    assert data["label"] == [True, True, False, False]
    assert data["completion"][:2] == [" great", " wonderful"]
    assert data["KL_completion_ids"][0] == data["completion_ids"][1]  # batch [0, 1]: rotated
    assert data["KL_completion_ids"][2] == data["completion_ids"][3]  # batch [2, 3]
    short = len(tokenizer("The film was")["input_ids"])
    kept = prepare_kto_dataset(Dataset.from_dict(ROWS), tokenizer, max_length=short, kl_batch_size=None)
    assert "The film was" not in kept["prompt"] and "KL_completion_ids" not in kept.column_names


def test_prepare_names_missing_columns_and_non_bool_labels(tokenizer):
    with pytest.raises(ValueError, match="'completion' and 'label'"):
        prepare_kto_dataset(Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}), tokenizer, 32, 2)
    with pytest.raises(ValueError, match="'label' must hold bools"):
        prepare_kto_dataset(Dataset.from_dict({"prompt": ["a"], "completion": ["b"], "label": [1]}), tokenizer, 32, 2)


def test_collator_pads_right_and_marks_completions():
    collate = DataCollatorForUnpairedPreference(pad_token_id=0)
    batch = collate([
        {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "KL_completion_ids": [6], "label": True, "ref_logps": -1.5},
        {"prompt_ids": [7, 8], "completion_ids": [9], "KL_completion_ids": [10, 11], "label": False, "ref_logps": -2.0},
    ])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert batch["KL_input_ids"].tolist() == [[1, 2, 3, 6], [7, 8, 10, 11]]
    assert batch["KL_completion_mask"].tolist() == [[0, 0, 0, 1], [0, 0, 1, 1]]
    assert batch["label"].tolist() == [True, False] and batch["ref_logps"].tolist() == [-1.5, -2.0]
    cut = DataCollatorForUnpairedPreference(pad_token_id=0, max_length=4, pad_to_multiple_of=3)(
        [{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "label": True}])
    assert cut["input_ids"].tolist() == [[1, 2, 3, 4, 0, 0]] and cut["completion_mask"].tolist() == [[0, 0, 0, 1, 0, 0]]


def test_weight_advice_follows_trl_rule_of_thumb():
    assert weight_advice([True, False], 1.0, 1.0) is None  # balanced
    assert "desirable_weight in [3.00, 3.99]" in weight_advice([True] + [False] * 3, 1.0, 1.0)
    assert weight_advice([True] + [False] * 3, 3.5, 1.0) is None


# ---- log-probs: padding must not change a row's result ---------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_completion_logps_of_a_padded_batch_equal_each_row_alone(tokenizer, arch, side):
    model = tiny_causal_lm(tokenizer, arch=arch, seed=0).eval()
    rows = [([5, 6, 7, 8], [9, 10]), ([11], [12, 13, 14]), ([15, 16], [17])]  # prompts of different lengths
    alone = []
    for prompt, completion in rows:
        ids = torch.tensor([prompt + completion])
        mask = torch.ones_like(ids)
        marks = torch.tensor([[0] * len(prompt) + [1] * len(completion)])
        alone.append(completion_logps(model, ids, mask, marks)[0])
    width = max(len(p) + len(c) for p, c in rows)
    ids, masks, marks = [], [], []
    for prompt, completion in rows:
        pad = width - len(prompt) - len(completion)
        seq, mask, mark = prompt + completion, [1] * (width - pad), [0] * len(prompt) + [1] * len(completion)
        if side == "left":
            ids.append([0] * pad + seq); masks.append([0] * pad + mask); marks.append([0] * pad + mark)
        else:
            ids.append(seq + [0] * pad); masks.append(mask + [0] * pad); marks.append(mark + [0] * pad)
    with torch.no_grad():
        batched = completion_logps(model, torch.tensor(ids), torch.tensor(masks), torch.tensor(marks))[0]
    torch.testing.assert_close(batched, torch.cat(alone).detach(), rtol=1e-5, atol=1e-5)


# ---- training --------------------------------------------------------------------------------


def test_training_logs_finite_trl_metrics_changes_weights_and_keeps_the_reference(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    policy_before, ref_before = state(trainer.model), state(trainer.ref_model)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        for key in (*METRIC_KEYS, "loss", "skipped_updates"):
            assert key in entry and math.isfinite(entry[key]), key
    assert logs[0]["loss"] == pytest.approx(0.5)  # policy == reference at step 0: r = 0, z0 = 0 -> 1 - sigmoid(0)
    assert logs[0]["kl"] == 0.0 and logs[-1]["rewards/margins"] > 0
    assert any(not torch.equal(policy_before[k], v) for k, v in state(trainer.model).items())
    assert all(torch.equal(ref_before[k], v) for k, v in state(trainer.ref_model).items())
    metrics = trainer.evaluate()
    assert all(math.isfinite(metrics[f"eval_{key}"]) for key in METRIC_KEYS)


def test_the_batch_loss_is_kto_loss_of_fresh_log_probs(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=config(tmp_path, beta=0.5, desirable_weight=1.5))
    with torch.no_grad():  # make the policy differ from the reference
        for param in trainer.model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    with torch.no_grad():
        policy = completion_logps(trainer.model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
        ref = completion_logps(trainer.ref_model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
        kl_args = (batch["KL_input_ids"], batch["KL_attention_mask"], batch["KL_completion_mask"])
        z0 = (completion_logps(trainer.model, *kl_args)[0] - completion_logps(trainer.ref_model, *kl_args)[0]).mean()
    z0 = max(float(z0), 0.0)
    want, _ = kto_loss(policy, ref, batch["label"], z0, beta=0.5, desirable_weight=1.5)
    assert float(loss.detach()) == pytest.approx(float(want.mean()), rel=1e-5)
    assert metrics["kl"] == pytest.approx(z0, abs=1e-6)


def test_paired_data_is_unpaired(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, rows=PAIRS)
    assert trainer.train_dataset["label"] == [True, True, False, False]
    trainer.train()
    assert trainer.state.global_step == 3


def test_precomputed_reference_needs_no_reference_model(tokenizer, tmp_path):
    model = tiny_causal_lm(tokenizer, seed=0)
    copy_before = copy.deepcopy(model)
    trainer = make_trainer(tokenizer, tmp_path, model=model, args=config(tmp_path, precompute_ref_log_probs=True))
    assert trainer.ref_model is None
    assert {"ref_logps", "ref_KL_logps"} <= set(trainer.train_dataset.column_names)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        want = completion_logps(copy_before.eval(), batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
    torch.testing.assert_close(batch["ref_logps"], want, rtol=1e-5, atol=1e-5)
    trainer.train()
    assert math.isfinite(trainer.evaluate()["eval_loss"])


def test_peft_policy_uses_its_disabled_adapter_as_reference(tokenizer, tmp_path):
    from peft import LoraConfig

    base_model = tiny_causal_lm(tokenizer, seed=0)
    base_before = state(base_model)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], task_type="CAUSAL_LM", fan_in_fan_out=True)
    trainer = make_trainer(tokenizer, tmp_path, model=base_model, peft_config=lora)
    assert trainer.ref_model is None and trainer.use_peft_reference
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logs[0]["loss"] == pytest.approx(0.5) and logs[-1]["rewards/margins"] != 0.0  # adapter moved
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    reference, _ = trainer.compute_ref_log_probs(batch)
    with torch.no_grad():
        plain = tiny_causal_lm(tokenizer, seed=0).eval()
        want = completion_logps(plain, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
    torch.testing.assert_close(reference, want, rtol=1e-5, atol=1e-5)
    unwrapped = trainer.model.get_base_model().state_dict()
    for key, value in base_before.items():  # the frozen base weights did not move
        peft_key = key.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        got = unwrapped.get(key, unwrapped.get(peft_key))
        assert got is None or torch.equal(got, value), key


def test_apo_zero_unpaired_runs_without_kl_completions(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=config(tmp_path, loss_type="apo_zero_unpaired"))
    assert "KL_completion_ids" not in trainer.train_dataset.column_names
    trainer.train()
    assert all(entry.get("kl", 0.0) == 0.0 for entry in trainer.state.log_history)


def test_dropout_is_off_in_policy_and_reference(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, model=tiny_causal_lm(tokenizer, dropout=0.5, seed=0))
    for model in (trainer.model, trainer.ref_model):
        assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_reference_forwards_are_deterministic_even_with_dropout_kept(tokenizer, tmp_path):
    # disable_dropout=False and the policy itself as the (precomputed) reference: still eval mode for the reference
    trainer = make_trainer(tokenizer, tmp_path, model=tiny_causal_lm(tokenizer, dropout=0.5, seed=0),
                           args=config(tmp_path, disable_dropout=False, precompute_ref_log_probs=True))
    trainer.model.train()
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(4)]))
    first, second = trainer.compute_ref_log_probs(batch)[0], trainer.compute_ref_log_probs(batch)[0]
    assert torch.equal(first, second) and torch.allclose(first, batch["ref_logps"])
    assert trainer.model.training  # mode restored


def test_errors_name_the_argument(tokenizer, tmp_path):
    model = tiny_causal_lm(tokenizer, seed=0)
    with pytest.raises(ValueError, match="train_dataset"):
        KTOTrainer(model=model, args=config(tmp_path), processing_class=tokenizer)
    with pytest.raises(TypeError, match="KTOConfig"):
        from transformers import TrainingArguments

        KTOTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path)), processing_class=tokenizer,
                   train_dataset=Dataset.from_dict(ROWS))
    with pytest.raises(ValueError, match="ref_model is model"):
        make_trainer(tokenizer, tmp_path, model=model, ref_model=model)


def test_nonfinite_gradients_skip_the_step(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, args=config(tmp_path, max_steps=2))
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda grad: grad * float("inf"))
    before = state(trainer.model)
    with pytest.warns(UserWarning, match="non-finite gradients"):
        trainer.train()
    assert all(torch.equal(before[k], v) for k, v in state(trainer.model).items())
    assert [e["skipped_updates"] for e in trainer.state.log_history if "loss" in e] == [1.0, 2.0]


def test_sigterm_saves_a_checkpoint_and_stops(tokenizer, tmp_path):
    import signal

    from rlhf_core import checkpointing as ckpt
    from rlhf_core.trainers.base import GracefulStopCallback

    class SigtermAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    with ckpt.GracefulStop() as stop:
        guard = GracefulStopCallback(stop)
        trainer = make_trainer(tokenizer, tmp_path, args=config(tmp_path, max_steps=5),
                               callbacks=[guard, SigtermAtStep2()])
        trainer.train()
    assert guard.stopped and trainer.state.global_step == 3
    assert (tmp_path / "kto" / "checkpoint-3" / "trainer_state.json").is_file()


TRL_SCRIPT = textwrap.dedent(
    """
    # A TRL 1.16 KTO script; only the import line differs.
    import sys
    from datasets import Dataset
    from rlhf_core import KTOConfig, KTOTrainer

    model_dir, out = sys.argv[1], sys.argv[2]
    train_dataset = Dataset.from_dict({
        "prompt": ["The film was", "This morning I", "The story is", "The music was"],
        "completion": [" great and warm", " hated it", " lovely", " awful"],
        "label": [True, False, True, False],
    })
    training_args = KTOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
                              beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, use_cpu=True)
    trainer = KTOTrainer(model=model_dir, args=training_args, train_dataset=train_dataset)
    trainer.train()
    trainer.save_model(out)
    print("LOSS", trainer.state.log_history[0]["loss"])
    """
)


def test_a_trl_1_16_kto_script_runs_unchanged(tokenizer, tmp_path):
    model_dir = tmp_path / "tiny"
    tiny_causal_lm(tokenizer, seed=0).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    script = tmp_path / "kto_script.py"
    script.write_text(TRL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOSS 0.5" in proc.stdout  # step 1: policy == reference
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---- resume ----------------------------------------------------------------------------------

RESUME_SCRIPT = textwrap.dedent(
    r"""
    import json, os, signal, sys
    import torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from datasets import Dataset
    from safetensors.torch import save_file
    from transformers import TrainerCallback
    from rlhf_core import KTOConfig, KTOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    mode, out, n_steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    tok = build_tokenizer()
    ROWS = {"prompt": ["The film was", "This morning I", "The story is", "The music was", "The cast was",
                       "The script is"],
            "completion": [" great and warm", " hated it", " lovely", " awful", " excellent", " a mess"],
            "label": [True, False, True, False, True, False]}

    class KillAfterSave(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    def trainer(run_dir, callbacks=()):
        args = KTOConfig(output_dir=run_dir, max_steps=n_steps, per_device_train_batch_size=2, learning_rate=5e-3,
                         seed=3, use_cpu=True, report_to="none", save_strategy="steps", save_steps=kill_at,
                         logging_steps=1, disable_tqdm=True, max_length=32, lr_scheduler_type="linear")
        return KTOTrainer(model=tiny_causal_lm(tok, seed=0), args=args, train_dataset=Dataset.from_dict(ROWS),
                          processing_class=tok, callbacks=list(callbacks))

    def logs(t):
        return [{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
                for e in t.state.log_history if "loss" in e]

    def weights(t, name):
        model = t.accelerator.unwrap_model(t.model)
        seen, unique = set(), {}
        for k, v in model.state_dict().items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr()); unique[k] = v.detach().clone().contiguous()
        save_file(unique, os.path.join(out, name))

    if mode == "first":
        trainer(os.path.join(out, "run"), [KillAfterSave()]).train()
    else:
        straight = trainer(os.path.join(out, "straight"))
        straight.train()
        weights(straight, "straight.safetensors")
        resumed = trainer(os.path.join(out, "run"))
        resumed.load_state(os.path.join(out, "run", f"checkpoint-{kill_at}"))
        resumed.train()
        weights(resumed, "resumed.safetensors")
        json.dump({"straight": logs(straight), "resumed": logs(resumed), "step": resumed.state.global_step},
                  open(os.path.join(out, "kto.json"), "w"))
    """
)


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "resume.py"
    script.write_text(RESUME_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    n_steps, kill_at = 5, 2  # 6 rows / batch 2 = 3 steps per epoch: the resume lands mid-epoch, then a new epoch
    run = lambda mode: subprocess.run(  # noqa: E731
        [sys.executable, str(script), mode, str(tmp_path), str(n_steps), str(kill_at)], env=env, capture_output=True,
        text=True, timeout=300)
    first = run("first")
    assert first.returncode == -9, first.stderr[-3000:]  # killed right after the checkpoint was written
    second = run("second")
    assert second.returncode == 0, second.stderr[-3000:]
    straight, resumed = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("straight", "resumed"))
    assert set(straight) == set(resumed)
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    result = json.loads((tmp_path / "kto.json").read_text())
    assert result["step"] == n_steps and len(result["straight"]) == n_steps
    # the resumed history (the checkpoint's steps, then its own) equals the straight one: loss and KTO metrics
    assert result["resumed"] == result["straight"]


# ---- does it learn? ----------------------------------------------------------------------------


def test_desirable_completions_gain_log_prob_over_undesirable_ones(tokenizer, tmp_path):
    rows = {
        "prompt": ["The film was", "The music was", "The story is", "The cast was"] * 2,
        "completion": [" great", " wonderful", " lovely", " excellent", " awful", " terrible", " boring", " bad"],
        "label": [True] * 4 + [False] * 4,
    }
    # interleave so every batch of 4 holds both labels
    order = [0, 4, 1, 5, 2, 6, 3, 7]
    rows = {k: [v[i] for i in order] for k, v in rows.items()}
    trainer = make_trainer(tokenizer, tmp_path, rows=rows,
                           args=config(tmp_path, max_steps=40, learning_rate=3e-3, beta=0.5, logging_steps=5))
    batch = trainer._prepare_inputs(trainer.data_collator([trainer.train_dataset[i] for i in range(8)]))

    def gap(model) -> float:
        with torch.no_grad():
            logps = completion_logps(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"])[0]
        labels = batch["label"]
        return float(logps[labels].mean() - logps[~labels].mean())

    before = gap(trainer.model)
    trainer.train()
    after = gap(trainer.model)
    assert after > before + 1.0, (before, after)
    assert gap(trainer.ref_model) == pytest.approx(before)
