"""Build the hub ids TRL 0.11.4's tests load as local folders of random-weight models (never downloads).

``python fixtures.py DIR`` writes ``DIR/<org>/<name>`` for every id below; run the tests with ``DIR`` as
the working directory and ``from_pretrained("trl-internal-testing/...")`` / ``load_dataset(...)`` read
the local folder of that relative path. Ids not listed here are not served: those tests need a download.
Only transformers, tokenizers and datasets are used, so the same script serves both venvs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

ZEN = [
    "Beautiful is better than ugly.", "Explicit is better than implicit.", "Simple is better than complex.",
    "Complex is better than complicated.", "Flat is better than nested.", "Sparse is better than dense.",
    "Readability counts.", "Special cases aren't special enough to break the rules.",
    "Although practicality beats purity.", "Errors should never pass silently.",
    "Unless explicitly silenced.", "In the face of ambiguity, refuse the temptation to guess.",
    "There should be one-- and preferably only one --obvious way to do it.",
    "Although that way may not be obvious at first unless you're Dutch.", "Now is better than never.",
    "Although never is often better than *right* now.",
    "If the implementation is hard to explain, it's a bad idea.",
    "If the implementation is easy to explain, it may be a good idea.",
    "Namespaces are one honking great idea -- let's do more of those!",
]
# Texts whose GPT-2 token counts the tests assert ("This morning I went to the " is 7 tokens): trained on, so
# the small tokenizer splits them into the same words.
TEST_TEXTS = ["This morning I went to the ", "This morning I went to the park"]
# A ChatML-style template, so conversational (``messages``) datasets can be rendered.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# causal LM ids -> transformers model_type (small random configs)
CAUSAL = {
    "trl-internal-testing/dummy-GPT2-correct-vocab": "gpt2",
    "trl-internal-testing/tiny-random-GPT2LMHeadModel": "gpt2",
    "trl-internal-testing/tiny-random-GPTNeoXForCausalLM": "gpt_neox",
    "trl-internal-testing/tiny-random-GPTNeoXForCausalLM-safetensors": "gpt_neox",
    "trl-internal-testing/tiny-random-GPTNeoXForCausalLM-safetensors-sharded": "gpt_neox",
    "trl-internal-testing/tiny-random-GPTNeoForCausalLM": "gpt_neo",
    "trl-internal-testing/tiny-random-CodeGenForCausalLM": "codegen",
    "trl-internal-testing/tiny-random-CodeGenForCausalLM-sharded": "codegen",
    "trl-internal-testing/tiny-random-GPTJForCausalLM": "gptj",
    "trl-internal-testing/tiny-random-BloomForCausalLM": "bloom",
    "trl-internal-testing/tiny-BloomForCausalLM-correct-vocab": "bloom",
    "trl-internal-testing/tiny-random-OPTForCausalLM": "opt",
    "trl-internal-testing/tiny-random-LlamaForCausalLM": "llama",
}
SEQ2SEQ = {
    "trl-internal-testing/tiny-random-T5ForConditionalGeneration": "t5",
    "trl-internal-testing/tiny-T5ForConditionalGeneration-correct-vocab": "t5",
    "trl-internal-testing/T5ForConditionalGeneration-correct-vocab-calibrated": "t5",
    "trl-internal-testing/tiny-random-BartForConditionalGeneration": "bart",
    "trl-internal-testing/tiny-random-BigBirdPegasusForConditionalGeneration": "bigbird_pegasus",
    "trl-internal-testing/tiny-random-BlenderbotForConditionalGeneration": "blenderbot",
    "trl-internal-testing/tiny-random-BlenderbotSmallForConditionalGeneration": "blenderbot-small",
    "trl-internal-testing/tiny-random-FSMTForConditionalGeneration": "fsmt",
    "trl-internal-testing/tiny-random-LEDForConditionalGeneration": "led",
    "trl-internal-testing/tiny-random-LongT5ForConditionalGeneration": "longt5",
    "trl-internal-testing/tiny-random-M2M100ForConditionalGeneration": "m2m_100",
    "trl-internal-testing/tiny-random-MarianMTModel": "marian",
    "trl-internal-testing/tiny-random-MBartForConditionalGeneration": "mbart",
    "trl-internal-testing/tiny-random-MT5ForConditionalGeneration": "mt5",
    "trl-internal-testing/tiny-random-MvpForConditionalGeneration": "mvp",
    "trl-internal-testing/tiny-random-PegasusForConditionalGeneration": "pegasus",
    "trl-internal-testing/tiny-random-PegasusXForConditionalGeneration": "pegasus_x",
    "trl-internal-testing/tiny-random-PLBartForConditionalGeneration": "plbart",
    "trl-internal-testing/tiny-random-ProphetNetForConditionalGeneration": "prophetnet",
    "trl-internal-testing/tiny-random-SwitchTransformersForConditionalGeneration": "switch_transformers",
}
# base models (no LM head): the tests check they are refused
BASE = {"trl-internal-testing/tiny-random-GPT2Model": "gpt2", "trl-internal-testing/tiny-random-T5Model": "t5"}
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
PER_TYPE = {
    "gpt2": dict(n_embd=32, n_layer=5, n_head=4, n_positions=256),  # 5 layers, as the hub's tiny-random GPT-2
    "gpt_neo": dict(hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                    max_position_embeddings=256),
    "codegen": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256, rotary_dim=4),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "opt": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32,
                max_position_embeddings=256),
    "llama": dict(SMALL, num_key_value_heads=4, max_position_embeddings=256),
    "gpt_neox": dict(SMALL, max_position_embeddings=256),
    "t5": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=1),
    "bart": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256),
}
_BART_LIKE = PER_TYPE["bart"]
_T5_LIKE = PER_TYPE["t5"]
PER_TYPE.update({
    "bigbird_pegasus": dict(_BART_LIKE, attention_type="original_full"),
    "blenderbot": _BART_LIKE, "blenderbot-small": _BART_LIKE, "m2m_100": _BART_LIKE, "marian": _BART_LIKE,
    "mbart": _BART_LIKE, "mvp": _BART_LIKE, "pegasus": _BART_LIKE, "plbart": _BART_LIKE,
    "led": dict(_BART_LIKE, max_encoder_position_embeddings=256, max_decoder_position_embeddings=256,
                attention_window=4),
    "pegasus_x": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256,
                      num_global_tokens=4, block_size=4),
    "longt5": _T5_LIKE, "mt5": _T5_LIKE, "switch_transformers": dict(_T5_LIKE, num_experts=2),
    "fsmt": dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=256, langs=["en", "de"]),
    "prophetnet": dict(hidden_size=32, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_position_embeddings=256, ngram=2),
})


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the Zen of Python (EOS = BOS = ``<|endoftext|>``, no pad token)."""
    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(ZEN + TEST_TEXTS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>", unk_token="<|endoftext|>", model_max_length=256)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_model(root: Path, name: str, model_type: str, auto_class, tokenizer) -> None:
    """A random ``model_type`` model sized to ``tokenizer`` (pad = eos id), saved with the tokenizer."""
    ids = dict(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.eos_token_id)
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **PER_TYPE[model_type], **ids)
    torch.manual_seed(0)
    model = auto_class.from_config(config)
    shard = "10KB" if name.endswith("sharded") else "5GB"
    model.save_pretrained(root / name, max_shard_size=shard)
    tokenizer.save_pretrained(root / name)


