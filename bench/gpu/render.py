"""``results-gpu.md`` from ``results-gpu.json`` (standard library only): the tables a GPU user reads.

    python3 bench/gpu/render.py bench/results-gpu.json > bench/results-gpu.md

Per workload: median seconds per step (or tokens/s) of ours and its peer and their ratio, next to the card's
floor (``roofline``, ``peaks``): the bandwidth floor of generation, MFU for training steps, and for the
real-size (Qwen2-0.5B) rows the seconds, tokens/s and MFU of each phase. Every row names the device it ran on.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peaks  # noqa: E402
import roofline  # noqa: E402

PHASE_ORDER = ("generation", "reward", "reference forward", "policy forward", "policy update")


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ran(rows: list[dict], label: str, lib: str) -> list[dict]:
    return [r["result"] for r in rows if r["label"] == label and r["lib"] == lib and "result" in r]


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def devices(rows: list[dict], *labels: str) -> str:
    return ", ".join(sorted({r["device"] for r in rows if r["label"] in labels and r.get("device")})) or "-"


# ---------------------------------------------------------------------------- generation


def generate_rates(results: list[dict]) -> dict | None:
    """Median seconds and tokens/s over every timed call of these runs."""
    secs = [s for r in results for s in r["seconds"]]
    toks = [t for r in results for t in r["generated_tokens"]]
    if not secs:
        return None
    return {"seconds": median(secs), "tokens_per_s": median([t / s for t, s in zip(toks, secs)]), "calls": len(secs),
            "decode_stats": results[-1].get("decode_stats")}


def generate_floor(args: dict, device: str | None, result: dict) -> float | None:
    """Tokens/s if every decode step only read the bf16 weights and KV cache at the card's HBM bandwidth."""
    import common

    hbm = peaks.peak(device, "hbm")
    if hbm is None:
        return None
    s = roofline.shape(args["size"])
    cfg = common.SIZES[args["size"]]
    params = 12 * s.layers * s.hidden ** 2 + s.hidden * cfg["vocab_size"]  # blocks' matmuls + tied LM head
    rows, new = args["num_prompts"], args["max_new_tokens"]
    prompt = result["prompt_tokens"] / rows
    seconds = roofline.decode_bytes(params, s, rows, prompt, new, 2) / (hbm * 1e12)
    return rows * new / seconds


def generate_table(rows: list[dict]) -> list[str]:
    out = ["| library | precision | s / call | tokens/s | ours / this | timed calls |", "|---|---|---|---|---|---|"]
    ours = generate_rates(ran(rows, "generate", "ours"))
    entries = [("rlhf_core", "its default + bf16 mixed precision (on CUDA: bf16 weights)", ours),
               ("rlhf_core", "fp32", generate_rates(ran(rows, "generate fp32", "ours"))),
               ("classic TRL 0.11.4", "fp32 (its generate ignores mixed precision)",
                generate_rates(ran(rows, "generate", "trl"))),
               ("transformers generate", "bf16", generate_rates(ran(rows, "generate", "hf")))]
    for name, precision, rate in entries:
        if rate is None:
            continue
        ratio = ours["tokens_per_s"] / rate["tokens_per_s"] if ours else None
        out.append(f"| {name} | {precision} | {fmt(rate['seconds'])} | {fmt(rate['tokens_per_s'])} | "
                   f"{fmt(ratio) if name != 'rlhf_core' else ''} | {rate['calls']} |")
    first = next((r for r in rows if r["label"] == "generate" and "result" in r), None)
    if first and ours:
        floor = generate_floor(first["args"], first.get("device"), first["result"])
        if floor:
            out.append(f"| bandwidth floor (bf16 weights + KV cache read once per step at "
                       f"{peaks.peak(first.get('device'), 'hbm')} TB/s) | bf16 | | {fmt(floor)} | "
                       f"ours at {100 * ours['tokens_per_s'] / floor:.1f}% | |")
        stats = ours["decode_stats"] or {}
        out.append("")
        out.append(f"rlhf_core's token steps in its last run: {stats.get('replays', 0)} CUDA-graph replays, "
                   f"{stats.get('eager_steps', 0)} eager, {stats.get('captures', 0)} captures"
                   + (f"; capture failures: {stats['capture_failures']}" if stats.get("capture_failures") else ""))
    out.append(f"Device(s): {devices(rows, 'generate')}. Targets: ours >= 10x classic TRL's tokens/s, >= 4x "
               "transformers' bf16 generate.")
    return out


