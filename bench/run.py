"""``make bench``: run the same workloads through rlhf_core (.venv) and classic TRL (bench/.trl-venv), and
the online workloads (GRPO, RLOO; GRPO on the arithmetic task) through rlhf_core and TRL 1.16.0 (bench/.trl116-venv).

    .venv/bin/python bench/run.py [--quick] [--only step,generate,memory,sentiment,online,arithmetic] [--repeats N]
                                  [--threads T]
                                  [--merge]   # keep the previous rows of the workloads not in --only

Every measurement is a fresh process running bench/workloads/<name>.py with ``--lib ours`` or
``--lib trl`` (``--lib trl116`` for online); the two libraries alternate (ours-first on even repeats, trl-first on odd ones) so
drifting machine load hits both alike. Results are medians; ratio = ours / TRL. Writes
bench/results.json (machine) and bench/results.md (human); each row holds the exact command.
The parity test (bench/test_parity.py) runs first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import common  # noqa: E402
import prepare  # noqa: E402
from workloads import arithmetic_grpo as arithmetic_task  # noqa: E402
from rlhf_core import cpu_allocator  # noqa: E402

PYTHONS = {"ours": ROOT / ".venv" / "bin" / "python", "trl": BENCH / ".trl-venv" / "bin" / "python",
           "trl116": BENCH / ".trl116-venv" / "bin" / "python"}
SETUP = {"trl": "bench/setup_trl_venv.sh", "trl116": "bench/setup_trl116_venv.sh"}
# workload -> the library it is compared with (default: classic TRL, "trl")
OTHER = {"online": "trl116", "arithmetic": "trl116"}

STEP = {"ppo_epochs": 4, "query_len": [8, 16], "response_len": [16, 32], "warmup": 1}
WORKLOADS = [
    # (a) PPOTrainer.step, full reference, classic ppo_epochs=4
    ("step", "tiny", {**STEP, "size": "tiny", "batch_size": 32, "mini_batch_size": 8, "steps": 4}),
    ("step", "mid", {**STEP, "size": "mid", "batch_size": 16, "mini_batch_size": 8, "steps": 3}),
    ("step", "gpt2s", {**STEP, "size": "gpt2s", "batch_size": 8, "mini_batch_size": 4, "steps": 2}),
    # rlhf_core's torch_compile opt-in (TRL eager, as above); two warm-up steps absorb the compilations
    ("step", "tiny", {**STEP, "size": "tiny", "batch_size": 32, "mini_batch_size": 8, "steps": 4, "warmup": 2,
                      "torch_compile": True}),
    # both libraries under the glibc settings rlhf_core applies itself on the CPU (rlhf_core/cpu_allocator.py),
    # given in the environment: how much of the lead is the allocator, how much the step
    *[("step", size, {**STEP, "size": size, "batch_size": bsz, "mini_batch_size": mb, "steps": steps,
                      "same_allocator": True})
      for size, bsz, mb, steps in (("mid", 16, 8, 3), ("gpt2s", 8, 4, 2))],
    # the same with bf16 autocast in both libraries (PPOConfig.accelerator_kwargs); skipped on a CPU without bf16 units
    ("step", "gpt2s", {**STEP, "size": "gpt2s", "batch_size": 8, "mini_batch_size": 4, "steps": 2,
                       "mixed_precision": "bf16"}),
    # ours with bf16 weights and fp32 master weights (PPOConfig.bf16_weights) against TRL's bf16 autocast
    ("step", "gpt2s", {**STEP, "size": "gpt2s", "batch_size": 8, "mini_batch_size": 4, "steps": 2,
                       "mixed_precision": "bf16", "bf16_weights": True}),
    # (b) generate at EQUAL batch sizes (4 and 64), same prompts and sampling, in both libraries
    *[("generate", size, {"size": size, "num_prompts": 64, "query_len": [4, 12], "max_new_tokens": 32,
                          "batch_size": bsz, "repeats": 3 if size == "tiny" else 1})
      for size in ("tiny", "gpt2s") for bsz in (4, 64)],
    # rlhf_core's prepacked_generation opt-in (weights packed once per call for oneDNN; not bit-exact)
    *[("generate", "gpt2s", {"size": "gpt2s", "num_prompts": 64, "query_len": [4, 12], "max_new_tokens": 32,
                             "batch_size": bsz, "repeats": 1, "prepacked_generation": True}) for bsz in (4, 64)],
    # (c) peak RSS of a short PPO run with a full / layer-sharing / LoRA reference
    *[("memory", size, {"size": size, "reference": ref, "num_shared_layers": n_shared, "batch_size": 8,
                        "mini_batch_size": 4, "ppo_epochs": 1, "steps": 2, "query_len": [8, 16],
                        "response_len": [16, 32]})
      for size, n_shared in (("tiny", 1), ("gpt2s", 6)) for ref in ("full", "shared", "lora")],
    # (d) real text: rt-polarity SFT policy, PPO towards positive VADER sentiment
    ("sentiment", "rt-sft", {"steps": 30, "batch_size": 32, "mini_batch_size": 8, "ppo_epochs": 4,
                             "learning_rate": 5e-5, "init_kl_coef": 0.2, "prompt_tokens": 4, "max_new_tokens": 16,
                             "gen_batch_size": 32, "eval_prompts": 128, "eval_samples": 2, "seeds": [0, 1]}),
    # (e) issue 14: GRPO and RLOO against TRL 1.16.0, 4x128 GPT-2, rt-polarity prompts, VADER gold reward
    *[("online", method, {"method": method, "steps": 40, "completions_per_step": 64, "num_generations": 8,
                          "learning_rate": 1e-4, "beta": 0.04, "max_completion_length": 20, "prompt_words": 4})
      for method in ("grpo", "rloo")],
    # (f) issue 32 point 5: GRPO with the exact-answer verifier on the arithmetic task's SFT policy (3x128 GPT-2),
    # ours against TRL 1.16.0, then held-out pass@1 of both trained policies by one evaluation (the folder's grpo
    # settings: pipelines/arithmetic/params.yaml)
    ("arithmetic", "sft-3x128", {"steps": 600, "learning_rate": 1.5e-4, "beta": 0.0, "per_device_train_batch_size": 64,
                                 "num_generations": 4, "max_completion_length": 32, "temperature": 1.0,
                                 "eval_problems": 64, "eval_samples": 8}),
]
QUICK = {"step": {"steps": 1}, "generate": {"repeats": 1}, "sentiment": {"steps": 3, "seeds": [0]},
         "online": {"steps": 6}, "arithmetic": {"steps": 6}}


FILES = {"step": "ppo_step", "arithmetic": "arithmetic_grpo"}  # workload name -> bench/workloads/<file>.py


def command(lib: str, workload: str, args: dict) -> list[str]:
    cmd = [str(PYTHONS[lib].relative_to(ROOT)), f"bench/workloads/{FILES.get(workload, workload)}.py", "--lib", lib]
    if workload == "online":  # the method is its own flag; the rest travels as JSON
        cmd += ["--method", args["method"]]
        args = {k: v for k, v in args.items() if k != "method"}
    if workload == "arithmetic":  # the trained policy goes where the evaluation reads it
        args = {**args, "save_dir": common.shown_path(arithmetic_dir(lib, args["seed"]))}
    return cmd + ["--args", json.dumps(args, separators=(",", ":"))]


# rlhf_core's own CPU allocator settings as environment variables, given to both libraries' processes in the
# "same_allocator" rows (rlhf_core then leaves malloc as given)
SAME_ALLOCATOR_ENV = cpu_allocator.ENVIRONMENT


def shown_command(lib: str, workload: str, args: dict) -> str:
    """The command of a row as a shell line, with the allocator environment it ran under."""
    env = [f"{k}={v}" for k, v in SAME_ALLOCATOR_ENV.items()] if args.get("same_allocator") else []
    return shlex.join([*env, *command(lib, workload, args)])


def run_one(lib: str, workload: str, args: dict) -> dict:
    cmd = command(lib, workload, args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args["threads"]), PYTHONHASHSEED="0")
    env = {k: v for k, v in env.items() if k not in SAME_ALLOCATOR_ENV}  # each row sets its own allocator
    if args.get("same_allocator"):
        env.update(SAME_ALLOCATOR_ENV)
    if lib == "ours":  # this checkout's rlhf_core, whatever the venv's editable install points at
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    load = os.getloadavg()[0]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(wall_seconds=time.time() - t, load_before=load)
    return result


def arithmetic_dir(lib: str, seed: int) -> Path:
    """Where workload (f) saves the policy ``lib`` trained with ``seed`` (replaced by each run)."""
    return common.CACHE_DIR.resolve() / "arithmetic" / f"{lib}-seed{seed}"


def evaluate_arithmetic(args: dict, seed: int) -> dict:
    """Workload (f)'s held-out pass@1 of the SFT policy and of both policies trained with ``seed``: one process
    (.venv), one sampler and verifier for all three."""
    models = {"sft": common.shown_path(arithmetic_task.task_paths()["sft"]),
              **{lib: common.shown_path(arithmetic_dir(lib, seed)) for lib in ("ours", OTHER["arithmetic"])}}
    eval_args = {k: args[k] for k in ("eval_problems", "eval_samples", "max_completion_length", "threads")}
    cmd = [str(PYTHONS["ours"].relative_to(ROOT)), "bench/workloads/arithmetic_grpo.py", "--evaluate",
           "--args", json.dumps({**eval_args, "models": models}, separators=(",", ":"))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args["threads"]), PYTHONHASHSEED="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "seed": seed, "command": shlex.join(cmd)}


def matmul_peak(threads: int, dtype: str = "float32") -> float:
    """Best observed matmul FLOP/s (2048^3, ``dtype``) with ``threads`` threads: the MFU denominator."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.randn(2048, 2048, dtype=getattr(torch, dtype)) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best


