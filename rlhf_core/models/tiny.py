"""Offline building blocks: a tokenizer trained on a local corpus and tiny models built from configs.

Nothing here touches a hub. Tests, examples and the pipeline's offline default use these; real hub
names go through the same ``from_pretrained`` code for users who have a network.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    GPT2Config,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"

# A few sentences so a tokenizer can be built with no corpus at hand (tests, examples).
DEFAULT_CORPUS = (
    "This movie was great and the acting was wonderful.",
    "This morning I went to the cinema and the film was terrible.",
    "The plot is boring, the dialogue is awful, and the ending is bad.",
    "What a lovely, charming and funny story; I loved every minute.",
    "The music was fine but the story felt slow and dull.",
    "An excellent cast, a brilliant script and a beautiful score.",
    "I hated the characters and the pacing was a mess.",
    "A good film with a happy ending, warm and delightful.",
    "the a an and or but of to in on at for with is was were be it this that i you he she they we",
    "0 1 2 3 4 5 6 7 8 9 . , ! ? ; : ' \" ( ) -",
)


MAX_TRAINING_RUN = 64
"""Tokenizer training sees runs of non-space characters at most this long (longer runs are split into pieces):
BPE training is quadratic in the length of one pre-token, and a 1 MB single-"word" line ran for minutes."""


def _bounded_runs(text: str, limit: int = MAX_TRAINING_RUN) -> str:
    """``text`` with every run of more than ``limit`` non-space characters split by spaces into pieces of ``limit``.

    Normal text is unchanged; the merges learned from real words are the same.
    """
    return re.sub(rf"\S{{{limit + 1},}}",
                  lambda m: " ".join(m.group(0)[i:i + limit] for i in range(0, len(m.group(0)), limit)), text)


def build_tokenizer(
    corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 512, padding_side: str = "right",
    split_digits: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``corpus`` (milliseconds for a few KB) and wrap it.

    EOS (also BOS) is ``<|endoftext|>``; the pad token ``<pad>`` is distinct from EOS, so padding
    never hides a real end of text. ``padding_side`` is passed to the constructor so it is saved.
    Training time stays linear in the corpus size: overlong non-space runs are cut (:func:`_bounded_runs`).
    ``split_digits``: every digit is a token of its own, as in LLaMA's and Qwen's tokenizers. Without it BPE merges
    each number of an arithmetic corpus into one token, and a model can only memorise the table of those tokens'
    sums: it cannot carry, so it cannot answer a problem it has not seen.
    """
    backend = Tokenizer(models.BPE(unk_token=None))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if split_digits else byte_level)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, UNK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_bounded_runs(text) for text in corpus], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side=padding_side,
    )


def _token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "gpt2",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    max_positions: int = 128,
    dropout: float = 0.0,
    seed: int | None = 0,
) -> PreTrainedModel:
    """A small randomly initialised causal LM (``gpt2`` or ``llama`` shaped) sized to ``tokenizer``."""
    ids = _token_ids(tokenizer)
    if arch == "gpt2":
        config = GPT2Config(
            n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_positions,
            resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **ids,
        )
    elif arch == "llama":
        config = LlamaConfig(
            hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_heads, max_position_embeddings=max_positions,
            attention_dropout=dropout, tie_word_embeddings=False, **ids,
        )
    else:
        raise ValueError(f"arch must be 'gpt2' or 'llama', got {arch!r}")
    return _seeded(lambda: AutoModelForCausalLM.from_config(config), seed)


def tiny_seq2seq_lm(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
    dropout: float = 0.0, seed: int | None = 0,
) -> PreTrainedModel:
    """A small randomly initialised T5-shaped encoder-decoder LM sized to ``tokenizer``."""
    ids = _token_ids(tokenizer)
    ids.pop("bos_token_id")
    config = T5Config(
        d_model=hidden_size, d_kv=hidden_size // num_heads, d_ff=hidden_size * 2, num_layers=num_layers,
        num_decoder_layers=num_layers, num_heads=num_heads, dropout_rate=dropout,
        decoder_start_token_id=tokenizer.pad_token_id, **ids,
    )
    return _seeded(lambda: AutoModelForSeq2SeqLM.from_config(config), seed)


def tiny_reward_model(
    tokenizer: PreTrainedTokenizerFast, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
    seed: int | None = 0, num_labels: int = 1,
) -> PreTrainedModel:
    """A small GPT-2-shaped sequence classifier with ``num_labels`` outputs (a reward model: one)."""
    config = GPT2Config(
        n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=128, num_labels=num_labels,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, **_token_ids(tokenizer),
    )
    return _seeded(lambda: AutoModelForSequenceClassification.from_config(config), seed)


def _seeded(build, seed: int | None):
    """Build a model under a fixed torch seed without disturbing the caller's global RNG."""
    import torch

    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
