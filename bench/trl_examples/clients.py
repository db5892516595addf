"""The TRL clients the harness runs: where each one's source is, and the command line it gets.

``source`` is ``("file", path)`` (a script, run as published), ``("notebook", path)`` (its code cells in order, the
IPython-only lines ``%...`` / ``!...`` left out, after ``display = print`` for IPython's builtin) or
``("doc", path, n)`` (the n-th ```python block of a docs page).
``era`` picks the TRL tree the path is in and the TRL baseline it runs beside: ``"0.11"`` (a TRL v0.11.4 checkout:
trl 0.11.4 with its release-era libraries) or ``"1.x"`` (a tree holding ``trl/scripts``: trl 1.16). Command lines
name only the tiny local fixtures (``fixtures.py``) and small sizes; the sources are never edited but for their
``trl`` import lines (``run.py``).
"""

from __future__ import annotations

# a few optimizer steps, no saving or evaluation, no external logger
TRAIN = ["--output_dir", "{out}", "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--per_device_eval_batch_size", "2", "--gradient_accumulation_steps", "1", "--logging_steps", "1",
         "--report_to", "none", "--save_strategy", "no", "--eval_strategy", "no"]
TRAIN_1X = TRAIN + ["--bf16", "False"]  # TRL 1.x defaults to bf16, which a CPU-only run does not want
# rlhf_core's SFT, DPO and reward trainers are TRL 0.11's (the promise); TRL 1.x's scripts for them pass 1.x options
OLD_API = ("outside the promise: rlhf_core's SFT/DPO/reward configs are TRL 0.11's (e.g. `max_seq_length`, not "
           "1.x's `max_length`)")
# the 1.x GRPO/RLOO scripts import trl.rewards at start, whatever rewards they use
NEEDS_REWARDS = ("imports `trl.rewards` (`accuracy_reward`, ...): the verifier rewards, issue 32's "
                 "`rlhf_core/rewards/` package")

# the 1.x docs snippets come from TRL v1.9.0's docs (the newest tagged 1.x docs here: trl 1.16.0's sdist ships none)
# and run beside trl 1.16.0
DOCS_1X = "docs of TRL v1.9.0 (1.16's sdist has no docs); after the CPU prelude (`use_cpu=True`, run.py)"
VLLM = "deliberate refusal: sampling with vLLM (`use_vllm=True`) is not supported; "
PER_TASK = ("its math reward calls `check_math_solution`, which the page leaves to the reader: TRL stops at the "
            "`NameError`; rlhf_core warns with it and masks that function's samples as unscorable (issue 32's reward "
            "contract: a failing reward function costs only its samples; all failing on a whole batch is an error)")
FRAGMENT = "a fragment of its page: it uses names an earlier block or the reader defines"


def doc_1x(page: str, n: int, name: str, note: str = "") -> dict:
    """The (n+1)-th python block of TRL v1.9.0's ``docs/source/<page>``, beside trl 1.16.0."""
    return {"name": f"trl 1.x docs {page} #{n + 1} ({name})", "era": "1.x", "tree": "1.x-docs", "cpu_prelude": True,
            "source": ("doc", f"docs/source/{page}", n), "args": [], "note": "; ".join(filter(None, (note, DOCS_1X)))}


