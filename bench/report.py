"""Render bench/results.json as bench/results.md (called by bench/run.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _compiled(ours: dict) -> str:
    """The settings note of a ``torch_compile`` row: ours compiled (its first step, compilation included)."""
    return f" **ours torch_compile** (first step {_fmt(ours['first_step_seconds'])} s)"


def _fmt(x, digits=4):
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def _met(row):
    met = row.get("met")
    return "n/a" if met is None else ("**met**" if met else "**missed**")


def _target(t: dict, unit: str) -> str:
    """'**met**', or '**missed** by X unit' (X = how far ours is from the target's bound)."""
    return "**met**" if t["met"] else f"**missed** by {t['missed_by']:.3g}{unit}"


# A run's 1-minute load before it starts above this means other work shared the host: the bench's own
# processes (one per run, one thread each) keep the load near 1.0 on their own.
LOADED = 1.5


def loaded_runs_note(rows: list[dict]) -> list[str]:
    """A line naming the rows with a run that started under another job's load (``load_before`` > ``LOADED``)."""
    flagged = []
    for x in rows:
        loads = [run["load_before"] for runs in x.get("runs", {}).values() for run in runs if "load_before" in run]
        if loads and max(loads) > LOADED:
            flagged.append(f"{x['size']} {x['workload']} {_settings_tag(x['settings'])}(up to {max(loads):.2f})")
    if not flagged:
        return []
    return [f"**Measured under load** (1-minute load above {LOADED} before a run: other work shared the host, "
            f"so these timings are noisier): {'; '.join(flagged)}.", ""]


def _settings_tag(settings: dict) -> str:
    tags = [name for name in ("torch_compile", "same_allocator", "prepacked_generation", "bf16_weights")
            if settings.get(name)]
    if "batch_size" in settings:
        tags.append(f"batch {settings['batch_size']}")
    return "".join(f"[{t}] " for t in tags)


def _table(header: list[str], rows) -> list[str]:
    """A Markdown table: the header, its rule, then one line per row of cells (cells already formatted)."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in cells) + " |" for cells in rows)]


def _online_table(rows: list) -> list:
    """Workload (e): per method, gold gain, seconds per step and peak RSS of ours vs TRL 1.16, with the targets."""
    def library_row(x: dict, lib: str, name: str) -> list:
        m = x["median"][lib]
        kl = "n/a" if m.get("final_kl") is None else _fmt(m["final_kl"], 3)
        return [x["size"], name, *(_fmt(m[k], 3) for k in ("gold_first", "gold_last", "gold_gain", "gold_gain5")), kl,
                _fmt(m["seconds_per_step"], 3), f"{m['peak_rss_mb']:.0f}"]

    def target_row(t: dict) -> list:
        return [_target(t["gold_gain"], " gold"),
                f"{_target(t['seconds_per_step'], ' s')} ({_fmt(t['seconds_per_step']['ratio'], 3)})",
                f"{_target(t['peak_rss_mb'], ' MB')} ({_fmt(t['peak_rss_mb']['ratio'], 3)})"]

    lines = _table(["method", "library", "gold first step", "gold last step", "gain", "gain, last 5 - first 5",
                    "final KL", "s/step", "peak RSS MB"],
                   [library_row(x, lib, name) for x in rows for lib, name in (("ours", "ours"), ("trl116", "TRL 1.16.0"))])
    lines += ["", *_table(["method", "gain >= TRL's", "s/step <= 0.5x TRL's (ratio)", "peak RSS <= TRL's (ratio)"],
                          [[x["size"], *target_row(x["targets"])] for x in rows])]
    s = rows[0]["settings"]
    lines += ["", f"Same model (GPT-2 4x128, 2048-token rt-polarity BPE, built from a config with seed 0 and saved once "
              f"with save_pretrained; both venvs have transformers 5.23), same prompts (first {s['prompt_words']} words of "
              f"rt-polarity snippets), same reward callable (VADER compound of prompt + completion), same config: "
              f"{s['steps']} steps of {s['completions_per_step']} completions, {s['num_generations']} per prompt, "
              f"lr {s['learning_rate']}, beta {s['beta']}, max_completion_length {s['max_completion_length']}, "
              f"temperature 1, top_k 0, top_p 1, TRL 1.16's default loss and scaling, fp32, no vLLM, seeds "
              f"{s.get('seeds')} (medians over seeds). Gold = mean reward of the step's 64 samples "
              "(the reward function's own record, one call per step); gain = last step - first step; the last-5 - "
              "first-5 column is a less noisy reading of the same. s/step = median of the steps after the first "
              "(a TrainerCallback around each optimizer step: generation, reward, loss, backward, update). "
              "Peak RSS = ru_maxrss of the run's process.", ""]
    return lines


def _same_first_samples(runs: dict) -> str:
    """Whether each seed's first-step completions were the same text in both stacks (the runs' digests)."""
    digests = [(r["seed"], r.get("first_step_completions_md5"), t.get("first_step_completions_md5"))
               for r, t in zip(runs["ours"], runs["trl116"])]
    if any(d is None for _, *pair in digests for d in pair):
        return ""
    same = [seed for seed, a, b in digests if a == b]
    return (f"First-step completions identical in both stacks (digest) for seeds {same} of "
            f"{[seed for seed, _, _ in digests]}. ")


def _arithmetic_table(rows: list) -> list:
    """Workload (f): per library, held-out pass@1 before/after GRPO on the arithmetic task and seconds per step."""
    lines = []
    for x in rows:
        s = x["settings"]
        if "skipped" in x:
            lines += [f"Skipped: {x['skipped']}", ""]
            continue
        names = {"ours": "ours", "trl116": "TRL 1.16.0"}
        lines += _table(["library", "pass@1 before", "pass@1 after", "gain", "train reward, first 10 steps",
                         "last 10 steps", "s/step", "peak RSS MB"],
                        [[names[lib], *(_fmt(m[k], 4) for k in ("pass@1_before", "pass@1_after", "pass@1_gain")),
                          _fmt(m["reward_first10"], 3), _fmt(m["reward_last10"], 3), _fmt(m["seconds_per_step"], 3),
                          f"{m['peak_rss_mb']:.0f}"] for lib, m in x["median"].items()])
        lines += ["", f"s/step ratio ours / TRL 1.16: **{_fmt(x['ratio'], 3)}** (a side-by-side, no target). "
                  f"{_same_first_samples(x['runs'])}"
                  f"Same initial policy (the arithmetic pipeline's SFT model, a 3x128 GPT-2 with its digit-split "
                  f"tokenizer, loaded by both from its save_pretrained directory), same problems in the same order "
                  f"(the first {s['steps'] * s['per_device_train_batch_size'] // s['num_generations']} of "
                  f"data/prompts_train.jsonl, shuffle_dataset off), same reward (one exact-answer function on "
                  f"rlhf_core's answer rules), same config: {s['steps']} steps of {s['per_device_train_batch_size']} "
                  f"completions, {s['num_generations']} per problem, lr {s['learning_rate']} (linear decay), beta "
                  f"{s['beta']}, max_completion_length {s['max_completion_length']}, temperature {s['temperature']}, "
                  f"top_k 0, top_p 1, loss dapo, group scaling, one iteration, fp32, no vLLM, seeds {s.get('seeds')} "
                  f"(medians over seeds). pass@1 = held-out problems ({s['eval_problems']} of data/prompts_eval.jsonl "
                  f"x {s['eval_samples']} samples, seeded), every policy sampled and verified by one process "
                  "(rlhf_core.evaluation.sample_responses + verify_samples, as the pipeline's evaluate stage). "
                  "s/step = median of the steps after the first (a TrainerCallback around each optimizer step).", ""]
    return lines


def render(r: dict) -> str:
    m0, m1 = r["machine_start"], r["machine_end"]
    lines = [
        "# rlhf_core vs classic TRL 0.11.4 (PPO) and TRL 1.16.0 (GRPO, RLOO): benchmark results",
        "",
        f"Generated by `make bench` (`.venv/bin/python bench/run.py`) on {m0['date']}; {m0['cpus']} CPUs, "
        f"{m0['platform']}, Python {m0['python']}; torch threads per process: {r['threads']}; "
        f"{'QUICK harness check, not a measurement; ' if r['quick'] else ''}"
        f"repeats per library: {r['repeats']} (alternating order). Load average (1/5/15 min) at start "
        f"{', '.join(f'{x:.2f}' for x in m0['loadavg'])}, at end {', '.join(f'{x:.2f}' for x in m1['loadavg'])}; "
        f"the 1-minute load before each run is in results.json (`load_before`). Total {r['total_seconds']:.0f} s.",
        "",
        *([f"**Rows carried over** from an earlier run (`--merge`), not re-measured in this one: "
           f"{', '.join(r['carried_over'])}; their run's date, load and matmul peaks are in each row's `measured_in` "
           "(results.json) and listed below.", ""] if r.get("carried_over") else []),
        f"Measured fp32 matmul peak (2048^3, {r['threads']} threads, best of 8): "
        f"**{r['matmul_peak_flops'] / 1e9:.1f} GFLOP/s** (the MFU denominator)"
        + (f"; bf16: **{r['matmul_peak_flops_bf16'] / 1e9:.1f} GFLOP/s** (the denominator of the bf16 rows)."
           if "matmul_peak_flops_bf16" in r else "."),
        "",
        "Ratios are ours / TRL of the medians. Every run is a fresh process; the exact command of each is in "
        "the tables below and in results.json (`commands`).",
        "",
    ]
    if "parity" in r:
        p = r["parity"]
        lines += ["## Parity (one PPO step from identical weights)", "",
                  *([f"*Carried over from the run of {p['measured_in']['date']}.*", ""] if "measured_in" in p else []),
                  f"`{p['command']}`: **{'passed' if p['passed'] else 'FAILED'}** ({p['summary']}).", "",
                  "Dropout off, one mini-batch per epoch (batch 8, 2 PPO epochs, lr 1e-3, adaptive KL 0.2), tiny "
                  "GPT-2 from the same safetensors, the policy nudged off the reference so KL is non-zero; for "
                  "`kl_penalty` in {kl, full}: every scalar stat (losses, KL, entropies, returns mean/var, value "
                  "stats, clip fractions), the per-sample KL and every updated weight agree within 1e-4.", ""]
    groups = [("step", "(a) PPOTrainer.step: seconds per step (full reference, identical queries/responses/scores)"),
              ("generate", "(b) generate: tokens per second (same prompts, sampling top_k=0, top_p=1)"),
              ("memory", "(c) peak resident memory of a 2-step PPO run (MB)"),
              ("sentiment", "(d) PPO on rt-polarity towards positive VADER sentiment"),
              ("online", "(e) GRPO and RLOO against TRL 1.16.0 (issue 14 point 6)"),
              ("arithmetic", "(f) GRPO on the arithmetic task against TRL 1.16.0: held-out pass@1 (issue 32 point 5)")]
    for name, title in groups:
        rows = [x for x in r["rows"] if x["workload"] == name]
        if not rows:
            continue
        lines += [f"## {title}", ""]
        sources = sorted({(x["measured_in"]["date"], tuple(round(v, 2) for v in x["measured_in"]["loadavg_start"]))
                          for x in rows if "measured_in" in x})
        for date, load in sources:
            lines += [f"*Carried over from the run of {date} (load at its start {', '.join(map(str, load))}).*", ""]
        if name == "step":
            lines += ["| size | settings | ours s/step | TRL s/step | ratio | target <= 0.5 | ours tok/s | TRL tok/s | ours MFU | TRL MFU |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            for x in rows:
                s = x["settings"]
                if "skipped" in x:
                    lines.append(f"| {x['size']} | {s.get('mixed_precision', 'fp32')}"
                                 f"{', ours bf16_weights' if s.get('bf16_weights') else ''} | skipped: {x['skipped']} |||||||| ")
                    continue
                o, t = x["median"]["ours"], x["median"]["trl"]
                lines.append(f"| {x['size']} | B={s['batch_size']} mb={s['mini_batch_size']} epochs={s['ppo_epochs']} "
                             f"q={s['query_len']} r={s['response_len']}"
                             f"{' **' + s['mixed_precision'] + ' autocast**' if s.get('mixed_precision') else ' fp32'}"
                             f"{_compiled(o) if s.get('torch_compile') else ''}"
                             f"{', **ours bf16_weights** (fp32 masters)' if s.get('bf16_weights') else ''}"
                             f"{' **both with the same allocator settings**' if s.get('same_allocator') else ''} | "
                             f"{_fmt(o['seconds_per_step'])} | "
                             f"{_fmt(t['seconds_per_step'])} | {_fmt(x['ratio'], 3)} | {_met(x)} | "
                             f"{_fmt(o['tokens_per_second'])} | {_fmt(t['tokens_per_second'])} | "
                             f"{o['mfu'] * 100:.1f}% | {t['mfu'] * 100:.1f}% |")
            lines += ["", "tok/s = (query + response tokens in the batch) / step time. MFU = model FLOPs / time / "
                      "matmul peak, model FLOPs = tokens x forward FLOPs/token x (2 no-grad forwards [policy, reference] "
                      "+ 3 x ppo_epochs [forward + backward]); forward FLOPs/token = 2 x (12 L H^2 + H V) + 4 L T H.", ""]
        elif name == "generate":
            def generate_row(x: dict) -> list:
                o, t = x["median"]["ours"], x["median"]["trl"]
                bsz = x["settings"].get("batch_size")
                size = x["size"] + (" **ours prepacked_generation**" if x["settings"].get("prepacked_generation") else "")
                return [size, "library default" if bsz is None else bsz, _fmt(o["tokens_per_second"]),
                        _fmt(t["tokens_per_second"]), _fmt(x["ratio"], 3), ">= 2: " + _met(x), _fmt(o["seconds"]),
                        _fmt(t["seconds"])]

            lines += _table(["size", "batch size", "ours tok/s", "TRL tok/s", "ratio", "target", "ours s", "TRL s"],
                            map(generate_row, rows))
            s = rows[0]["settings"]
            lines += ["", f"{s['num_prompts']} prompts of {s['query_len']} tokens, max_new_tokens="
                      f"{s['max_new_tokens']}, do_sample, top_k=0, top_p=1, min_length=-1, the same `batch_size` passed to "
                      "both libraries. Ours decodes with `rlhf_core.trainers.decode` (the model calls, logits processors "
                      "and exponential-race draw of `generate`: the same tokens for the same seed, tests/test_decode.py); "
                      "TRL with transformers 4.57's `generate`.", ""]
        elif name == "memory":
            def memory_row(x: dict) -> list:
                o, t = x["median"]["ours"], x["median"]["trl"]
                return [x["size"], x["settings"]["reference"], f"{o['peak_rss_mb']:.0f}", f"{t['peak_rss_mb']:.0f}",
                        _fmt(x["ratio"], 3), f"{o['peak_above_imports_mb']:.0f}", f"{t['peak_above_imports_mb']:.0f}",
                        _met(x)]

            lines += _table(["size", "reference", "ours peak", "TRL peak", "ratio", "ours above imports",
                             "TRL above imports", "target"], map(memory_row, rows))
            lines += ["", "Peak = ru_maxrss of the process (MB). 'above imports' subtracts the RSS after importing torch, "
                      "transformers and the library (transformers 5 vs 4 differ there). shared = `num_shared_layers` "
                      "(tiny 1 of 2, gpt2s 6 of 12) plus embeddings; lora = LoRA r=16 on c_attn, reference = adapter "
                      "disabled. Target: full <= TRL full; shared/lora <= TRL's same mode and < 0.9 x our full.", ""]
        elif name == "sentiment":
            for x in rows:
                if "skipped" in x:
                    lines += [f"Skipped: {x['skipped']}", ""]
                    continue
                o, t = x["median"]["ours"], x["median"]["trl"]
                s = x["settings"]
                lines += ["| library | gold before | gold after | gold gain | mean KL/step | final KL | wall s |",
                          "|---|---|---|---|---|---|---|",
                          f"| ours | {_fmt(o['gold_before'])} | {_fmt(o['gold_after'])} | {_fmt(o['gold_gain'])} | {_fmt(o['mean_kl'])} | {_fmt(o['final_kl'])} | {o['seconds']:.0f} |",
                          f"| TRL | {_fmt(t['gold_before'])} | {_fmt(t['gold_after'])} | {_fmt(t['gold_gain'])} | {_fmt(t['mean_kl'])} | {_fmt(t['final_kl'])} | {t['seconds']:.0f} |",
                          "", f"Target (gain >= TRL's at no more KL, 5% slack on KL): {_met(x)}. Medians over seeds {s.get('seeds')}; "
                          f"{s['steps']} steps of {s['batch_size']} prompts ({s['prompt_tokens']} tokens of a held-in snippet), "
                          f"{s['max_new_tokens']} new tokens, mini-batch {s['mini_batch_size']}, {s['ppo_epochs']} epochs, "
                          f"lr {s['learning_rate']}, adaptive KL from {s['init_kl_coef']}. Gold = VADER compound of prompt + "
                          f"response, averaged over {s['eval_prompts']} held-out prompts x {s['eval_samples']} samples with a fixed seed.",
                          "", "KL per step (median over seeds), ours: " + ", ".join(f"{k:.3f}" for k in o["kl_per_step"]),
                          "", "KL per step, TRL: " + ", ".join(f"{k:.3f}" for k in t["kl_per_step"]), ""]
        elif name == "online":
            lines += _online_table(rows)
        elif name == "arithmetic":
            lines += _arithmetic_table(rows)
        lines += loaded_runs_note(rows)
        lines += ["Commands (one process each):", ""]
        for x in rows:
            for lib, cmd in x.get("commands", {}).items():
                lines.append(f"- {x['size']} {lib}: `{cmd}`")
        lines.append("")
    if r.get("notes"):
        lines += ["## Notes", "", r["notes"], ""]
    analysis = Path(__file__).with_name("analysis.md")
    if analysis.exists():  # hand-written: what bounds each missed target (profiles), updated with each measurement
        lines += [analysis.read_text().rstrip(), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    print(render(data))