def forward_flops_per_token(arch: dict, width: int) -> float:
    """2 x (block weights + LM head) + attention scores/values over ``width`` keys, per token."""
    h, layers, vocab = arch["n_embd"], arch["n_layer"], arch["vocab_size"]
    return 2 * (12 * layers * h * h + h * vocab) + 4 * layers * width * h


def median(values):
    return statistics.median(values) if values else float("nan")


def summarise(workload: str, size: str, args: dict, runs: dict, peaks: dict) -> dict:
    """One results row: medians per library, ratio ours/trl, target and whether it is met."""
    row = {"workload": workload, "size": size, "settings": {k: v for k, v in args.items() if k != "threads"},
           "threads": args["threads"], "commands": {lib: shown_command(lib, workload, args) for lib in runs},
           "runs": runs, "libs": {lib: runs[lib][0].get("lib") for lib in runs}}
    med = {}
    if workload == "step":
        for lib, rs in runs.items():
            secs = median([s for r in rs for s in r["step_seconds"]])
            tokens = rs[0]["tokens_per_step"]
            arch = common.SIZES[size]
            width = rs[0]["padded_tokens_per_step"] / args["batch_size"]
            flops = tokens * forward_flops_per_token(arch, width) * (2 + 3 * args["ppo_epochs"])
            med[lib] = {"seconds_per_step": secs, "tokens_per_second": tokens / secs,
                        "model_flops_per_step": flops, "achieved_flops": flops / secs,
                        "mfu": flops / secs / peaks[args.get("mixed_precision") or "fp32"],
                        "first_step_seconds": median([r["warmup_seconds"][0] for r in rs if r.get("warmup_seconds")])}
        row["metric"], row["target_ratio"], row["better"] = "seconds_per_step", 0.5, "lower"
    elif workload == "generate":
        for lib, rs in runs.items():
            secs = [s for r in rs for s in r["seconds"]]
            toks = [t for r in rs for t in r["generated_tokens"]]
            med[lib] = {"seconds": median(secs), "tokens_per_second": median([t / s for t, s in zip(toks, secs)])}
        row["metric"] = "tokens_per_second"
        row["target_ratio"], row["better"] = 2.0, "higher"  # at equal batch size (issue 15 point 2)
    elif workload == "memory":
        for lib, rs in runs.items():
            med[lib] = {"peak_rss_mb": median([r["peak_rss_mb"] for r in rs]),
                        "rss_after_imports_mb": median([r["rss_after_imports_mb"] for r in rs]),
                        "rss_after_setup_mb": median([r["rss_after_setup_mb"] for r in rs])}
            med[lib]["peak_above_imports_mb"] = med[lib]["peak_rss_mb"] - med[lib]["rss_after_imports_mb"]
        row["metric"], row["target_ratio"], row["better"] = "peak_rss_mb", 1.0, "lower"
    elif workload == "sentiment":
        for lib, rs in runs.items():
            med[lib] = {"gold_gain": median([r["gold_gain"] for r in rs]), "mean_kl": median([r["mean_kl"] for r in rs]),
                        "final_kl": median([r["final_kl"] for r in rs]),
                        "gold_before": median([r["gold_before"] for r in rs]),
                        "gold_after": median([r["gold_after"] for r in rs]),
                        "kl_per_step": [median(k) for k in zip(*[r["kl_per_step"] for r in rs])],
                        "seconds": median([r["wall_seconds"] for r in rs])}
        row["metric"], row["target_ratio"], row["better"] = "gold_gain", 1.0, "higher"
    elif workload == "online":
        return summarise_online(row, runs)
    row["median"] = med
    if "ours" in med and "trl" in med:
        o, t = med["ours"][row["metric"]], med["trl"][row["metric"]]
        row["ratio"] = o / t if t else float("nan")
        target = row["target_ratio"]
        if workload == "sentiment":
            row["met"] = o >= t and med["ours"]["mean_kl"] <= med["trl"]["mean_kl"] * 1.05
        elif workload == "memory" and args["reference"] != "full" and size == "tiny":
            row["met"] = None  # a 0.15 M-parameter model: RSS is the libraries' baseline, nothing to share
        elif workload == "memory" and args["reference"] != "full":
            row["met"] = o <= t and o < med_full_cache.get((size, "ours"), float("inf")) * 0.9
        elif target is not None:
            row["met"] = row["ratio"] <= target if row["better"] == "lower" else row["ratio"] >= target
        else:
            row["met"] = None
    if workload == "memory" and args["reference"] == "full" and "ours" in med:
        med_full_cache[(size, "ours")] = med["ours"]["peak_rss_mb"]
    return row


