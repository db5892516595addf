"""Workload (e): critic-free online RL, GRPO or RLOO, in rlhf_core or TRL 1.16.0 (issue 14 point 6).

    python bench/workloads/online.py --lib ours|trl116 --method grpo|rloo --args '{"steps": 40, "seed": 0, ...}'

``ours`` runs in .venv (rlhf_core.GRPOTrainer / RLOOTrainer), ``trl116`` in bench/.trl116-venv
(trl.GRPOTrainer / RLOOTrainer); both stacks have transformers 5.23, so the model is one
``save_pretrained`` directory (a 4x128 GPT-2 built from a config with seed 0, dropout off) that both load
with ``from_pretrained``: TRL 1.16 re-loads its reference model from ``config._name_or_path``, which
must be a directory. The tokenizer is the rt-polarity BPE of workload (d) (a ``tokenizers`` file), the
prompts are the first words of rt-polarity snippets (read in place), and the reward function is one
callable: the VADER compound score of prompt + completion (the gold judge). Both trainers get the same
config fields (lr, beta, group size, sampling, seed, steps).

Prints one JSON line: the gold reward of the samples at the first and last steps (the reward function
records the mean of every call: one call per step), their gain, seconds per step (median of the
steps after the first, timed by a TrainerCallback around each optimizer step: generation, reward,
loss, backward and update), the logged KL, and the peak RSS; per step, the seconds of its generation, reward and
reference-forward phases (synchronised timers around the trainers' own methods, ``PHASES``) and its prompt and
completion tokens. The GPU is used when there is one. ``"arch"`` picks another policy shape (``ARCHS``: GPT-2
small's, Qwen2-0.5B's) and ``"bf16": true`` both trainers' bf16 mixed precision: the GPU bench's rows. ``"profile_step": k`` in the arguments prints
a cProfile of step k to stderr (the evidence behind "what bounds it" in bench/analysis.md); with
``"profile_file": path`` too, the raw profile is written there for bench/online_phases.py.
"""

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402

# The policy of this workload: GPT-2 with 4 layers of width 128 over the rt-polarity tokenizer.
ARCH = {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 128, "vocab_size": 2048, **common.NO_DROPOUT}
# Other policies (``"arch"`` argument), for the GPU bench: GPT-2 small's shape over the same 2048-token vocabulary,
# and Qwen2-0.5B's published shape (random weights; ids the rt-polarity tokenizer lacks decode to nothing),
# with a 2-layer Qwen2 for the CPU smoke run of the same rows.
QWEN2_IDS = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}  # the bench tokenizers' EOS / PAD
ARCHS = {
    "4x128": ("gpt2", ARCH),
    "gpt2s": ("gpt2", {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 256, "vocab_size": 2048,
                       **common.NO_DROPOUT}),
    "qwen2-0.5b": ("qwen2", {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                             "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
                             "tie_word_embeddings": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                             "max_position_embeddings": 32768, **QWEN2_IDS}),
    "qwen2-tiny": ("qwen2", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096,
                             "tie_word_embeddings": True, **QWEN2_IDS}),
}
DEFAULTS = {"steps": 40, "seed": 0, "completions_per_step": 64, "num_generations": 8, "learning_rate": 1e-4,
            "beta": 0.04, "max_completion_length": 20, "prompt_words": 4, "threads": 1, "arch": "4x128",
            "bf16": False}
# Per library, the trainer method of each timed phase (the policy update is the rest of the step).
PHASES = {"ours": {"generation": "_sample", "reward": "_rewards", "reference forward": "_reference_logprobs"},
          "trl116": {"generation": "_generate", "reward": "_calculate_rewards",
                     "reference forward": "_get_per_token_logps_and_entropies"}}


def parse() -> tuple[str, str, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=("ours", "trl116"), required=True)
    parser.add_argument("--method", choices=("grpo", "rloo"), required=True)
    parser.add_argument("--args", default="{}", help="workload arguments as a JSON object")
    ns = parser.parse_args()
    args = {**DEFAULTS, **json.loads(ns.args)}
    import torch

    torch.set_num_threads(int(args["threads"]))
    return ns.lib, ns.method, args


