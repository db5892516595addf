"""Value-head wrappers: forward shapes and dtypes, head options, TRL-layout checkpoints, PEFT policies."""

from __future__ import annotations

import copy
import json
import os
import pickle

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, OPTConfig, PretrainedConfig, T5Config

from rlhf_core.models import value_head
from rlhf_core.models.tiny import tiny_causal_lm, tiny_seq2seq_lm
from rlhf_core.models.value_head import (
    V_HEAD_FILE,
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    ValueHead,
    hidden_size_from_config,
    init_value_head,
    load_v_head_state,
)

CausalVH = AutoModelForCausalLMWithValueHead
Seq2SeqVH = AutoModelForSeq2SeqLMWithValueHead
IDS = torch.tensor([[5, 9, 17, 33, 2], [7, 8, 40, 41, 3]])  # (B=2, T=5)
MASK = torch.ones_like(IDS)


def _policy(tokenizer, arch: str = "gpt2", **head_kwargs) -> CausalVH:
    """A tiny causal policy in eval mode (value-head dropout off) so outputs are deterministic."""
    return CausalVH.from_pretrained(tiny_causal_lm(tokenizer, arch=arch), **head_kwargs).eval()


def _outputs(model: CausalVH) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_logits, value) on the fixed batch, without gradients."""
    with torch.no_grad():
        logits, _, value = model(IDS, attention_mask=MASK)
    return logits, value


def _randomise_v_head(model, seed: int = 3) -> None:
    """Give the value head distinctive values so a round trip cannot pass by accident."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.v_head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))


