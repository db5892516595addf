"""Chat templates of TRL's scripts: ``setup_chat_format`` (ChatML tokens, template and resized embeddings) and
the plain templates ``SIMPLE_CHAT_TEMPLATE`` / ``SIMPLE_SFT_CHAT_TEMPLATE`` / ``SIMPLE_QUERY_CHAT_TEMPLATE``."""

from __future__ import annotations

from typing import Any

# "Role: content" turns separated by blank lines; the generation prompt is "Assistant:"
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{message['role'].capitalize() + ': ' + message['content'] + '\n\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
# the contents joined by spaces and closed by EOS, so an SFT model learns to stop
SIMPLE_SFT_CHAT_TEMPLATE = "{% for message in messages %}{{' ' + message['content']}}{% endfor %}{{ eos_token }}"
# the contents joined by spaces, no EOS: a query that the policy continues
SIMPLE_QUERY_CHAT_TEMPLATE = "{% for message in messages %}{{' ' + message['content']}}{% endfor %}"

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'" + CHATML_START + "' + message['role'] + '\n' + message['content'] + '"
    + CHATML_END + "' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '" + CHATML_START
    + "assistant\n' }}{% endif %}")


def setup_chat_format(model: Any, tokenizer: Any, format: str | None = "chatml",
                      resize_to_multiple_of: int | None = None) -> tuple[Any, Any]:
    """Give ``tokenizer`` ChatML's special tokens and template, grow ``model``'s embeddings to match, and point
    the model's (and its generation config's) bos/eos/pad ids at the new tokens. Returns ``(model, tokenizer)``."""
    if format != "chatml":
        raise ValueError(f"setup_chat_format: format={format!r} is not available; the one format is 'chatml'")
    if getattr(tokenizer, "chat_template", None):
        # TRL 0.11 overwrote an existing template silently; a model trained on its own template loses it
        raise ValueError("setup_chat_format: the tokenizer already has a chat template; setting ChatML over it "
                         "would retrain the model on a different format. Remove tokenizer.chat_template first "
                         "if that is what you want")
    tokenizer.add_special_tokens({"additional_special_tokens": [CHATML_START, CHATML_END]})
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token = CHATML_START, CHATML_END, CHATML_END
    tokenizer.chat_template = CHATML_TEMPLATE
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=resize_to_multiple_of)
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    for config in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if config is not None:
            for key, value in ids.items():
                setattr(config, key, value)
    return model, tokenizer
