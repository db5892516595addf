"""Split one ``PPOTrainer.step`` of either library into model time and everything else.

    OMP_NUM_THREADS=1 .venv/bin/python bench/profile_floor.py --lib ours --args '{"size": "tiny"}'
    OMP_NUM_THREADS=1 bench/.trl-venv/bin/python bench/profile_floor.py --lib trl --args '{"size": "tiny"}'

Times every forward of the policy and the reference (forward hooks on the value-head model and the reference)
and every backward (``torch.autograd.backward``), over ``steps`` steps after one warm-up, on the step bench's
workload. Prints one JSON line: per-step seconds of the whole step, the forwards, the backwards, and the rest.
The forwards and backwards are the model's own operators, which an exact re-implementation must also run:
their sum over the other library's step is the lowest ratio the step can reach without changing the
model's arithmetic (bench/analysis.md (a)).
"""

import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
if "--lib" in sys.argv and sys.argv[sys.argv.index("--lib") + 1] == "ours":
    sys.path.insert(0, os.path.dirname(BENCH))  # this checkout's rlhf_core
import common  # noqa: E402


class Clock:
    """Seconds spent inside hooked forwards and backwards (a forward nested in another counts once)."""

    def __init__(self):
        self.forward = self.backward = 0.0
        self._depth, self._start = 0, 0.0

    def enter(self, *_):
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def leave(self, *_):
        self._depth -= 1
        if self._depth == 0:
            self.forward += time.perf_counter() - self._start

    def timed_backward(self, backward):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return backward(*args, **kwargs)
            finally:
                self.backward += time.perf_counter() - start
        return run


def main():
    lib, args = common.parse_args()
    import torch

    trainer, _, q, r, s = common.profiled_step(lib, args)
    trainer.step(q, r, s)  # warm-up
    clock = Clock()
    for model in {id(m): m for m in (trainer.model, trainer.ref_model) if m is not None}.values():
        model.register_forward_pre_hook(clock.enter)
        model.register_forward_hook(clock.leave)
    torch.autograd.backward = clock.timed_backward(torch.autograd.backward)  # Tensor.backward calls it
    steps, start = args.get("steps", 5), time.perf_counter()
    for _ in range(steps):
        trainer.step(q, r, s)
    total = (time.perf_counter() - start) / steps
    forward, backward = clock.forward / steps, clock.backward / steps
    common.emit({"lib": common.version_of(lib), "size": args.get("size", "tiny"), "step_seconds": total,
                 "forward_seconds": forward, "backward_seconds": backward, "rest_seconds": total - forward - backward})


if __name__ == "__main__":
    main()