# ---------------------------------------------------------------------------- training steps


def step_flops(result: dict) -> float | None:
    """Model FLOPs of one step of a step row (``roofline``): PPO's old-policy and reference forwards and
    ``ppo_epochs`` forward + backward passes; GRPO/RLOO's every phase, generation included. None without sizes."""
    try:
        if "ppo_epochs" in result:  # bench/workloads/ppo_step.py
            rows, prompt = result["rows"], result["prompt_tokens_per_step"]
            flops = roofline.phase_flops("ppo", result["matmul_params"], roofline.shape(result["size"]), rows,
                                         prompt, result["tokens_per_step"] - prompt, result["ppo_epochs"])
            return sum(flops.values()) - flops["generation"]  # the step gets its responses given
        rows = result["completions_per_call"][0]
        prompt = median(result["prompt_tokens"][1:] or result["prompt_tokens"])
        completion = median(result["completion_tokens"][1:] or result["completion_tokens"])
        return sum(roofline.phase_flops("online", result["matmul_params"], roofline.shape(result["arch"]), rows,
                                        prompt, completion).values())
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def mfu(results: list[dict], seconds: float | None, device: str | None) -> str:
    """Model FLOPs per second over the card's dense bf16 datasheet peak, as a percentage ('-' when unknown)."""
    flops = median([step_flops(r) for r in results])
    peak = peaks.peak(device, "bf16") if device else None
    if not flops or not seconds or not peak:
        return "-"
    return fmt(100 * flops / seconds / (peak * 1e12), 2) + "%"


def step_table(rows: list[dict]) -> list[str]:
    out = ["| workload | ours s/step | peer s/step | ours / peer | peer | MFU ours / peer (bf16 dense peak) | "
           "peak GPU memory ours / peer (GB) | ours / peer memory | device |",
           "|---|---|---|---|---|---|---|---|---|"]
    for label, peer_label, peer in (("ppo fp32", "ppo fp32", "trl"), ("ppo bf16", "ppo bf16", "trl"),
                                    ("ppo bf16 weights", "ppo bf16", "trl"), ("ppo default", "ppo bf16", "trl"),
                                    ("grpo", "grpo", "trl116"), ("rloo", "rloo", "trl116"),
                                    ("grpo bf16", "grpo bf16", "trl116"), ("rloo bf16", "rloo bf16", "trl116")):
        ours, theirs = ran(rows, label, "ours"), ran(rows, peer_label, peer)
        skip = 1 if label.split()[0] in ("grpo", "rloo") else 0  # the online workload's first step is its warm-up
        o, p = (median([s for r in rs for s in r["step_seconds"][skip:]]) for rs in (ours, theirs))
        if o is None and p is None:
            continue
        peak_bytes = [max(r["cuda_max_memory_allocated"] for r in rs)
                      if rs and all(r.get("cuda_max_memory_allocated") for r in rs) else None for rs in (ours, theirs)]
        mem = [fmt(b / 1e9) if b else "-" for b in peak_bytes]
        mem_ratio = fmt(peak_bytes[0] / peak_bytes[1]) if all(peak_bytes) else "-"
        version = theirs[0]["lib"] if theirs else peer
        device = (ours or theirs)[0].get("device")
        out.append(f"| {label} | {fmt(o)} | {fmt(p)} | {fmt(o / p) if o and p else '-'} | {version} | "
                   f"{mfu(ours, o, device)} / {mfu(theirs, p, device)} | {mem[0]} / {mem[1]} | {mem_ratio} | "
                   f"{devices(rows, label)} |")
    out.append("")
    out.append("MFU: model FLOPs of the step (bench/gpu/roofline.py: PPO's two scoring forwards and ppo_epochs "
               "forward + backward passes; GRPO/RLOO's whole step, generation included) over the card's dense bf16 "
               "datasheet peak (bench/gpu/peaks.py), for every precision. Targets: PPO default <= 0.25x TRL's bf16 "
               "step, >= 30% MFU; peak memory <= 0.7x the peer's.")
    return out