med_full_cache: dict = {}

# issue 14 point 6: (key in the medians, target on ours / TRL 1.16, "higher"/"lower" is better)
ONLINE_TARGETS = [("gold_gain", "ours >= TRL", "higher"), ("seconds_per_step", "ours <= 0.5 x TRL", "lower"),
                  ("peak_rss_mb", "ours <= TRL", "lower")]


def summarise_online(row: dict, runs: dict) -> dict:
    """Medians over runs (one per seed) per library; each of the three targets met or missed, and by how much."""
    med = {}
    for lib, rs in runs.items():
        med[lib] = {key: median([r[key] for r in rs]) for key in
                    ("gold_first", "gold_last", "gold_gain", "gold_gain5", "seconds_per_step", "peak_rss_mb",
                     "rss_after_imports_mb", "train_seconds", "wall_seconds")}
        kls = [r["final_kl"] for r in rs if r.get("final_kl") is not None]
        med[lib]["final_kl"] = median(kls) if kls else None
        med[lib]["gold_per_step"] = [median(v) for v in zip(*[r["gold_per_step"] for r in rs])]
    row["median"], row["metric"], row["better"] = med, "gold_gain", "higher"
    base = {k: v for k, v in row["settings"].items() if k != "seeds"}  # the exact command of each run (one per seed)
    row["commands"] = {lib: " ; ".join(shlex.join(command(lib, "online", {**base, "threads": row["threads"], "seed": s}))
                                       for s in row["settings"].get("seeds", [0])) for lib in runs}
    o, t = med["ours"], med["trl116"]
    row["targets"] = {}
    for key, target, _better in ONLINE_TARGETS:
        ratio = o[key] / t[key] if t[key] else float("nan")
        if key == "gold_gain":
            met, short = o[key] >= t[key], t[key] - o[key]  # short: how much gain ours lacks (<= 0 when met)
        elif key == "seconds_per_step":
            met, short = ratio <= 0.5, o[key] - 0.5 * t[key]  # seconds over the 0.5x budget
        else:
            met, short = o[key] <= t[key], o[key] - t[key]  # MB over TRL's peak
        row["targets"][key] = {"ours": o[key], "trl116": t[key], "ratio": ratio, "target": target, "met": met,
                               "missed_by": None if met else short}
    row["ratio"] = o["gold_gain"] / t["gold_gain"] if t["gold_gain"] else float("nan")
    row["met"] = all(x["met"] for x in row["targets"].values())
    return row