def save_zen(root: Path) -> None:
    """``trl-internal-testing/zen`` with the configs the tests load (README ``configs`` metadata)."""
    folder = root / "trl-internal-testing" / "zen"
    rows = {
        "standard_preference": [
            {"prompt": line.split(" is ")[0] + " is", "chosen": " better.", "rejected": " worse."} for line in ZEN
        ],
        "conversational_language_modeling": [
            {"messages": [{"role": "user", "content": "What is better?"}, {"role": "assistant", "content": line}]}
            for line in ZEN
        ],
        "standard_prompt_completion": [{"prompt": line[:10], "completion": line[10:]} for line in ZEN],
        "standard_language_modeling": [{"text": line} for line in ZEN],
    }
    yaml = ["---", "configs:"]
    for config, data in rows.items():
        (folder / config).mkdir(parents=True, exist_ok=True)
        yaml += [f"- config_name: {config}", "  data_files:"]
        for split, part in (("train", data[:-2]), ("test", data[-2:])):
            (folder / config / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
            yaml += [f"  - split: {split}", f"    path: {config}/{split}.jsonl"]
    (folder / "README.md").write_text("\n".join(yaml + ["---", ""]))


def save_tiny_diffusion(root: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    """``hf-internal-testing/tiny-stable-diffusion-torch`` when diffusers is installed: a random Stable-Diffusion
    pipeline of the hub checkpoint's shapes as TRL's DDPO tests assert them (64x64 latents of 4 channels, a CLIP
    text encoder of width 32 over 77 tokens), built with this venv's diffusers and transformers only, so the same
    fixture serves rlhf_core and TRL alike. Without diffusers (today's trl venv) the DDPO tests skip."""
    try:
        from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    except ImportError:
        return
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>",
                                             bos_token="<|endoftext|>", unk_token="<|endoftext|>",
                                             pad_token="<|endoftext|>", model_max_length=77)
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=64, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32,
    )
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64), latent_channels=4,
                        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, sample_size=128, norm_num_groups=32)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, pad_token_id=clip_tokenizer.pad_token_id, bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id,
    ))
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                              set_alpha_to_one=False, steps_offset=1)
    pipeline = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer, unet=unet,
                                       scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
    pipeline.save_pretrained(root / "hf-internal-testing" / "tiny-stable-diffusion-torch")


def main(root: Path) -> None:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(root / "gpt2")
    for name, model_type in CAUSAL.items():
        save_model(root, name, model_type, AutoModelForCausalLM, tokenizer)
    seq2seq_tokenizer = build_tokenizer()
    seq2seq_tokenizer.pad_token = seq2seq_tokenizer.eos_token  # as the hub's T5/BART tokenizers, these have a pad token
    for name, model_type in SEQ2SEQ.items():
        try:  # best effort: an architecture this transformers cannot build is a test that needs a download
            save_model(root, name, model_type, AutoModelForSeq2SeqLM, seq2seq_tokenizer)
        except Exception as error:  # noqa: BLE001
            print(f"not served: {name} ({type(error).__name__}: {error})", file=sys.stderr)
    for name, model_type in BASE.items():
        save_model(root, name, model_type, AutoModel, tokenizer)
    save_zen(root)
    save_tiny_diffusion(root, tokenizer)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
