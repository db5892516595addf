"""Profile one ``PPOTrainer.step`` (or ``generate``) of either library with torch.profiler and cProfile.

    .venv/bin/python bench/profile_step.py --lib ours --args '{"size": "tiny", "what": "step"}'
    bench/.trl-venv/bin/python bench/profile_step.py --lib trl --args '{"size": "gpt2s"}'

Prints the top operators by self CPU time and the top Python functions by cumulative time: the
evidence behind the speed changes and the "what bounds it" notes in results.md.
"""

import cProfile
import io
import os
import pstats
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
if "--lib" in sys.argv and sys.argv[sys.argv.index("--lib") + 1] == "ours":
    sys.path.insert(0, os.path.dirname(BENCH))  # this checkout's rlhf_core, not the one the editable install names
import common  # noqa: E402


def main():
    lib, args = common.parse_args()
    from torch.profiler import ProfilerActivity, profile

    trainer, tokenizer, q, r, s = common.profiled_step(lib, args)
    if args.get("what", "step") == "step":
        run = lambda: trainer.step(q, r, s)  # noqa: E731
    else:
        gen = {"min_length": -1, "top_k": 0.0, "top_p": 1.0, "do_sample": True, "max_new_tokens": 32,
               "pad_token_id": tokenizer.eos_token_id}
        call = {} if args.get("batch_size_gen") is None else {"batch_size": args["batch_size_gen"]}
        run = lambda: trainer.generate(q, return_prompt=False, **call, **gen)  # noqa: E731
    run()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.get("rows", 25)))
    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("cumulative").print_stats(args.get("rows", 25))
    print(out.getvalue())


if __name__ == "__main__":
    main()
