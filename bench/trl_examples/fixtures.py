"""Serve the hub ids TRL's example clients load as local folders of tiny random models and small datasets.

``python fixtures.py DIR`` writes ``DIR/<org>/<name>``; the harness runs each client with ``DIR`` as its working
directory, where ``from_pretrained("lvwerra/gpt2-imdb")`` and ``load_dataset("stanfordnlp/imdb")`` read those
folders (never a download). Run it with each venv's python, so every baseline loads files its own libraries wrote.
The tokenizer and model builders are the TRL-tests harness's (``bench/trl_tests/fixtures.py``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trl_tests"))
from fixtures import PER_TYPE, ZEN, build_tokenizer, save_tiny_diffusion  # noqa: E402

# causal LMs (GPT-2 shaped) under the ids the clients name by default or that the harness passes on the command line
CAUSAL = ("gpt2", "lvwerra/gpt2-imdb", "Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct",
          "trl-lib/qwen1.5-1.8b-sft", "facebook/opt-350m", "EleutherAI/pythia-1b-deduped", "EleutherAI/gpt-neo-125m",
          "Qwen/Qwen2.5-0.5B", "Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-72B")
# those whose hub checkpoint ships a chat template (ChatML, as Qwen's): the others have none, as gpt2's
CHAT_MODELS = ("Qwen/Qwen2-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "trl-lib/qwen1.5-1.8b-sft",
               "Qwen/Qwen2.5-0.5B", "Qwen/Qwen3-0.6B", "Qwen/Qwen2.5-72B")
# those whose hub tokenizer has a pad token (gpt2's and gpt-neo's have none)
PADDED = CHAT_MODELS + ("facebook/opt-350m", "EleutherAI/pythia-1b-deduped")
# as the hub checkpoints: 1024+ positions (the SFT docs use max_seq_length=512)
GPT2_SHAPE = dict(PER_TYPE["gpt2"], n_positions=1024)
# sentiment classifiers: label 0 NEGATIVE, 1 POSITIVE (the label names the PPO clients read)
CLASSIFIERS = ("lvwerra/distilbert-imdb",)
# scalar reward models (one label) for TRL 1.x's --reward_model_name_or_path
REWARD_MODELS = ("trl-lib/Qwen2-0.5B-Reward",)
WORDS = " ".join(ZEN).split()


def review(i: int, n_words: int = 110) -> str:
    """A deterministic "review" longer than 500 characters (ppo.py keeps those over 200, the notebooks over 500)."""
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n_words))


def write_dataset(root: Path, name: str, splits: dict[str, list[dict]]) -> None:
    """``root/name`` as a folder of JSON-lines files, one per split (``load_dataset(name)`` finds them)."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def datasets(root: Path) -> None:
    # 160 rows: one full batch of PPOConfig's default batch_size (128), as the notebooks use it
    imdb = [{"text": review(i), "label": i % 2} for i in range(160)]
    for name in ("imdb", "stanfordnlp/imdb"):
        write_dataset(root, name, {"train": imdb, "test": imdb[:8]})
    guanaco = [{"text": f"### Human: {ZEN[i % len(ZEN)]}### Assistant: {ZEN[(i + 1) % len(ZEN)]}"} for i in range(24)]
    write_dataset(root, "timdettmers/openassistant-guanaco", {"train": guanaco, "test": guanaco[:4]})
    pairs = [{"chosen": [user(ZEN[i]), assistant(ZEN[i + 1])], "rejected": [user(ZEN[i]), assistant(ZEN[i + 2])],
              "score_chosen": 8.0, "score_rejected": 2.0} for i in range(16)]
    write_dataset(root, "trl-lib/ultrafeedback_binarized", {"train": pairs, "test": pairs[:4]})
    # as the hub's kto-mix-14k of 2024, which TRL 0.11's kto.py reads: the completion holds the whole conversation
    kto = [{"prompt": [user(ZEN[i])], "completion": [user(ZEN[i]), assistant(ZEN[i + 1])], "label": i % 2 == 0}
           for i in range(16)]
    write_dataset(root, "trl-lib/kto-mix-14k", {"train": kto, "test": kto[:4]})
    tldr = [{"prompt": f"SUBREDDIT: r/zen\nPOST: {review(i, 20)}\nTL;DR:", "completion": f" {ZEN[i % 19]}"}
            for i in range(16)]
    write_dataset(root, "trl-lib/tldr", {"train": tldr, "test": tldr[:4]})
    capybara = [{"messages": [user(ZEN[i]), assistant(ZEN[i + 1])]} for i in range(16)]
    write_dataset(root, "trl-lib/Capybara", {"train": capybara, "test": capybara[:4]})
    # as the hub's DeepMath-103K (TRL 1.x's GRPO/RLOO quickstarts): a conversational prompt and its answer
    math = [{"prompt": [user(f"What is {i} + {i + 1}?")], "solution": str(2 * i + 1)} for i in range(8)]
    write_dataset(root, "trl-lib/DeepMath-103K", {"train": math})
    # as the hub's cherry_picked_prompts (TRL 0.11's PPO page): 128 rows, one batch of PPOConfig's default size
    cherry = [{"prompt": ZEN[i % len(ZEN)], "meta": {"source": "zen"}, "completion": ZEN[(i + 1) % len(ZEN)]}
              for i in range(128)]
    write_dataset(root, "HuggingFaceH4/cherry_picked_prompts", {"train": cherry})
    prompts = [{"prompt": [user(ZEN[i])]} for i in range(16)]
    write_dataset(root, "trl-lib/ultrafeedback-prompt", {"train": prompts, "test": prompts[:4]})