def _assert_same_state(a, b) -> None:
    """Both wrappers hold exactly the same tensors under the same keys."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# ---- forward -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_causal_forward_shapes_and_dtypes(tokenizer, arch):
    model = _policy(tokenizer, arch)
    logits, loss, value = model(IDS, attention_mask=MASK)
    assert logits.shape == (2, 5, len(tokenizer)) and logits.dtype == torch.float32
    assert value.shape == (2, 5) and value.dtype == torch.float32
    assert loss is None


def test_seq2seq_forward_uses_decoder_hidden_state(tokenizer):
    model = Seq2SeqVH.from_pretrained(tiny_seq2seq_lm(tokenizer)).eval()
    decoder_ids = IDS[:, :3]  # (B=2, T_dec=3)
    logits, _, value = model(IDS, attention_mask=MASK, decoder_input_ids=decoder_ids)
    assert model.is_encoder_decoder
    assert logits.shape == (2, 3, len(tokenizer)) and value.shape == (2, 3)
    out = model.pretrained_model(IDS, attention_mask=MASK, decoder_input_ids=decoder_ids, output_hidden_states=True)
    expected = out.decoder_hidden_states[-1] @ model.v_head.summary.weight.T + model.v_head.summary.bias
    torch.testing.assert_close(value, expected.squeeze(-1))


def test_value_is_linear_map_of_last_hidden_state(tokenizer):
    model = _policy(tokenizer)
    _, value = _outputs(model)
    with torch.no_grad():
        hidden = model.pretrained_model(IDS, attention_mask=MASK, output_hidden_states=True).hidden_states[-1]
        expected = hidden @ model.v_head.summary.weight.T + model.v_head.summary.bias  # (B, T, 1)
    torch.testing.assert_close(value, expected.squeeze(-1))


def test_loss_and_position_ids_pass_through(tokenizer):
    model = _policy(tokenizer)
    position_ids = torch.arange(5).expand(2, 5) + 3
    _, loss, _ = model(IDS, attention_mask=MASK, labels=IDS, position_ids=position_ids)
    ref = model.pretrained_model(IDS, attention_mask=MASK, labels=IDS, position_ids=position_ids)
    torch.testing.assert_close(loss, ref.loss)


def test_past_key_values_continue_the_sequence(tokenizer):
    model = _policy(tokenizer)
    full_logits, _, full_value = model(IDS)
    out = model(IDS[:, :4], return_past_key_values=True)
    assert len(out) == 4
    step_logits, _, step_value = model(IDS[:, 4:], past_key_values=out[3])
    torch.testing.assert_close(step_logits[:, 0], full_logits[:, 4])
    torch.testing.assert_close(step_value[:, 0], full_value[:, 4])


def test_bfloat16_model_still_gives_fp32_logits_and_values(tokenizer):
    model = CausalVH.from_pretrained(tiny_causal_lm(tokenizer).to(torch.bfloat16)).eval()
    logits, value = _outputs(model)
    assert logits.dtype == torch.float32 and value.dtype == torch.float32
    model.to(torch.bfloat16)  # a head cast to bf16 as well still returns fp32 values
    logits, value = _outputs(model)
    assert model.v_head.summary.weight.dtype == torch.bfloat16
    assert logits.dtype == torch.float32 and value.dtype == torch.float32


def test_generate_delegates_to_transformer(tokenizer):
    model = _policy(tokenizer)
    kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    out = model.generate(IDS[:1], **kwargs)
    assert torch.equal(out, model.pretrained_model.generate(IDS[:1], **kwargs))
    assert out.shape == (1, 9)


def test_gradient_checkpointing_enable_delegates(tokenizer):
    model = _policy(tokenizer)
    model.gradient_checkpointing_enable()
    assert model.pretrained_model.is_gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not model.pretrained_model.is_gradient_checkpointing


# ---- head options ------------------------------------------------------------------------------


def test_hidden_size_from_usual_config_names():
    assert hidden_size_from_config(GPT2Config(n_embd=24, n_head=4)) == 24
    assert hidden_size_from_config(T5Config(d_model=16)) == 16
    assert hidden_size_from_config(OPTConfig(hidden_size=16, word_embed_proj_dim=8)) == 8
    with pytest.raises(ValueError, match="hidden size"):
        hidden_size_from_config(PretrainedConfig())


def test_summary_dropout_prob(tokenizer):
    assert isinstance(_policy(tokenizer, summary_dropout_prob=0).v_head.dropout, torch.nn.Identity)
    assert isinstance(_policy(tokenizer, summary_dropout_prob=None).v_head.dropout, torch.nn.Identity)
    dropout = _policy(tokenizer, summary_dropout_prob=0.3).v_head.dropout
    assert isinstance(dropout, torch.nn.Dropout) and dropout.p == 0.3
    assert _policy(tokenizer).v_head.dropout.p == 0.1  # default
    config = GPT2Config(n_embd=8, n_head=2)
    config.summary_dropout_prob = 0.2
    assert ValueHead(config).dropout.p == 0.2  # config attribute beats the default
    assert ValueHead(config, summary_dropout_prob=0.4).dropout.p == 0.4  # explicit beats config


def test_normal_init_draws_from_given_std():
    head = ValueHead(GPT2Config(n_embd=64, n_head=4))
    torch.manual_seed(0)
    init_value_head(head, "normal", 0.5)
    torch.manual_seed(0)
    expected = torch.empty(1, 64).normal_(mean=0.0, std=0.5)
    assert torch.equal(head.summary.weight, expected)
    assert torch.equal(head.summary.bias, torch.zeros(1))
    with pytest.raises(ValueError, match="v_head_init_strategy"):
        init_value_head(head, "xavier")


def test_normal_init_through_from_pretrained(tokenizer):
    base = tiny_causal_lm(tokenizer, hidden_size=256, num_layers=1)
    model = CausalVH.from_pretrained(base, v_head_init_strategy="normal", v_head_initializer_range=0.5)
    weight = model.v_head.summary.weight
    assert abs(weight.std().item() - 0.5) < 0.1  # 256 draws: std error of the std is about 0.02
    assert torch.equal(model.v_head.summary.bias, torch.zeros(1))
    default = CausalVH.from_pretrained(base).v_head.summary.weight
    assert default.abs().max() <= 256**-0.5  # nn.Linear's uniform init, clearly not N(0, 0.5)


# ---- construction and state dict ---------------------------------------------------------------


def test_attributes_and_from_model_object(tokenizer):
    base = tiny_causal_lm(tokenizer)
    model = CausalVH.from_pretrained(base)
    assert model.pretrained_model is base and model.config is base.config
    assert not model.is_peft_model and not model.is_encoder_decoder and model.supports_rm_adapter is True
    assert model.transformers_parent_class is AutoModelForCausalLM
    with pytest.raises(ValueError, match="torch_dtype"):
        CausalVH.from_pretrained(base, torch_dtype=torch.float16)
    with pytest.raises(TypeError, match="int"):
        CausalVH.from_pretrained(3)


def test_loading_kwargs_reach_transformers_without_trust_remote_code(tokenizer, monkeypatch):
    seen = {}

    class FakeAuto:
        @staticmethod
        def from_pretrained(name, *args, **kwargs):
            seen.update(kwargs, name=name)
            return tiny_causal_lm(tokenizer)

    monkeypatch.setattr(CausalVH, "transformers_parent_class", FakeAuto)
    monkeypatch.setattr(value_head, "resolve_checkpoint_file", lambda *args: None)  # never ask a hub
    model = CausalVH.from_pretrained("some/hub-id", dtype=torch.float32, summary_dropout_prob=0.0)
    assert seen == {"name": "some/hub-id", "dtype": torch.float32}  # head kwargs split off, nothing injected
    assert isinstance(model.v_head.dropout, torch.nn.Identity)
    CausalVH.from_pretrained("some/hub-id", trust_remote_code=True)
    assert seen["trust_remote_code"] is True  # only when the user asks


def test_state_dict_layout_and_round_trip(tokenizer):
    model = _policy(tokenizer)
    state = model.state_dict()
    transformer_keys = set(model.pretrained_model.state_dict())
    assert set(state) == transformer_keys | {"v_head.summary.weight", "v_head.summary.bias"}
    other = CausalVH.from_pretrained(tiny_causal_lm(tokenizer, seed=1))
    result = other.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    _assert_same_state(model, other)


def test_state_dict_round_trip_when_nested(tokenizer):
    outer = torch.nn.ModuleDict({"policy": _policy(tokenizer)})
    state = outer.state_dict()
    assert "policy.transformer.wte.weight" in state and "policy.v_head.summary.bias" in state
    other = torch.nn.ModuleDict({"policy": CausalVH.from_pretrained(tiny_causal_lm(tokenizer, seed=1))})
    other.load_state_dict(state)
    _assert_same_state(outer["policy"], other["policy"])


# ---- checkpoints -------------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tokenizer, tmp_path):
    model = _policy(tokenizer)
    _randomise_v_head(model)
    model.save_pretrained(tmp_path)
    loaded = CausalVH.from_pretrained(tmp_path).eval()
    _assert_same_state(model, loaded)
    for a, b in zip(_outputs(model), _outputs(loaded)):
        assert torch.equal(a, b)


def test_saved_file_uses_classic_trl_layout(tokenizer, tmp_path):
    model = _policy(tokenizer)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        assert torch.equal(f.get_tensor("v_head.summary.weight"), model.v_head.summary.weight)
    expected = {"v_head.summary.weight", "v_head.summary.bias", "transformer.wte.weight", "transformer.h.0.ln_1.bias"}
    assert expected <= keys
    assert not any(k.startswith("pretrained_model.") for k in keys)
    assert (tmp_path / "config.json").is_file()


def test_saved_dir_loads_as_plain_transformers_model(tokenizer, tmp_path):
    model = _policy(tokenizer, "llama")
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(plain(IDS, attention_mask=MASK).logits, _outputs(model)[0])


def test_sharded_checkpoint_round_trip(tokenizer, tmp_path):
    model = _policy(tokenizer)
    _randomise_v_head(model)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    _assert_same_state(model, CausalVH.from_pretrained(tmp_path))


def test_seq2seq_save_load_round_trip(tokenizer, tmp_path):
    model = Seq2SeqVH.from_pretrained(tiny_seq2seq_lm(tokenizer)).eval()
    _randomise_v_head(model)
    model.save_pretrained(tmp_path)
    _assert_same_state(model, Seq2SeqVH.from_pretrained(tmp_path))


def _classic_checkpoint(tokenizer, path) -> tuple[dict, dict]:
    """A plain transformers checkpoint plus hand-made v_head tensors, as classic TRL wrote them."""
    base = tiny_causal_lm(tokenizer)
    base.save_pretrained(path)
    v_head = {
        "v_head.summary.weight": torch.arange(32.0).reshape(1, 32) / 10,  # (1, H=32)
        "v_head.summary.bias": torch.tensor([0.7]),
    }
    return load_file(path / "model.safetensors"), v_head


def test_loads_v_head_from_classic_safetensors_checkpoint(tokenizer, tmp_path):
    weights, v_head = _classic_checkpoint(tokenizer, tmp_path)
    save_file({**weights, **v_head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = CausalVH.from_pretrained(tmp_path)
    assert torch.equal(model.v_head.summary.weight, v_head["v_head.summary.weight"])
    assert torch.equal(model.v_head.summary.bias, v_head["v_head.summary.bias"])
    assert torch.equal(model.pretrained_model.transformer.wte.weight, weights["transformer.wte.weight"])


def test_loads_v_head_from_legacy_pytorch_bin(tokenizer, tmp_path):
    weights, v_head = _classic_checkpoint(tokenizer, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save({**weights, **v_head}, tmp_path / "pytorch_model.bin")
    model = CausalVH.from_pretrained(tmp_path)
    assert torch.equal(model.v_head.summary.weight, v_head["v_head.summary.weight"])
    assert torch.equal(model.v_head.summary.bias, v_head["v_head.summary.bias"])


class _NotATensor:
    """Arbitrary pickled object: a weights_only load must refuse it."""


def test_legacy_bin_is_read_with_weights_only(tmp_path):
    torch.save({"v_head.summary.bias": torch.zeros(1), "payload": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError):
        load_v_head_state(str(tmp_path))


def test_checkpoint_without_v_head_gets_fresh_head(tokenizer, tmp_path):
    tiny_causal_lm(tokenizer).save_pretrained(tmp_path)
    model = CausalVH.from_pretrained(tmp_path, v_head_init_strategy="normal", v_head_initializer_range=1e-3)
    assert load_v_head_state(str(tmp_path)) == {}
    assert model.v_head.summary.weight.abs().max() < 0.01 and torch.equal(model.v_head.summary.bias, torch.zeros(1))


def test_push_to_hub_uploads_the_value_head(tokenizer, monkeypatch):
    from huggingface_hub import HfApi

    uploaded = {}

    class Repo:
        repo_id = "me/policy"

    def fake_upload(self, repo_id, folder_path, **kwargs):
        with safe_open(os.path.join(folder_path, "model.safetensors"), framework="pt") as f:
            uploaded.update(repo_id=repo_id, keys=set(f.keys()))

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kwargs: Repo())
    monkeypatch.setattr(HfApi, "upload_folder", fake_upload)
    _policy(tokenizer).push_to_hub("me/policy")
    assert uploaded["repo_id"] == "me/policy" and "v_head.summary.weight" in uploaded["keys"]


# ---- PEFT --------------------------------------------------------------------------------------


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True
    )


def _perturb_lora(model) -> None:
    """LoRA's B starts at zero; make the adapter actually change the outputs."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_lora_policy_trains_only_adapter_and_value_head(tokenizer):
    base = tiny_causal_lm(tokenizer)
    base_copy = copy.deepcopy(base).eval()
    model = CausalVH.from_pretrained(base, peft_config=_lora_config()).eval()
    assert model.is_peft_model
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n or n.startswith("v_head.") for n in trainable)
    assert {"v_head.summary.weight", "v_head.summary.bias"} <= set(trainable)
    _perturb_lora(model)
    with torch.no_grad():
        base_logits = base_copy(IDS, attention_mask=MASK).logits
        assert not torch.allclose(_outputs(model)[0], base_logits)
        with model.disable_adapter():
            assert torch.equal(_outputs(model)[0], base_logits)
        assert not torch.allclose(_outputs(model)[0], base_logits)  # adapter back on afterwards


