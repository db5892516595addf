"""The GPU bench's plan and its runner (standard library only; started by ``bench/gpu/run.sh``).

Every row is a fresh process running one of ``bench/workloads/*.py`` with one library's environment (its
``--target`` folder first on ``PYTHONPATH``, or its own interpreter), under ``timeout``, within a global deadline.
Rows run in priority order: the target rows first (generate ours / classic TRL / transformers; the PPO step at
its default against TRL's bf16 peer; GRPO and RLOO in bf16 against TRL 1.16), then the Qwen2-0.5B rows, then the
rest, then what time allows (second runs in the opposite order, an fp32 generate of ours). A row is started only
while ``min_s`` seconds are left; what ran is written to the results JSON (and, when ``OUT`` is set, copied
there with the log) after every row, so a run cut short keeps what finished. ``SMOKE=1``: the same rows at tiny
sizes (a CPU can run them).

Environment (run.sh sets it): DEADLINE (epoch seconds), RESULTS (path prefix of the .json/.md), BENCH_CACHE,
PY_<LIB> and SITE_<LIB> for LIB in OURS, TRL, TRL116 (interpreter; folder put first on PYTHONPATH, may be empty),
THREADS (torch threads per process), SMOKE, OUT (the device tool's folder that comes back), LOG (run.sh's log),
PASSES (1: no second-pass rows), ONLY (comma-separated row labels: run just those rows, e.g. a rerun of the failed).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SMOKE = os.environ.get("SMOKE") == "1"
THREADS = int(os.environ.get("THREADS", "1" if SMOKE else "8"))
FILES = {"step": "ppo_step", "generate": "generate", "online": "online", "ppo_loop": "ppo_loop", "parity": "parity",
         "decode_parity": "decode_parity"}
ENV_OF = {"ours": "OURS", "hf": "OURS", "trl": "TRL", "trl116": "TRL116"}


@dataclass
class Row:
    """One measurement: ``workload`` (a key of FILES) run by ``lib`` with ``args``."""

    label: str
    workload: str
    lib: str
    args: dict
    timeout_s: int
    min_s: int
    method: str | None = None
    second: bool = False
    """A second-pass row: run only with time left, and only when PASSES is not 1."""


GPU_SIZES = {
    # PPO step on GPT-2 small's shape: batch 64, mini-batch 16, 4 epochs, queries 48-64 / responses 96-128 tokens
    "step": {"size": "gpt2s", "batch_size": 64, "mini_batch_size": 16, "ppo_epochs": 4, "query_len": [48, 64],
             "response_len": [96, 128], "warmup": 4, "steps": 5},
    # generate: 64 prompts of 4-12 tokens in one batch, 128 new tokens each, one warm-up call (graph capture)
    "gen": {"size": "gpt2s", "num_prompts": 64, "batch_size": 64, "query_len": [4, 12], "max_new_tokens": 128,
            "warmup": 1, "repeats": 3},
    # GRPO / RLOO: GPT-2-small shape over the 2048-token rt-polarity vocabulary, 64 completions (8 per prompt)
    "online": {"arch": "gpt2s", "steps": 5, "completions_per_step": 64, "num_generations": 8,
               "max_completion_length": 64},
    # Qwen2-0.5B's shape, bf16 mixed precision: 64 completions (8 per prompt) of 128 tokens
    "qwen": {"arch": "qwen2-0.5b", "steps": 4, "completions_per_step": 64, "num_generations": 8,
             "max_completion_length": 128, "learning_rate": 1e-6, "bf16": True},
    # whole PPO iterations on it: 64 prompts, 128 new tokens, mini-batch 16, 4 epochs
    "loop": {"arch": "qwen2-0.5b", "batch_size": 64, "mini_batch_size": 16, "ppo_epochs": 4, "max_new_tokens": 128,
             "steps": 2, "warmup": 1, "mixed_precision": "bf16"},
    "parity": {"size": "tiny", "kl_penalty": "kl"},
}
# SMOKE=1: the same arguments with tiny values (a CPU runs every row in seconds)
SMOKE_SIZES = {
    "step": {"size": "tiny", "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1, "query_len": [4, 8],
             "response_len": [8, 16], "warmup": 1, "steps": 1},
    "gen": {"size": "tiny", "num_prompts": 8, "batch_size": 8, "query_len": [4, 8], "max_new_tokens": 16,
            "repeats": 1},
    "online": {"arch": "4x128", "steps": 2, "completions_per_step": 8, "num_generations": 4,
               "max_completion_length": 8},
    "qwen": {"arch": "qwen2-tiny", "steps": 2, "completions_per_step": 8, "num_generations": 4,
             "max_completion_length": 8},
    "loop": {"arch": "qwen2-tiny", "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 8,
             "steps": 1},
}


def sizes() -> dict[str, dict]:
    """Each workload's arguments: the GPU's (the baseline's shapes where there is one), or the smoke run's."""
    return {name: {**args, **(SMOKE_SIZES.get(name, {}) if SMOKE else {}), "threads": THREADS}
            for name, args in GPU_SIZES.items()}


def plan() -> list[Row]:
    """The rows in the order they run: first every workload once (ours and the peer alternating which goes first),
    then (unless ``PASSES=1``) second runs in the other order, as time allows."""
    s = sizes()
    bf16 = {**s["step"], "mixed_precision": "bf16"}
    gen_bf16 = {**s["gen"], "mixed_precision": "bf16", "bf16_weights": "default"}  # what a user gets
    rows = [  # in priority order: a run short of time skips the last ones
        # the targets: generate (>= 10x classic TRL, >= 4x transformers bf16), the PPO step at its default against
        # TRL's bf16 (issue 23: bf16 weights, fp32 masters on a GPU; 4 warm-ups, 5 timed steps each), GRPO and
        # RLOO in bf16 (what both libraries pick on a GPU by default; TRL 1.16: bf16 unless fp16)
        Row("generate", "generate", "ours", gen_bf16, 90, 30),
        Row("generate", "generate", "trl", s["gen"], 90, 30),
        Row("generate", "generate", "hf", {**s["gen"], "hf_dtype": "bf16"}, 90, 30),
        # correctness of that decode on the device: every greedy token the fp32 full forward's first choice
        Row("decode parity fp32", "decode_parity", "ours", {**s["gen"], "precision": "fp32"}, 90, 30),
        Row("decode parity default", "decode_parity", "ours", {**s["gen"], "precision": "default"}, 90, 30),
        Row("ppo default", "step", "ours", {**s["step"], "bf16_weights": "default"}, 120, 45),
        Row("ppo bf16", "step", "trl", bf16, 120, 45),
        Row("grpo bf16", "online", "ours", {**s["online"], "bf16": True}, 90, 35, "grpo"),
        Row("grpo bf16", "online", "trl116", {**s["online"], "bf16": True}, 90, 35, "grpo"),
        Row("rloo bf16", "online", "trl116", {**s["online"], "bf16": True}, 90, 35, "rloo"),
        Row("rloo bf16", "online", "ours", {**s["online"], "bf16": True}, 90, 35, "rloo"),
        # the real size: Qwen2-0.5B's shape
        Row("qwen2-0.5b grpo", "online", "ours", s["qwen"], 120, 50, "grpo"),
        Row("qwen2-0.5b grpo", "online", "trl116", s["qwen"], 120, 50, "grpo"),
        Row("qwen2-0.5b ppo default", "ppo_loop", "ours", {**s["loop"], "bf16_weights": "default"}, 120, 50),
        Row("qwen2-0.5b ppo", "ppo_loop", "ours", s["loop"], 120, 50),
        # the rest: fp32 and the other precisions
        Row("ppo fp32", "step", "trl", s["step"], 120, 45),
        Row("ppo fp32", "step", "ours", s["step"], 120, 45),
        Row("ppo bf16", "step", "ours", bf16, 120, 45),
        Row("ppo bf16 weights", "step", "ours", {**bf16, "bf16_weights": True}, 120, 45),
        Row("grpo", "online", "ours", s["online"], 90, 35, "grpo"),
        Row("grpo", "online", "trl116", s["online"], 90, 35, "grpo"),
        Row("rloo", "online", "trl116", s["online"], 90, 35, "rloo"),
        Row("rloo", "online", "ours", s["online"], 90, 35, "rloo"),
        Row("parity", "parity", "ours", s["parity"], 60, 20),
        Row("parity", "parity", "trl", s["parity"], 60, 20),
        # second pass: the same pairs in the other order, and ours' fp32 generate
        Row("generate", "generate", "trl", s["gen"], 90, 30, second=True),
        Row("generate", "generate", "ours", gen_bf16, 90, 30, second=True),
        Row("generate fp32", "generate", "ours", s["gen"], 90, 30, second=True),
        Row("ppo fp32", "step", "ours", s["step"], 100, 45, second=True),
        Row("ppo fp32", "step", "trl", s["step"], 100, 45, second=True),
        Row("qwen2-0.5b grpo", "online", "trl116", s["qwen"], 120, 50, "grpo", second=True),
        Row("qwen2-0.5b grpo", "online", "ours", s["qwen"], 120, 50, "grpo", second=True),
    ]
    rows = [r for r in rows if not (r.second and os.environ.get("PASSES") == "1")]
    only = {label.strip() for label in os.environ.get("ONLY", "").split(",") if label.strip()}
    return [r for r in rows if r.label in only] if only else rows


def environment(lib: str) -> tuple[str, dict]:
    """The interpreter and environment of ``lib``'s processes."""
    key = ENV_OF[lib]
    site = os.environ.get(f"SITE_{key}", "")
    path = [site] if site else []
    if key == "OURS":
        path.append(str(ROOT))  # this checkout's rlhf_core
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": str(THREADS),
           "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    return os.environ.get(f"PY_{key}", sys.executable), env


def command(row: Row, args: dict | None = None) -> list[str]:
    python, _ = environment(row.lib)
    cmd = [python, str(ROOT / "bench" / "workloads" / f"{FILES[row.workload]}.py"), "--lib", row.lib]
    if row.method:
        cmd += ["--method", row.method]
    return cmd + ["--args", json.dumps(args if args is not None else row.args, separators=(",", ":"))]


def left() -> float:
    return float(os.environ["DEADLINE"]) - time.time()


def run(row: Row, parity_dir: Path) -> dict:
    """Run one row (or record why not); the row's record for the results file."""
    record = {"label": row.label, "workload": row.workload, "lib": row.lib, "method": row.method, "args": row.args}
    if left() < row.min_s:
        return {**record, "skipped": f"{left():.0f} s left, needs {row.min_s} s"}
    args = {**row.args, "out": str(parity_dir)} if row.workload == "parity" else row.args
    limit = int(max(5, min(row.timeout_s, left() - 3)))
    cmd = command(row, args)
    _, env = environment(row.lib)
    start = time.time()
    proc = subprocess.run(["timeout", "-k", "5", str(limit), *cmd], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    record.update(rc=proc.returncode, wall_s=round(time.time() - start, 2), timeout_s=limit,
                  command=shlex.join(cmd))
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (IndexError, ValueError):
        result = None
    if result is None:
        record["error"] = proc.stderr[-4000:]
    else:
        record.update(result=result, device=result.get("device"))
    return record


def parity_record(parity_dir: Path) -> dict | None:
    """Max |ours - classic TRL| over the parity rows' stats and updated weights (None unless both ran)."""
    paths = {lib: (parity_dir / f"{lib}.json", parity_dir / f"{lib}.safetensors") for lib in ("ours", "trl")}
    if not all(p.exists() for pair in paths.values() for p in pair):
        return None
    script = ("import json, sys; from safetensors.torch import load_file\n"
              "d = sys.argv[1]; a, b = (json.load(open(f'{d}/{x}.json')) for x in ('ours', 'trl'))\n"
              "s = {k: abs(a[k] - b[k]) for k in b if k != 'objective/kl_dist'}\n"
              "k = max(abs(x - y) for x, y in zip(a['objective/kl_dist'], b['objective/kl_dist']))\n"
              "wa, wb = (load_file(f'{d}/{x}.safetensors') for x in ('ours', 'trl'))\n"
              "w = {n: (wa[n].float() - wb[n].float()).abs().max().item() for n in wb}\n"
              "print(json.dumps({'stats_max_abs_diff': max(s.values()), 'stats_worst': max(s, key=s.get),\n"
              "  'kl_dist_max_abs_diff': k, 'weights_max_abs_diff': max(w.values()), 'same_keys': set(wa) == set(wb)}))")
    python, env = environment("ours")
    proc = subprocess.run([python, "-c", script, str(parity_dir)], env=env, capture_output=True, text=True, timeout=60)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-2000:]}


