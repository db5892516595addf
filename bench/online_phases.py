"""The phases of one profiled GRPO/RLOO step, from raw cProfile files of bench/workloads/online.py.

    .venv/bin/python bench/online_phases.py ours-grpo=bench/.cache/profiles/a.prof,bench/.cache/profiles/a2.prof trl-grpo=bench/.cache/profiles/b.prof ...

Each file comes from ``online.py --args '{"steps": 3, "profile_step": 2, "profile_file": "bench/.cache/profiles/a.prof"}'``.
Prints a markdown table: seconds of each phase (cumulative time of the functions that do it, split by
caller where one function serves two phases), one column per label; with several files for a label, each
phase's minimum over them (on a shared machine the least disturbed reading; the phases of one column then
need not add up to its whole step).
"""

import pstats
import sys

# phase -> terms added (+) or taken away (-); a term is "function", "file suffix:function" (one of several
# functions of that name) or "function<caller" (only its calls from that caller). The same phase in both.
OURS = {
    "generation": ["+generate_batched"],
    "reward function": ["+_rewards"],
    "reference forward (no grad)": ["+_reference_logprobs"],
    "old-policy forward (no grad)": ["+_logprobs", "-_reference_logprobs"],
    "loss forward (with grad)": ["+token_logprobs_and_entropy", "-_logprobs"],
    "backward": ["+accelerate/accelerator.py:backward"],
    "optimizer": ["+accelerate/optimizer.py:step"],
}
TRL = {
    "generation": ["+_generate<_generate_and_score_completions"],
    "reward function": ["+_calculate_rewards"],
    "no-grad forwards (reference; RLOO also old policy)": ["+_get_per_token_logps_and_entropies",
                                                            "-wrapper<_compute_loss"],
    "loss forward (with grad)": ["+wrapper<_compute_loss"],  # TRL's profiling decorator around the forward
    "backward": ["+accelerate/accelerator.py:backward"],
    "optimizer": ["+accelerate/optimizer.py:step"],
}


def seconds_of(stats: pstats.Stats, term: str) -> float:
    """Cumulative seconds of one term (see OURS)."""
    term, caller = (term.split("<") + [None])[:2]
    suffix, name = term.rsplit(":", 1) if ":" in term else ("", term)
    total = 0.0
    for (path, _, func), (_, _, _, cumtime, callers) in stats.stats.items():
        if func != name or not path.endswith(suffix):
            continue
        if caller is None:
            total += cumtime
        else:
            total += sum(c[3] for (_, _, caller_func), c in callers.items() if caller_func == caller)
    return total


def phase_seconds(path: str, phases: dict) -> dict[str, float]:
    """{phase: seconds} of one profile file."""
    stats = pstats.Stats(path)
    return {phase: stats.total_tt if terms is None else
            max(0.0, sum((1 if t[0] == "+" else -1) * seconds_of(stats, t[1:]) for t in terms))  # 0: not run
            for phase, terms in phases.items()}


def main():
    columns = [arg.split("=", 1) for arg in sys.argv[1:]]
    table: dict[str, list[str]] = {}
    for i, (label, paths) in enumerate(columns):
        phases = {"whole step (training_step + optimizer)": None, **(TRL if label.startswith("trl") else OURS)}
        runs = [phase_seconds(path, phases) for path in paths.split(",")]
        for phase in phases:  # the least disturbed reading of each phase over the runs
            table.setdefault(phase, ["-"] * len(columns))[i] = f"{min(run[phase] for run in runs):.3f}"
    print("| phase (seconds) | " + " | ".join(label for label, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for phase, cells in table.items():
        print(f"| {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