def test_disable_adapter_and_peft_config_errors(tokenizer):
    with pytest.raises(ValueError, match="PEFT"):
        with _policy(tokenizer).disable_adapter():
            pass
    peft_model = CausalVH.from_pretrained(tiny_causal_lm(tokenizer), peft_config=_lora_config()).pretrained_model
    with pytest.raises(ValueError, match="already is a PeftModel"):
        CausalVH.from_pretrained(peft_model, peft_config=_lora_config())


def test_peft_save_load_round_trip(tokenizer, tmp_path):
    tiny_causal_lm(tokenizer).save_pretrained(tmp_path / "base")
    model = CausalVH.from_pretrained(str(tmp_path / "base"), peft_config=_lora_config()).eval()
    _perturb_lora(model)
    _randomise_v_head(model)
    model.save_pretrained(tmp_path / "policy")
    files = set(os.listdir(tmp_path / "policy"))
    assert {"adapter_config.json", "adapter_model.safetensors", V_HEAD_FILE} <= files
    assert json.loads((tmp_path / "policy" / "adapter_config.json").read_text())["base_model_name_or_path"]
    loaded = CausalVH.from_pretrained(tmp_path / "policy").eval()
    assert loaded.is_peft_model
    assert all("lora_" in n or n.startswith("v_head.") for n, p in loaded.named_parameters() if p.requires_grad)
    assert any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)
    _assert_same_state(model, loaded)
    for a, b in zip(_outputs(model), _outputs(loaded)):
        assert torch.equal(a, b)