CHECK = {  # per library set: what must import, and the modules whose versions are recorded
    "ours": ("from rlhf_core import PPOTrainer, GRPOTrainer, RLOOTrainer",
             ("torch", "transformers", "accelerate", "datasets", "peft", "tokenizers")),
    "trl": ("from trl import PPOTrainer, AutoModelForCausalLMWithValueHead",
            ("torch", "transformers", "accelerate", "datasets", "trl", "tokenizers")),
    "trl116": ("from trl import GRPOTrainer, RLOOTrainer",
               ("torch", "transformers", "accelerate", "datasets", "trl", "tokenizers")),
}


def check_environments() -> dict:
    """Each library set's versions (and where its transformers comes from), or its import error (in parallel)."""
    procs = {}
    for lib, (imports, modules) in CHECK.items():
        python, env = environment(lib)
        script = (f"{imports}\nimport importlib, json\nmods = {{m: importlib.import_module(m) for m in {modules!r}}}\n"
                  "print(json.dumps({m: getattr(x, '__version__', '?') for m, x in mods.items()}"
                  " | {'transformers_from': mods['transformers'].__file__}))")
        procs[lib] = subprocess.Popen([python, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    out = {}
    for lib, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        out[lib] = json.loads(stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": stderr[-2000:]}
        print(f"environment {lib}: {out[lib]}", flush=True)
    return out


def in_ours(script: list[str], timeout: float) -> subprocess.CompletedProcess:
    python, env = environment("ours")
    return subprocess.run([python, *script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def prepare_in_background(archs: str) -> subprocess.Popen:
    """Build the big online checkpoint while the GPT-2 rows run (CPU work, written atomically)."""
    python, env = environment("ours")
    return subprocess.Popen([python, str(HERE / "prepare_inputs.py"), "--archs", archs], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main() -> None:
    results_path = Path(os.environ["RESULTS"]).with_suffix(".json")
    results_path.parent.mkdir(parents=True, exist_ok=True)
    parity_dir = Path(os.environ.get("BENCH_CACHE", "/tmp")) / "parity"
    report = {"smoke": SMOKE, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "threads": THREADS,
              "environments": check_environments(), "rows": []}
    if "error" in report["environments"]["ours"]:
        save(report, results_path)
        sys.exit("the rlhf_core environment does not import: see environments.ours in " + str(results_path))
    probe = in_ours([str(HERE / "probe.py")] + (["--smoke"] if SMOKE else []), 120)
    report["probe"] = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else {
        "error": probe.stderr[-2000:]}
    qwen = sizes()["qwen"]["arch"]
    ready = in_ours([str(HERE / "prepare_inputs.py"), "--sizes", "tiny,gpt2s" if not SMOKE else "tiny",
                     "--archs", sizes()["online"]["arch"]], 300)
    print(ready.stdout.strip() or ready.stderr[-2000:], flush=True)
    background = prepare_in_background(qwen)
    save(report, results_path)  # the environments and the probe, before the first row
    for row in plan():
        if row.label.startswith("qwen2") and background.poll() is None:
            wait_for(background)
        record = run(row, parity_dir)
        report["rows"].append(record)
        status = "skip" if "skipped" in record else ("ok  " if "result" in record else "FAIL")
        print(f"{status} {row.label:18s} {row.lib:7s} {record.get('wall_s', '-')!s:>7} s  {left():5.0f} s left",
              flush=True)
        save(report, results_path)
    if background.poll() is None:
        background.kill()
    report["parity"] = parity_record(parity_dir)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    save(report, results_path)
    failed = [r for r in report["rows"] if "error" in r]
    print(f"{len(report['rows']) - len(failed)} rows ran or were skipped, {len(failed)} failed; {results_path}")
    sys.exit(1 if failed else 0)


def save(report: dict, path: Path) -> None:
    """The results so far: the JSON, and its tables (a rendering error is printed, the JSON is kept); copied with
    the log into ``OUT`` when it is set (the device tool returns that folder even from a run cut short)."""
    path.write_text(json.dumps(report, indent=1))
    try:
        sys.path.insert(0, str(HERE))
        import render

        path.with_suffix(".md").write_text(render.render(report))
    except Exception as exc:  # noqa: BLE001 - the measurements matter more than their table
        print(f"rendering {path.with_suffix('.md')} failed: {type(exc).__name__}: {exc}", flush=True)
    copy_out(path)


def copy_out(path: Path) -> None:
    """Copy the results (.json, .md) and the log to ``OUT``, each through a temporary name (never half-written)."""
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    log = os.environ.get("LOG")
    pairs = [(path, path.name), (path.with_suffix(".md"), path.with_suffix(".md").name)]
    for source, name in pairs + ([(Path(log), "gpu-bench-log.txt")] if log else []):
        if source.exists():
            shutil.copyfile(source, os.path.join(out, name + ".tmp"))
            os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))


def wait_for(process: subprocess.Popen) -> None:
    """Wait (within the deadline) for the background preparation of the Qwen2 checkpoint."""
    try:
        process.wait(timeout=max(1, left() - 30))
    except subprocess.TimeoutExpired:
        process.kill()
    print((process.stdout.read() or "").strip()[-2000:], flush=True)


if __name__ == "__main__":
    main()
