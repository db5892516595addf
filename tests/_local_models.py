"""A user's local model folder for the tests that take ``sft.model_name`` from disk (built offline, no hub)."""

from __future__ import annotations

from rlhf_core.models.chat_format import CHATML_END, CHATML_START, CHATML_TEMPLATE


def save_local_qwen2(folder):
    """A tiny Qwen2 and a tokenizer with a chat template, saved as a user's local model folder."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf_core.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(vocab_size=300)
    # the ChatML markers one token each, as in Qwen2's own tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": [CHATML_START, CHATML_END]})
    tokenizer.chat_template = CHATML_TEMPLATE
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