def test_loads_classic_trl_peft_layout(tokenizer, tmp_path):
    # Classic TRL saved a PEFT policy as adapter files + pytorch_model.bin holding only the v_head keys.
    tiny_causal_lm(tokenizer).save_pretrained(tmp_path / "base")
    model = CausalVH.from_pretrained(str(tmp_path / "base"), peft_config=_lora_config())
    _randomise_v_head(model)
    model.save_pretrained(tmp_path / "policy")
    os.remove(tmp_path / "policy" / V_HEAD_FILE)
    torch.save(model._v_head_tensors(), tmp_path / "policy" / "pytorch_model.bin")
    loaded = CausalVH.from_pretrained(tmp_path / "policy")
    assert torch.equal(loaded.v_head.summary.weight, model.v_head.summary.weight)
    assert torch.equal(loaded.v_head.summary.bias, model.v_head.summary.bias)


@pytest.mark.parametrize("wrapper, base", [("causal", "gpt2"), ("seq2seq", "t5")])
def test_value_head_wrappers_refuse_a_model_without_lm_head(wrapper, base, tokenizer):
    # TRL 0.11's test_raise_error_not_causallm: a bare GPT2Model / T5Model (no LM head) is a ValueError
    from transformers import AutoModel

    causal, seq2seq = tiny_causal_lm(tokenizer), tiny_seq2seq_lm(tokenizer)
    bare = AutoModel.from_config((causal if base == "gpt2" else seq2seq).config)
    cls = AutoModelForCausalLMWithValueHead if wrapper == "causal" else AutoModelForSeq2SeqLMWithValueHead
    with pytest.raises(ValueError, match="The model does not have a language model head"):
        cls.from_pretrained(bare)
    with pytest.raises(ValueError, match="does not have a language model head"):
        cls(bare)
    assert cls.from_pretrained(causal if wrapper == "causal" else seq2seq).v_head is not None