def decode_stats_table(rows: list[dict]) -> list[str]:
    """Per row that sampled with rlhf_core: captured graphs, replayed and eager token steps, the calls that went to
    ``generate`` and why (``rlhf_core.trainers.decode.DECODE_STATS``: the counts of that row's process)."""
    out = ["| row | captures | replays | eager steps | fallbacks to generate (reason: calls) | capture failures |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        stats = (r.get("result") or {}).get("decode_stats")
        if not stats:
            continue
        fallbacks = "; ".join(f"{k}: {v}" for k, v in (stats.get("fallbacks") or {}).items()) or "none"
        failures = len(stats.get("capture_failures") or [])
        out.append(f"| {r['label']} [{r['lib']}] | {stats.get('captures')} | {stats.get('replays')} | "
                   f"{stats.get('eager_steps')} | {fallbacks} | {failures} |")
    return out


def decode_parity_table(rows: list[dict]) -> list[str]:
    """Per decode-parity row: is every greedy token of rlhf_core's decode the fp32 full forward's first choice?"""
    out = ["| precision | tokens | max gap (logits) | over tolerance | same as transformers' greedy | replays / eager |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        result = r.get("result") or {}
        if r["workload"] != "decode_parity" or not result:
            continue
        stats = result.get("decode_stats") or {}
        out.append(f"| {result['precision']} | {result['tokens']} | {result['max_gap']:.3g} | "
                   f"{result['over_tolerance']} (> {result['tolerance']:g}) | "
                   f"{result['same_as_transformers_generate']} of {result['prompts']} | "
                   f"{stats.get('replays')} / {stats.get('eager_steps')} |")
    return out


# ---------------------------------------------------------------------------- real size, by phase


def phase_rows(result: dict, kind: str) -> tuple[dict, float, tuple[float, float]]:
    """Median seconds per phase, step seconds and tokens per step of one run (first step dropped for online)."""
    if kind == "ppo":
        steps = result["iterations"]
        phases = [s["phases"] for s in steps]
        seconds = [s["seconds"] for s in steps]
        prompt = [s["prompt_tokens"] for s in steps]
        completion = [s["response_tokens"] for s in steps]
    else:
        phases, seconds = result["phase_seconds"][1:], result["step_seconds"][1:]
        prompt, completion = result["prompt_tokens"][1:], result["completion_tokens"][1:]
    names = [k for k in PHASE_ORDER if any(k in p for p in phases)]
    med = {k: median([p.get(k, 0.0) for p in phases]) for k in names}
    step = median(seconds)
    if kind != "ppo":
        med["policy update"] = step - sum(med.values())  # the rest of the step: loss, backward, optimizer
    return med, step, (median(prompt), median(completion))


def real_size_table(rows: list[dict]) -> list[str]:
    out = ["| run | phase | seconds | share | tokens/s | MFU (bf16 peak) |", "|---|---|---|---|---|---|"]
    for label, lib, kind in (("qwen2-0.5b grpo", "ours", "online"), ("qwen2-0.5b grpo", "trl116", "online"),
                             ("qwen2-0.5b ppo", "ours", "ppo"), ("qwen2-0.5b ppo default", "ours", "ppo")):
        results = ran(rows, label, lib)
        if not results:
            continue
        record = next(r for r in rows if r["label"] == label and r["lib"] == lib and "result" in r)
        result, device = results[-1], record.get("device")
        args = record["args"]
        rows_per_step = args.get("completions_per_step", args.get("batch_size"))
        med, step, (prompt, completion) = phase_rows(result, kind)
        flops = roofline.phase_flops(kind, result["matmul_params"], roofline.shape(result["arch"]), rows_per_step,
                                     prompt, completion, args.get("ppo_epochs", 1))
        peak = peaks.peak(device, "bf16")
        name = f"{label} {result['lib']}"
        for phase, seconds in med.items():
            tokens = completion if phase == "generation" else prompt + completion
            mfu = flops.get(phase, 0.0) / seconds / (peak * 1e12) if peak and seconds > 0 and flops.get(phase) else None
            out.append(f"| {name} | {phase} | {fmt(seconds)} | {100 * seconds / step:.0f}% | "
                       f"{fmt(tokens / seconds) if seconds > 0 else '-'} | {fmt(100 * mfu, 2) + '%' if mfu else '-'} |")
        total = sum(flops.values())
        mfu = total / step / (peak * 1e12) if peak else None
        out.append(f"| {name} | **step** | {fmt(step)} | 100% | {fmt((prompt + completion) / step)} | "
                   f"{fmt(100 * mfu, 2) + '%' if mfu else '-'} |")
    out.append(f"Device(s): {devices(rows, 'qwen2-0.5b grpo', 'qwen2-0.5b ppo', 'qwen2-0.5b ppo default')}. tokens/s: "
               "completion tokens for generation, prompt + completion tokens otherwise. MFU: model FLOPs "
               "(bench/gpu/roofline.py) over the card's datasheet bf16 peak (bench/gpu/peaks.py).")
    return out


# ---------------------------------------------------------------------------- the page


def generation_title(rows: list[dict]) -> str:
    args = next((r["args"] for r in rows if r["workload"] == "generate"), None)
    if args is None:
        return "not run"
    return (f"the {args['size']} model, {args['num_prompts']} prompts of {args['query_len'][0]}-{args['query_len'][1]} "
            f"tokens x {args['max_new_tokens']} new tokens, one batch")


def torch_versions(report: dict) -> str:
    """Each library set's torch version (``environments``)."""
    envs = report.get("environments") or {}
    return ", ".join(f"{lib} {env.get('torch', '?')}" for lib, env in envs.items()) or "-"


def render(report: dict) -> str:
    rows = report["rows"]
    probe = report.get("probe") or {}
    device = probe.get("device")
    card = peaks.card(device)
    lines = [f"# GPU bench results{' (SMOKE run: tiny sizes, not a measurement)' if report.get('smoke') else ''}", "",
             f"Run {report.get('started')} - {report.get('finished', 'unfinished')}; written by bench/gpu/run.sh "
             "(bench/gpu/driver.py); the raw rows, commands and environments are in the .json beside this file.", "",
             f"Device: {device} ({card or 'not in bench/gpu/peaks.py'}); torch {probe.get('torch')} (the GPU image's; "
             f"the CPU pin in requirements.lock may differ; per library set: {torch_versions(report)}), CUDA "
             f"{probe.get('cuda')}. Datasheet: {peaks.CARDS.get(card, {})}. Measured here: bf16 matmul "
             f"{fmt(probe.get('matmul_tflops_bfloat16'))} TFLOP/s, fp32 {fmt(probe.get('matmul_tflops_float32'))} "
             f"TFLOP/s, copy {fmt(probe.get('copy_tb_s'))} TB/s.", "",
             f"## Generation ({generation_title(rows)})", "", *generate_table(rows), "",
             "## Training steps (medians; ratio < 1: ours faster)", "", *step_table(rows), "",
             "## Qwen2-0.5B shape (random weights), bf16 mixed precision, by phase", "", *real_size_table(rows), "",
             "## The static decode in every row that sampled (DECODE_STATS)", "", *decode_stats_table(rows), "",
             "## Decode parity: greedy tokens re-scored by one fp32 full forward (bench/workloads/decode_parity.py)",
             "", *decode_parity_table(rows), ""]
    parity = report.get("parity")
    if parity:
        lines += ["## PPO parity with classic TRL on this device (tiny model, one step, fp32)", "",
                  f"`{json.dumps(parity)}`", ""]
    failed = [r for r in rows if "error" in r]
    skipped = [r for r in rows if "skipped" in r]
    if failed or skipped:
        lines += ["## Rows that did not run", ""]
        lines += [f"- {r['label']} [{r['lib']}]: failed (rc {r.get('rc')}), see the .json" for r in failed]
        lines += [f"- {r['label']} [{r['lib']}]: skipped ({r['skipped']})" for r in skipped]
    return "\n".join(lines) + "\n"


def main() -> None:
    print(render(json.loads(Path(sys.argv[1]).read_text())), end="")


if __name__ == "__main__":
    main()