def save(model, tokenizer, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # GPT2Tokenizer (the slow class hello_world.py names) reads vocab.json + merges.txt
    tokenizer.backend_tokenizer.model.save(str(folder))


def models(root: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None  # as gpt2's: clients set their own (SIMPLE_CHAT_TEMPLATE, setup_chat_format)
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    chat_tokenizer = build_tokenizer()  # keeps the ChatML-style template of bench/trl_tests/fixtures.py
    chat_tokenizer.pad_token = chat_tokenizer.eos_token  # Qwen's tokenizers pad with <|endoftext|>
    padded_tokenizer = build_tokenizer()
    padded_tokenizer.chat_template = None
    padded_tokenizer.pad_token = padded_tokenizer.eos_token
    for name in CAUSAL:
        torch.manual_seed(0)
        config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), **GPT2_SHAPE, **ids)
        chosen = chat_tokenizer if name in CHAT_MODELS else padded_tokenizer if name in PADDED else tokenizer
        save(AutoModelForCausalLM.from_config(config), chosen, root / name)
    # a BLOOM, as the checkpoint the customization docs share layers of (create_reference_model(num_shared_layers=6))
    torch.manual_seed(0)
    config = AutoConfig.for_model("bloom", vocab_size=len(tokenizer), **dict(PER_TYPE["bloom"], n_layer=8), **ids)
    save(AutoModelForCausalLM.from_config(config), padded_tokenizer, root / "bigscience/bloom-560m")
    classifier_tokenizer = build_tokenizer()
    classifier_tokenizer.chat_template = None
    classifier_tokenizer.pad_token = classifier_tokenizer.eos_token  # a classifier's tokenizer pads (distilbert's)
    for name in CLASSIFIERS:
        torch.manual_seed(1)
        config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), **GPT2_SHAPE, **ids, num_labels=2,
                                      id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1},
                                      pad_token_id=tokenizer.eos_token_id)
        save(AutoModelForSequenceClassification.from_config(config), classifier_tokenizer, root / name)
    for name in REWARD_MODELS:
        torch.manual_seed(2)
        config = AutoConfig.for_model("gpt2", vocab_size=len(tokenizer), **GPT2_SHAPE, **ids, num_labels=1,
                                      pad_token_id=tokenizer.eos_token_id)
        save(AutoModelForSequenceClassification.from_config(config), classifier_tokenizer, root / name)
    save_tiny_diffusion(root, build_tokenizer())


if __name__ == "__main__":
    out = Path(sys.argv[1])
    models(out)
    datasets(out)