def summarise_arithmetic(size: str, args: dict, runs: dict, evals: list[dict]) -> dict:
    """Workload (f)'s row: per library, medians over seeds of held-out pass@1 before (the SFT policy) and after
    training, its gain, the training reward of the first and last 10 steps and seconds per step; ratio = ours / TRL
    s/step. ``evals``: one evaluation per seed (``evaluate_arithmetic``)."""
    row = {"workload": "arithmetic", "size": size, "settings": {k: v for k, v in args.items() if k != "threads"},
           "threads": args["threads"], "runs": runs, "libs": {lib: runs[lib][0].get("lib") for lib in runs}}
    other = OTHER["arithmetic"]
    before = median([e["sft"]["pass@1"] for e in evals])
    med = {}
    for lib, rs in runs.items():
        after = [e[lib]["pass@1"] for e in evals]
        med[lib] = {"pass@1_before": before, "pass@1_after": median(after),
                    "pass@1_gain": median([e[lib]["pass@1"] - e["sft"]["pass@1"] for e in evals]),
                    **{key: median([r[key] for r in rs]) for key in
                       ("reward_first10", "reward_last10", "seconds_per_step", "train_seconds", "peak_rss_mb")}}
    base = {k: v for k, v in row["settings"].items() if k != "seeds"}
    # the task folder the runs read when it is another checkout's (ARITHMETIC_DIR), in front of every command
    env = f"ARITHMETIC_DIR={shlex.quote(os.environ['ARITHMETIC_DIR'])} " if "ARITHMETIC_DIR" in os.environ else ""
    row["commands"] = {lib: " ; ".join(env + shlex.join(command(lib, "arithmetic", {**base, "threads": row["threads"],
                                                                                     "seed": s}))
                                       for s in row["settings"].get("seeds", [0])) for lib in runs}
    row["commands"]["evaluate"] = " ; ".join(env + e["command"] for e in evals)
    row["evaluations"] = evals
    row["median"], row["metric"], row["better"] = med, "seconds_per_step", "lower"
    o, t = med["ours"][row["metric"]], med[other][row["metric"]]
    row["ratio"], row["met"] = (o / t if t else float("nan")), None  # a side-by-side, no target (issue 32 point 5)
    return row


