"""Workload (f): GRPO on the arithmetic task with a verifier reward, rlhf_core against TRL 1.16.0 (issue 32 point 5).

    python bench/workloads/arithmetic_grpo.py --lib ours|trl116 --args '{"steps": 200, "seed": 0, ...}'
    .venv/bin/python bench/workloads/arithmetic_grpo.py --evaluate --args '{"models": {"sft": DIR, ...}}'

A workload of its own rather than a mode of online.py: that one builds a random policy over the rt-polarity
tokenizer and rewards sentiment; this one starts from a trained policy, feeds two dataset columns (``prompt``,
``solution``) and needs a held-out evaluation after training, so almost every function would branch.

Training (``--lib``): both stacks load the arithmetic pipeline's SFT policy (``models/sft`` of the task folder, a
save_pretrained GPT-2 with its tokenizer; ``make run TASK=arithmetic`` makes it) and train GRPO on the first
``steps x prompts-per-step`` problems of its ``data/prompts_train.jsonl`` in file order (``shuffle_dataset`` off on
both sides, so both see the same problems in the same order), with the same config fields and seed. The reward is
one function used by both: rlhf_core's own answer rules (``rlhf_core/rewards/answers.py``, loaded by path because
the TRL venv does not install rlhf_core; that file imports only the standard library), 1.0 when the stated
answer equals the solution, as ``rlhf_core.rewards.accuracy_reward``. The trained policy is saved to ``"save_dir"``.
Prints one JSON line: the mean reward of each step, seconds per step (median after the first) and the save dir.
``"positions_from_mask": true`` (trl116 only) is a diagnostic: TRL 1.16 with position ids from the attention mask
(``positions_from_mask``), which makes it train as ours does (docs/bench.md).

Evaluation (``--evaluate``, in .venv only): every policy directory of ``"models"`` is sampled on the same held-out
problems (the task's ``data/prompts_eval.jsonl``) with the same seeded sampler (``rlhf_core.evaluation``:
``sample_responses``, then ``verify_samples`` for pass@1), as the pipeline's verified evaluate stage does, so the
two trained policies are measured by one piece of code.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import online  # noqa: E402  (its step timer: one TrainerCallback for both trainers)

ROOT = Path(__file__).resolve().parents[2]
# The arithmetic pipeline's folder (its SFT policy and problems); ARITHMETIC_DIR points at another checkout's.
TASK_DIR = Path(os.environ.get("ARITHMETIC_DIR", ROOT / "pipelines" / "arithmetic"))
DEFAULTS = {"steps": 600, "seed": 0, "learning_rate": 1.5e-4, "beta": 0.0, "per_device_train_batch_size": 64,
            "num_generations": 4, "max_completion_length": 32, "temperature": 1.0, "threads": 1,
            "eval_problems": 64, "eval_samples": 8, "eval_seed": 0}


def load_answers():
    """rlhf_core/rewards/answers.py as a standalone module (standard library only; no rlhf_core package import)."""
    path = ROOT / "rlhf_core" / "rewards" / "answers.py"
    spec = importlib.util.spec_from_file_location("bench_arithmetic_answers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ExactAnswer:
    """The reward of both trainers (TRL 1.16's contract: ``completions`` and every dataset column as keywords):
    1.0 when the completion's stated answer equals ``solution`` exactly, else 0.0; records each call's mean, and a
    digest of the first call's completions (equal digests: both stacks sampled the same first-step completions)."""

    __name__ = "accuracy"

    def __init__(self):
        self.answers = load_answers()
        self.means: list[float] = []
        self.first_digest: str | None = None

    def score(self, completion, solution) -> float:
        a = self.answers
        gold = a.gold_answer(solution)
        if gold is None:
            raise ValueError(f"solution {solution!r} has no readable number")
        value = a.parse_number(a.extract_answer(a.completion_text(completion)))
        return float(value is not None and value == gold)

    def __call__(self, completions, solution, **kwargs):
        scores = [self.score(c, s) for c, s in zip(completions, solution, strict=True)]
        if self.first_digest is None:
            texts = "\0".join(self.answers.completion_text(c) for c in completions)
            self.first_digest = hashlib.md5(texts.encode()).hexdigest()
        self.means.append(sum(scores) / len(scores))
        return scores


def task_paths(task_dir: Path = TASK_DIR) -> dict:
    """The SFT policy and problem files of the arithmetic task; a clear error when the pipeline has not run."""
    paths = {"sft": task_dir / "models" / "sft", "train": task_dir / "data" / "prompts_train.jsonl",
             "eval": task_dir / "data" / "prompts_eval.jsonl"}
    missing = [str(p) for p in paths.values() if not p.exists()]
    if missing or not (paths["sft"] / "config.json").exists():
        raise FileNotFoundError(f"arithmetic task outputs missing: {missing or [str(paths['sft'] / 'config.json')]}; "
                                f"run `make run TASK=arithmetic` there, or set ARITHMETIC_DIR to a folder that has them")
    return paths


def read_problems(path: Path, limit: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if len(rows) == limit:
                break
            row = json.loads(line)
            if "query" not in row or "solution" not in row:
                raise ValueError(f"{path}:{n}: a problem needs 'query' and 'solution', got {sorted(row)}")
            rows.append(row)
    return rows


def config_kwargs(args: dict, out_dir: str) -> dict:
    """One GRPO config for both libraries (TRL 1.16 names), the fields whose defaults could differ spelled out:
    TRL 1.16's GRPOConfig defaults to bf16=True and activation checkpointing even on the CPU, ours to neither."""
    import torch

    return dict(output_dir=out_dir, report_to="none", max_steps=args["steps"], logging_steps=1, save_strategy="no",
                seed=args["seed"], learning_rate=args["learning_rate"], beta=args["beta"],
                per_device_train_batch_size=args["per_device_train_batch_size"],
                num_generations=args["num_generations"], max_completion_length=args["max_completion_length"],
                temperature=args["temperature"], top_k=0, top_p=1.0, shuffle_dataset=False, loss_type="dapo",
                scale_rewards="group", num_iterations=1, epsilon=0.2, mask_truncated_completions=False,
                bf16=False, gradient_checkpointing=False, use_vllm=False, disable_dropout=True,
                use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)


def positions_from_mask() -> None:
    """Diagnostic (``"positions_from_mask": true``, trl116 only): every GPT-2 forward without ``position_ids`` gets
    them from its attention mask. TRL 1.16's log-prob forward passes none, so a left-padded prompt is scored at
    positions shifted by its padding (GPT-2's position embeddings are absolute) while it was sampled at the
    mask's positions; rlhf_core builds them from the mask. With this on, TRL 1.16's first update equals ours."""
    from transformers import GPT2Model

    forward = GPT2Model.forward

    def with_positions(self, input_ids=None, past_key_values=None, attention_mask=None, position_ids=None, **kwargs):
        if position_ids is None and attention_mask is not None and past_key_values is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return forward(self, input_ids=input_ids, past_key_values=past_key_values, attention_mask=attention_mask,
                       position_ids=position_ids, **kwargs)

    GPT2Model.forward = with_positions


def train(lib: str, args: dict) -> dict:
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    paths = task_paths()
    prompts_per_step = args["per_device_train_batch_size"] // args["num_generations"]
    rows = read_problems(paths["train"], args["steps"] * prompts_per_step)
    dataset = Dataset.from_dict({"prompt": [r["query"] for r in rows], "solution": [r["solution"] for r in rows]})
    tokenizer = AutoTokenizer.from_pretrained(str(paths["sft"]), padding_side="left")
    torch.manual_seed(args["seed"])
    model = AutoModelForCausalLM.from_pretrained(str(paths["sft"]))
    reward, timer = ExactAnswer(), online.step_timer()
    if args.get("positions_from_mask"):
        positions_from_mask()
    Config, Trainer = online.classes(lib, "grpo")
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = Trainer(model=model, reward_funcs=reward, args=Config(**config_kwargs(args, out_dir)),
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[timer])
        t = common.clock()
        trainer.train()
        train_seconds = common.clock() - t
    save_dir = Path(args["save_dir"])
    trainer.model.save_pretrained(str(save_dir))
    tokenizer.save_pretrained(str(save_dir))
    return {"lib": common.version_of(lib), "seed": args["seed"], "steps": len(timer.seconds),
            "task_dir": common.shown_path(TASK_DIR), "save_dir": str(save_dir), "reward_per_step": reward.means,
            "positions_from_mask": bool(args.get("positions_from_mask")),
            "first_step_completions_md5": reward.first_digest,
            "reward_first10": statistics.mean(reward.means[:10]), "reward_last10": statistics.mean(reward.means[-10:]),
            "step_seconds": timer.seconds, "seconds_per_step": statistics.median(timer.seconds[1:] or timer.seconds),
            "train_seconds": train_seconds}


def evaluate(args: dict) -> dict:
    """Held-out pass@1 of every policy in ``args["models"]`` (name -> directory), one sampler and verifier."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_core.evaluation import sample_responses, verify_samples

    paths = task_paths()
    rows = read_problems(paths["eval"], args["eval_problems"])
    n = args["eval_samples"]
    tokenizer = AutoTokenizer.from_pretrained(str(paths["sft"]))
    prompts = [r["query"] for r in rows for _ in range(n)]
    result = {"eval_problems": len(rows), "eval_samples": n, "task_dir": common.shown_path(TASK_DIR)}
    for name, directory in args["models"].items():
        model = AutoModelForCausalLM.from_pretrained(str(directory))
        samples = sample_responses(model, tokenizer, prompts, args["max_completion_length"], 64, args["eval_seed"])
        groups = range(len(rows))
        report = verify_samples([str(r.get("id", i)) for i, r in enumerate(rows)], [r["solution"] for r in rows],
                                [samples.responses[i * n:(i + 1) * n] for i in groups],
                                [[len(x) for x in samples.response_ids[i * n:(i + 1) * n]] for i in groups], [1])
        result[name] = {"pass@1": report.metrics["pass@1"], "dir": str(directory)}
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=("ours", "trl116"))
    parser.add_argument("--evaluate", action="store_true", help="score the policies of args['models'] (in .venv)")
    parser.add_argument("--args", default="{}", help="workload arguments as a JSON object")
    ns = parser.parse_args()
    if bool(ns.lib) == ns.evaluate:
        parser.error("give exactly one of --lib and --evaluate")
    args = {**DEFAULTS, **json.loads(ns.args)}
    if ns.lib and "save_dir" not in args:
        parser.error("--args needs 'save_dir': where the trained policy is saved for the evaluation")
    if args.get("positions_from_mask") and ns.lib != "trl116":
        parser.error("'positions_from_mask' is a diagnostic of --lib trl116 (rlhf_core builds them from the mask)")
    if ns.evaluate and not args.get("models"):
        parser.error("--evaluate needs 'models' in --args: {name: policy directory}")
    import torch

    torch.set_num_threads(int(args["threads"]))
    common.emit(evaluate(args) if ns.evaluate else train(ns.lib, args))


if __name__ == "__main__":
    main()