def tokenizer_path():
    """The rt-polarity BPE of workload (d); trained here (tokenizers only) when bench/prepare.py has not run."""
    path = common.tokenizer_json_path("rt")
    if not path.exists():
        lines = common.rt_polarity_lines()
        if not lines:
            raise FileNotFoundError(f"no rt-polarity data at {common.RT_POLARITY} (set RT_POLARITY_DIR)")
        common.train_tokenizer(lines, ARCH["vocab_size"], path)
    return path


def model_dir(arch: str = "4x128"):
    """bench/.cache/models/online-<arch>-seed0: a save_pretrained directory (written once, atomically)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    family, kwargs = ARCHS[arch]
    path = common.checkpoint_dir(f"online-{arch}-seed0")
    if not (path / "config.json").exists():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(GPT2Config(**kwargs)) if family == "gpt2" else Qwen2ForCausalLM(Qwen2Config(**kwargs))
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        model.save_pretrained(str(tmp))
        if not path.exists():  # another process may have written it meanwhile
            tmp.rename(path)
    return path


def prompts(words: int) -> list[str]:
    """The first ``words`` words of every rt-polarity snippet, in a fixed shuffled order."""
    lines = common.rt_polarity_lines()
    random.Random(1234).shuffle(lines)
    return [" ".join(line.split()[:words]) for line in lines]


class GoldJudge:
    """Reward function of both trainers: VADER compound of prompt + completion; records each call's rewards."""

    __name__ = "gold"

    def __init__(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()
        self.calls: list[list[float]] = []

    def __call__(self, prompts, completions, **kwargs):
        scores = [self.analyzer.polarity_scores(p + c)["compound"] for p, c in zip(prompts, completions)]
        self.calls.append(scores)
        return scores


def step_timer(profile_step: int | None = None, profile_file: str | None = None, phases=None):
    """A TrainerCallback timing each optimizer step (on_step_begin .. on_step_end; ``common.clock``: on a GPU after
    its queued work); with ``profile_step`` = k it also runs cProfile over step k (1-based), prints the top
    functions by own time to stderr and, given ``profile_file``, writes the raw profile there. ``phases``
    (a ``common.PhaseClock``) is closed at the end of every step."""
    import cProfile
    import pstats

    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self._t = 0.0
            self._profile = None

        def on_step_begin(self, args, state, control, **kwargs):
            if profile_step == len(self.seconds) + 1:
                self._profile = cProfile.Profile()
                self._profile.enable()
            self._t = common.clock()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(common.clock() - self._t)
            if phases is not None:
                phases.end_step()
            if self._profile is not None:
                self._profile.disable()
                for order in ("tottime", "cumulative"):
                    pstats.Stats(self._profile, stream=sys.stderr).sort_stats(order).print_stats(25)
                if profile_file:
                    Path(profile_file).parent.mkdir(parents=True, exist_ok=True)
                    self._profile.dump_stats(profile_file)
                self._profile = None

    return StepTimer()


def classes(lib: str, method: str):
    if lib == "ours":
        import rlhf_core as L
    else:
        import trl as L
    return (L.GRPOConfig, L.GRPOTrainer) if method == "grpo" else (L.RLOOConfig, L.RLOOTrainer)


def config_kwargs(args: dict, out_dir: str) -> dict:
    """The same config fields on both sides (TRL 1.16 names), settings TRL 1.16 defaults differently spelled out.
    The GPU is used when there is one; ``"bf16": true`` is both trainers' bf16 mixed precision."""
    import torch

    return dict(output_dir=out_dir, report_to="none", max_steps=args["steps"], logging_steps=1, save_strategy="no",
                seed=args["seed"], learning_rate=args["learning_rate"], beta=args["beta"],
                per_device_train_batch_size=args["completions_per_step"], num_generations=args["num_generations"],
                max_completion_length=args["max_completion_length"], temperature=1.0, top_k=0, top_p=1.0,
                bf16=bool(args["bf16"]), gradient_checkpointing=False, use_vllm=False, disable_dropout=True,
                use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)


def time_phases(trainer, lib: str, tokenizer, clock) -> dict:
    """Wrap the trainer's phase methods in ``clock``; returns the per-step token counts the reward call sees."""
    methods = PHASES[lib]
    reference = getattr(trainer, "ref_model", None)
    for phase, name in methods.items():
        when = None
        if lib == "trl116" and phase == "reference forward":  # the same method also runs the policy
            when = lambda a, k: (a[0] if a else k.get("model")) is reference  # noqa: E731
        clock.wrap(trainer, name, phase, when)
    tokens: dict = {"prompt": [], "completion": []}
    reward = getattr(trainer, methods["reward"])

    def counted(*args, **kwargs):  # (inputs or rows, prompts, completions, completion_ids) in both libraries
        prompts, completion_ids = args[1], args[3]
        tokens["prompt"].append(sum(len(ids) for ids in tokenizer([str(p) for p in prompts])["input_ids"]))
        tokens["completion"].append(sum(len(ids) for ids in completion_ids))
        return reward(*args, **kwargs)

    setattr(trainer, methods["reward"], counted)
    return tokens


def main():
    lib, method, args = parse()
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    rss_imports = common.current_rss_mb()
    tokenizer = common.load_tokenizer(tokenizer_path(), padding_side="left")
    path = model_dir(args["arch"])
    torch.manual_seed(args["seed"])
    model = AutoModelForCausalLM.from_pretrained(str(path))
    dataset = Dataset.from_dict({"prompt": prompts(args["prompt_words"])})
    phases = common.PhaseClock()
    judge, timer = GoldJudge(), step_timer(args.get("profile_step"), args.get("profile_file"), phases)
    Config, Trainer = classes(lib, method)
    with tempfile.TemporaryDirectory() as out_dir:
        config = Config(**config_kwargs(args, out_dir))
        trainer = Trainer(model=model, reward_funcs=judge, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
        tokens = time_phases(trainer, lib, tokenizer, phases)
        rss_setup = common.current_rss_mb()
        t = common.clock()
        trainer.train()
        train_seconds = common.clock() - t
    means = [sum(c) / len(c) for c in judge.calls]
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    kls = [float(h["kl"]) for h in logs if "kl" in h]
    result = {"lib": common.version_of(lib), "method": method, "seed": args["seed"], "steps": len(timer.seconds),
              "reward_calls": len(judge.calls), "completions_per_call": [len(c) for c in judge.calls][:1],
              "gold_first": means[0], "gold_last": means[-1], "gold_gain": means[-1] - means[0],
              "gold_first5": statistics.mean(means[:5]), "gold_last5": statistics.mean(means[-5:]),
              "gold_gain5": statistics.mean(means[-5:]) - statistics.mean(means[:5]), "gold_per_step": means,
              "kl_per_step": kls, "final_kl": kls[-1] if kls else None,
              "step_seconds": timer.seconds, "seconds_per_step": statistics.median(timer.seconds[1:] or timer.seconds),
              "train_seconds": train_seconds, "rss_after_imports_mb": rss_imports, "rss_after_setup_mb": rss_setup,
              "phase_seconds": phases.steps, "prompt_tokens": tokens["prompt"],
              "completion_tokens": tokens["completion"], "arch": args["arch"], "bf16": bool(args["bf16"]),
              "matmul_params": common.matmul_params(model)}
    if lib == "ours":  # whether generation ran the static decode (replayed graphs) or fell back, and why
        from rlhf_core.trainers.decode import DECODE_STATS

        result["decode_stats"] = DECODE_STATS
    common.emit(result)


if __name__ == "__main__":
    main()