def run_parity() -> dict:
    cmd = [str(PYTHONS["ours"].relative_to(ROOT)), "-m", "pytest", "bench/test_parity.py", "-q", "-p", "no:cacheprovider"]
    t = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    return {"command": shlex.join(cmd), "passed": proc.returncode == 0, "summary": summary,
            "seconds": time.time() - t, "output": proc.stdout[-3000:]}


def merge_previous(report: dict, path: Path, only: set) -> dict:
    """``--merge``: carry over from the previous results.json the rows (and parity) of the workloads not run
    now, each labelled with the run it came from, so a partial run keeps the rest of the table."""
    if not path.exists():
        return report
    old = json.loads(path.read_text())
    source = {"date": old["machine_start"]["date"], "loadavg_start": old["machine_start"]["loadavg"],
              "loadavg_end": old["machine_end"]["loadavg"], "matmul_peak_flops": old.get("matmul_peak_flops"),
              "matmul_peak_flops_bf16": old.get("matmul_peak_flops_bf16")}
    carried = [row for row in old.get("rows", []) if row["workload"] not in only]
    for row in carried:
        row.setdefault("measured_in", source)
    report["rows"] = carried + report["rows"]
    if "parity" not in only and "parity" in old:
        report["parity"] = {**old["parity"], "measured_in": old["parity"].get("measured_in", source)}
    report["carried_over"] = sorted({row["workload"] for row in carried} | ({"parity"} if "parity" in report
                                                                              and "parity" not in only else set()))
    return report


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one short repeat of everything (harness check)")
    parser.add_argument("--only", default="parity,step,generate,memory,sentiment,online,arithmetic")
    parser.add_argument("--repeats", type=int, default=2, help="processes per library per workload (alternating)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (1: robust on a shared machine)")
    parser.add_argument("--out", default=str(BENCH / "results"))
    parser.add_argument("--merge", action="store_true",
                        help="keep the previous results' rows of the workloads not in --only (labelled with their run)")
    opts = parser.parse_args()
    only = set(opts.only.split(","))
    needed = {"ours"} | {OTHER.get(w, "trl") for w, _, _ in WORKLOADS if w in only} | ({"trl"} if "parity" in only else set())
    for lib in sorted(needed):
        if not PYTHONS[lib].exists():
            sys.exit(f"missing {PYTHONS[lib]}: run `bash {SETUP.get(lib, 'bench/setup_trl_venv.sh')}` (make bench does)")
    t0 = time.time()
    info = prepare.main(sentiment="sentiment" in only, models=bool(only & {"parity", "step", "generate", "memory"}))
    report = {"machine_start": machine(), "prepare": info, "threads": opts.threads, "repeats": opts.repeats,
              "quick": opts.quick, "matmul_peak_flops": matmul_peak(opts.threads),
              "rows": []}
    # the bf16 peak is the MFU denominator of the bf16 step row only (slow to measure on a CPU without AMX)
    if "step" in only and common.cpu_has_bf16_units():
        report["matmul_peak_flops_bf16"] = matmul_peak(opts.threads, "bfloat16")
    print(f"matmul peak: {report['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, load {os.getloadavg()}", flush=True)
    if "parity" in only:
        report["parity"] = run_parity()
        print(f"parity: {report['parity']['summary']}", flush=True)
    for workload, size, args in WORKLOADS:
        if workload not in only:
            continue
        args = {**args, "threads": opts.threads}
        if opts.quick:
            args.update(QUICK.get(workload, {}))
        if args.get("mixed_precision") == "bf16" and not common.cpu_has_bf16_units():
            report["rows"].append({"workload": workload, "size": size, "settings": args, "skipped":
                                   "this CPU has no bf16 matmul units (no AVX512-BF16/AMX): torch emulates bf16, so a bf16 "
                                   "step measures the emulation, not the precision"})
            continue
        if workload == "arithmetic":
            try:
                arithmetic_task.task_paths()
            except FileNotFoundError as e:  # a fresh clone without the arithmetic pipeline's outputs
                report["rows"].append({"workload": workload, "size": size, "settings": args, "skipped": str(e)})
                print(f"arithmetic skipped: {e}", flush=True)
                continue
        if workload == "sentiment" and "skipped" in info.get("sft", {}):
            report["rows"].append({"workload": workload, "size": size, "skipped": info["sft"]["skipped"]})
            continue
        repeats = 1 if (opts.quick or workload in ("memory", "sentiment")) else opts.repeats
        seeds = args.pop("seeds", [None])
        if workload in ("online", "arithmetic"):  # one run per library per seed: repeat r uses seed r
            seeds, repeats = list(range(repeats)), 1
        other = OTHER.get(workload, "trl")
        runs: dict[str, list] = {"ours": [], other: []}
        for rep in range(repeats):
            for seed in seeds:
                order = ("ours", other) if (rep + (seed or 0)) % 2 == 0 else (other, "ours")
                for lib in order:
                    run_args = args if seed is None else {**args, "seed": seed}
                    runs[lib].append(run_one(lib, workload, run_args))
        if workload == "arithmetic":  # both trained policies of each seed, scored by one evaluation process
            evals = [evaluate_arithmetic(args, seed) for seed in seeds]
            row = summarise_arithmetic(size, {**args, "seeds": seeds}, runs, evals)
        else:
            row = summarise(workload, size, args if seeds == [None] else {**args, "seeds": seeds}, runs,
                            {"fp32": report["matmul_peak_flops"], "bf16": report.get("matmul_peak_flops_bf16")})
        report["rows"].append(row)
        if workload == "online":
            print(f"online    {size:6s} " + "; ".join(
                f"{k}: ours {v['ours']:.4g} trl116 {v['trl116']:.4g} met={v['met']}" for k, v in row["targets"].items())
                  + f" load={os.getloadavg()[0]:.2f}", flush=True)
            continue
        if workload == "arithmetic":
            print("arithmetic " + "; ".join(f"{lib}: pass@1 {m['pass@1_before']:.4f} -> {m['pass@1_after']:.4f}, "
                                            f"{m['seconds_per_step']:.3f} s/step" for lib, m in row["median"].items())
                  + f" load={os.getloadavg()[0]:.2f}", flush=True)
            continue
        print(f"{workload:9s} {size:6s} {row['metric']}: ours {row['median']['ours'][row['metric']]:.4g} "
              f"trl {row['median']['trl'][row['metric']]:.4g} ratio {row.get('ratio', float('nan')):.3f} "
              f"met={row.get('met')} load={os.getloadavg()[0]:.2f}", flush=True)
    report["machine_end"] = machine()
    report["total_seconds"] = time.time() - t0
    out = Path(opts.out)
    if opts.merge:
        report = merge_previous(report, out.with_suffix(".json"), only)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
    import report as report_md

    out.with_suffix(".md").write_text(report_md.render(report))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {report['total_seconds']:.0f} s")
    if "parity" in report and not report["parity"]["passed"]:
        sys.exit("parity test failed")


if __name__ == "__main__":
    main()