CLIENTS: list[dict] = [
    # TRL v0.11.4: examples/
    {"name": "examples/hello_world.py", "era": "0.11", "source": ("file", "examples/hello_world.py"), "args": []},
    {"name": "examples/scripts/ppo.py", "era": "0.11", "source": ("file", "examples/scripts/ppo.py"),
     "args": ["--model_name", "gpt2", "--query_dataset", "imdb", "--batch_size", "32", "--mini_batch_size", "8",
              "--reward_model", "sentiment-analysis:lvwerra/distilbert-imdb"]},
    {"name": "examples/scripts/ppo.py --use_peft", "era": "0.11", "source": ("file", "examples/scripts/ppo.py"),
     "args": ["--model_name", "gpt2", "--query_dataset", "imdb", "--batch_size", "32", "--mini_batch_size", "8",
              "--use_peft"],
     "note": "the script's own `device_map={'': Accelerator().local_process_index}` needs a GPU"},
    {"name": "examples/scripts/sft.py", "era": "0.11", "source": ("file", "examples/scripts/sft.py"),
     "args": ["--model_name_or_path", "facebook/opt-350m", "--dataset_name", "timdettmers/openassistant-guanaco",
              "--dataset_text_field", "text", "--max_seq_length", "64", *TRAIN]},
    {"name": "examples/scripts/sft.py --use_peft", "era": "0.11", "source": ("file", "examples/scripts/sft.py"),
     "args": ["--model_name_or_path", "facebook/opt-350m", "--dataset_name", "timdettmers/openassistant-guanaco",
              "--dataset_text_field", "text", "--max_seq_length", "64", "--use_peft", "--lora_r", "8",
              "--lora_alpha", "16", *TRAIN]},
    {"name": "examples/scripts/dpo.py", "era": "0.11", "source": ("file", "examples/scripts/dpo.py"),
     "args": ["--dataset_name", "trl-lib/ultrafeedback_binarized", "--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct",
              "--max_length", "96", "--max_prompt_length", "48", "--no_remove_unused_columns", *TRAIN]},
    {"name": "examples/scripts/reward_modeling.py", "era": "0.11",
     "source": ("file", "examples/scripts/reward_modeling.py"),
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/ultrafeedback_binarized",
              "--remove_unused_columns", "False", "--max_length", "96", *TRAIN],
     "note": "trains and evaluates, then ends with an unconditional `trainer.push_to_hub()`, which needs the hub"},
    {"name": "examples/scripts/kto.py (--warmup_ratio)", "era": "0.11", "source": ("file", "examples/scripts/kto.py"),
     "args": ["--model_name_or_path", "trl-lib/qwen1.5-1.8b-sft", "--warmup_ratio", "0.1", "--max_length", "96",
              *TRAIN],
     "note": "ends with an unconditional `kto_trainer.push_to_hub()`, which needs the hub"},
    {"name": "examples/scripts/ddpo.py", "era": "0.11", "source": ("file", "examples/scripts/ddpo.py"),
     "args": ["--pretrained_model", "hf-internal-testing/tiny-stable-diffusion-torch", "--num_epochs", "1",
              "--sample_num_steps", "2", "--sample_batch_size", "2", "--sample_num_batches_per_epoch", "1",
              "--train_batch_size", "2", "--train_gradient_accumulation_steps", "1", "--log_with", "tensorboard"],
     "note": "its aesthetic scorer downloads `openai/clip-vit-large-patch14` and the scorer head (`hf_hub_download`), "
             "which are not served here"},
    {"name": "examples/scripts/ppo_multi_adapter.py", "era": "0.11",
     "source": ("file", "examples/scripts/ppo_multi_adapter.py"), "args": ["--model_name", "gpt2"],
     "note": "loads its base model in 4 bit: bitsandbytes and a CUDA GPU"},
    {"name": "examples/notebooks/gpt2-sentiment.ipynb", "era": "0.11",
     "source": ("notebook", "examples/notebooks/gpt2-sentiment.ipynb"), "args": []},
    {"name": "examples/notebooks/gpt2-sentiment-control.ipynb", "era": "0.11",
     "source": ("notebook", "examples/notebooks/gpt2-sentiment-control.ipynb"), "args": []},
    {"name": "examples/notebooks/best_of_n.ipynb", "era": "0.11",
     "source": ("notebook", "examples/notebooks/best_of_n.ipynb"), "args": [],
     "note": "the file in TRL's repository is not valid JSON; it also calls `model.cuda()`"},
    # TRL v0.11.4: docs snippets that run on their own
    {"name": "docs quickstart.mdx #1", "era": "0.11", "source": ("doc", "docs/source/quickstart.mdx", 0), "args": []},
    *({"name": f"docs {page} #{n + 1}", "era": "0.11", "source": ("doc", f"docs/source/{page}", n), "args": []}
      for page, blocks in (("sft_trainer.mdx", (0, 1, 3, 12, 16)), ("customization.mdx", (1, 4, 5)))
      for n in blocks),
    # TRL v0.11.4: the PPO, DPO, reward and how-to pages (a page whose blocks build one program: those blocks in order)
    {"name": "docs ppo_trainer.mdx #1,#3-#9 (the page's walk-through)", "era": "0.11",
     "source": ("doc", "docs/source/ppo_trainer.mdx", (0, 2, 3, 4, 5, 6, 7, 8)), "args": [],
     "note": "the page's blocks in order (#2 is an alternative dataset): its queries differ in length and it "
             "gives no collator or `set_format`, so its dataloader's batches are lists; its loop also uses `torch`, "
             "which the page never imports"},
    {"name": "docs dpo_trainer.mdx #1,#3,#4 (the page's walk-through)", "era": "0.11",
     "source": ("doc", "docs/source/dpo_trainer.mdx", (0, 2, 3)), "args": [],
     "note": FRAGMENT + " (`model`, `ref_model`, `train_dataset`, `tokenizer`)"},
    {"name": "docs dpo_trainer.mdx #5 (unsloth)", "era": "0.11", "source": ("doc", "docs/source/dpo_trainer.mdx", 4),
     "args": [], "note": "needs `unsloth` (a CUDA-only package) and a 4-bit model"},
    {"name": "docs dpo_trainer.mdx #6 (adapter twice)", "era": "0.11",
     "source": ("doc", "docs/source/dpo_trainer.mdx", 5), "args": [],
     "note": FRAGMENT + " (its imports); then bitsandbytes 4-bit and flash-attention on a GPU"},
    {"name": "docs reward_trainer.mdx #1 (PEFT)", "era": "0.11",
     "source": ("doc", "docs/source/reward_trainer.mdx", 0), "args": [],
     "note": FRAGMENT + " (`...` stands for `training_args`, `tokenizer`, `dataset`)"},
    {"name": "docs reward_trainer.mdx #2 (margin)", "era": "0.11",
     "source": ("doc", "docs/source/reward_trainer.mdx", 1), "args": [], "note": FRAGMENT + " (`dataset`)"},
    {"name": "docs how_to_train.md #1", "era": "0.11", "source": ("doc", "docs/source/how_to_train.md", 0),
     "args": [], "note": FRAGMENT + " (`tokenizer`)"},
    {"name": "docs quickstart.mdx #3 (load the trained model)", "era": "0.11",
     "source": ("doc", "docs/source/quickstart.mdx", 2), "args": [],
     "note": "loads `my-fine-tuned-model-ppo`, which block #2 saves after a training the reader ran"},
    # TRL 1.x: the quickstart and the GRPO/RLOO/KTO pages' snippets that are whole programs
    doc_1x("quickstart.md", 0, "SFT"),
    doc_1x("quickstart.md", 1, "GRPO"),
    doc_1x("quickstart.md", 2, "DPO"),
    doc_1x("quickstart.md", 3, "reward"),
    doc_1x("grpo_trainer.md", 0, "quickstart"),
    doc_1x("grpo_trainer.md", 4, "vLLM server", VLLM + "the script also names `Qwen/Qwen2.5-72B`"),
    doc_1x("grpo_trainer.md", 13, "per-task rewards", PER_TASK),
    doc_1x("grpo_trainer.md", 22, "environment_factory",
           "deliberate refusal: agent training (`tools`, `environment_factory`, `rollout_func`) is not supported"),
    doc_1x("grpo_trainer.md", 23, "environment_factory + dataset",
           "deliberate refusal: agent training (`tools`, `environment_factory`, `rollout_func`) is not supported"),
    doc_1x("rloo_trainer.md", 0, "quickstart"),
    doc_1x("rloo_trainer.md", 3, "vLLM server", VLLM + "the script also names `Qwen/Qwen2.5-72B`"),
    doc_1x("rloo_trainer.md", 12, "per-task rewards", PER_TASK),
    doc_1x("kto_trainer.md", 0, "quickstart"),
    doc_1x("kto_trainer.md", 4, "LoRA"),
    doc_1x("kto_trainer.md", 5, "vision-language",
           "a vision-language model (`Qwen/Qwen2.5-VL-3B-Instruct`) and image dataset: no tiny stand-in here"),
    # TRL 1.16: its example scripts (trl/scripts, what `trl sft|dpo|reward|kto|grpo|rloo` runs)
    {"name": "trl 1.16 trl/scripts/sft.py", "era": "1.x", "source": ("file", "trl/scripts/sft.py"), "note": OLD_API,
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/Capybara",
              "--max_length", "64", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/dpo.py", "era": "1.x", "source": ("file", "trl/scripts/dpo.py"), "note": OLD_API,
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/ultrafeedback_binarized",
              "--max_length", "96", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/reward.py", "era": "1.x", "source": ("file", "trl/scripts/reward.py"),
     "note": OLD_API,
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/ultrafeedback_binarized",
              "--max_length", "96", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/kto.py", "era": "1.x", "source": ("file", "trl/scripts/kto.py"),
     "args": ["--model_name_or_path", "trl-lib/qwen1.5-1.8b-sft", "--dataset_name", "trl-lib/kto-mix-14k",
              "--max_length", "96", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/grpo.py (reward model)", "era": "1.x", "source": ("file", "trl/scripts/grpo.py"),
     "note": NEEDS_REWARDS,
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/tldr",
              "--reward_model_name_or_path", "trl-lib/Qwen2-0.5B-Reward", "--num_generations", "2",
              "--max_completion_length", "8", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/rloo.py (reward model)", "era": "1.x", "source": ("file", "trl/scripts/rloo.py"),
     "note": NEEDS_REWARDS,
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/tldr",
              "--reward_model_name_or_path", "trl-lib/Qwen2-0.5B-Reward", "--num_generations", "2",
              "--max_completion_length", "8", *TRAIN_1X]},
    {"name": "trl 1.16 trl/scripts/grpo.py --reward_funcs think_format_reward", "era": "1.x",
     "note": NEEDS_REWARDS,
     "source": ("file", "trl/scripts/grpo.py"),
     "args": ["--model_name_or_path", "Qwen/Qwen2-0.5B-Instruct", "--dataset_name", "trl-lib/tldr",
              "--reward_funcs", "think_format_reward", "--num_generations", "2", "--max_completion_length", "8",
              *TRAIN_1X]},
]
