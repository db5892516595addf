"""Shared by every bench workload, and importable from BOTH virtual environments.

``.venv`` runs ``rlhf_core`` on transformers 5.x; ``bench/.trl-venv`` runs classic ``trl==0.11.4`` on
transformers 4.57. Nothing here imports either library at module level: a workload calls
``library(lib)`` to get the four classes it needs. Weights travel between the two environments in a
neutral format (``arch.json`` = GPT2Config kwargs, ``model.safetensors`` = a plain state dict with the
``v_head.summary.*`` tensors), and the tokenizer travels as a ``tokenizers`` ``tokenizer.json``
(a tokenizer saved by transformers 5 does not load in 4.x).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")

BENCH_DIR = Path(__file__).resolve().parent
CHECKOUT = BENCH_DIR.parent
CACHE_DIR = Path(os.environ.get("BENCH_CACHE", BENCH_DIR / ".cache"))
RT_POLARITY = Path(os.environ.get("RT_POLARITY_DIR", BENCH_DIR.parent.parent / "shared" / "data" / "rt-polarity"))

EOS, PAD, UNK = "<|endoftext|>", "<pad>", "<unk>"

# The two model sizes of every workload: GPT2Config keyword arguments (dropout off everywhere).
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "summary_first_dropout": 0.0,
              # the bench tokenizers put EOS (= BOS) at id 0 and PAD at id 1
              "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}
SIZES = {
    "tiny": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": 512, **NO_DROPOUT},
    # GPT-2 small shape (124 M parameters): 12 layers, 768 wide, 12 heads, 50257-token vocabulary.
    # mid: 4 layers x 256 wide with GPT-2's vocabulary (the LM head is most of the FLOPs).
    "mid": {"n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 1024, "vocab_size": 50257, **NO_DROPOUT},
    "gpt2s": {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257, **NO_DROPOUT},
}


def shown_path(path: str | Path) -> str:
    """``path`` relative to the checkout when inside it (commands and results then read the same in every clone)."""
    path = Path(path).resolve()
    return str(path.relative_to(CHECKOUT)) if path.is_relative_to(CHECKOUT) else str(path)


def cpu_has_bf16_units() -> bool:
    """True on a CPU with native bf16 matmul (AVX512-BF16 or AMX); elsewhere torch emulates bf16 (slow)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f in flags for f in ("avx512_bf16", "amx_bf16"))


# ------------------------------------------------------------------------------------------ args / output


def parse_args(libs: tuple[str, ...] = ("ours", "trl")) -> tuple[str, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lib", choices=libs, required=True)
    parser.add_argument("--args", default="{}", help="workload arguments as a JSON object")
    ns = parser.parse_args()
    args = json.loads(ns.args)
    threads = int(args.get("threads", 1))
    import torch

    torch.set_num_threads(threads)
    return ns.lib, args


def emit(result: dict) -> None:
    """Print the one JSON line the driver reads (always the last line of stdout), with the device it ran on."""
    import torch
    import transformers

    result.setdefault("versions", {"torch": torch.__version__, "transformers": transformers.__version__})
    result["peak_rss_mb"] = peak_rss_mb()
    result.update(device_info())
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


def clock() -> float:
    """``time.perf_counter()`` after the GPU has finished the work queued so far (its kernels run asynchronously:
    without this a timer would read when the work was queued, not done). Every workload timer reads this."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def device_info() -> dict:
    """The device the workload ran on (a CUDA card's name, else the CPU's model) and its peak GPU memory."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"device": torch.cuda.get_device_name(), "cuda_max_memory_allocated": torch.cuda.max_memory_allocated(),
                "cuda_max_memory_reserved": torch.cuda.max_memory_reserved()}
    return {"device": f"cpu: {cpu_model()}"}


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def peak_rss_mb() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# ------------------------------------------------------------------------------------------ libraries


def library(lib: str):
    """(PPOConfig, PPOTrainer, AutoModelForCausalLMWithValueHead, create_reference_model) of ``lib``."""
    if lib == "ours":
        import rlhf_core as L
    elif lib == "trl":
        import trl as L
    else:
        raise ValueError(lib)
    return L.PPOConfig, L.PPOTrainer, L.AutoModelForCausalLMWithValueHead, L.create_reference_model


def bf16_weights_kwargs(lib: str, args: dict) -> dict:
    """``PPOConfig``'s ``bf16_weights`` for a workload: rlhf_core only (classic TRL has no such field). The
    argument ``"bf16_weights"``: true (bf16 weights, fp32 masters), false or absent (fp32 weights, pinned: on a
    CUDA GPU rlhf_core's default picks bf16 weights, and a row labelled fp32 or autocast must not), or
    ``"default"`` (the field left out: what a user gets, bf16 weights on a bf16-capable GPU, fp32 elsewhere)."""
    value = args.get("bf16_weights", False)
    if lib != "ours" or value == "default":
        return {}
    return {"bf16_weights": bool(value)}


def version_of(lib: str) -> str:
    if lib in ("trl", "trl116"):
        import trl

        return f"trl {trl.__version__}"
    if lib == "hf":
        import transformers

        return f"transformers {transformers.__version__} generate"
    import importlib.metadata as md

    try:
        return f"rlhf_core {md.version('rlhf-pipeline')}"
    except md.PackageNotFoundError:
        return "rlhf_core (editable)"


# ------------------------------------------------------------------------------------------ tokenizer


def tokenizer_json_path(name: str) -> Path:
    return CACHE_DIR / "tokenizers" / f"{name}.json"


def train_tokenizer(corpus: list[str], vocab_size: int, path: Path) -> None:
    """Train a byte-level BPE with ``tokenizers`` only and save its tokenizer.json (version neutral)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    backend.save(str(path))


def load_tokenizer(path: Path, padding_side: str = "right"):
    """Wrap the saved ``tokenizers`` file in the running transformers' PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(path)), eos_token=EOS, bos_token=EOS, pad_token=PAD,
        unk_token=UNK, padding_side=padding_side,
    )


# ------------------------------------------------------------------------------------------ models


def checkpoint_dir(name: str) -> Path:
    return CACHE_DIR / "models" / name


def save_neutral(model, v_head_state: dict, arch: dict, path: Path) -> None:
    """Write arch.json + model.safetensors (plain state dict + v_head.summary.*): loads in both stacks."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state.update({f"v_head.summary.{k}": v.detach().cpu().contiguous() for k, v in v_head_state.items()})
    tmp = path / "model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.rename(path / "model.safetensors")
    (path / "arch.json").write_text(json.dumps(arch, indent=1))


def build_random(arch: dict, seed: int):
    """A GPT2LMHeadModel from config kwargs with fixed seeds, plus a fresh value head state."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(GPT2Config(**arch))
        head = torch.nn.Linear(arch["n_embd"], 1)
    return model, {"weight": head.weight.detach(), "bias": head.bias.detach()}


def ensure_random_checkpoint(size: str, seed: int = 0) -> Path:
    path = checkpoint_dir(f"{size}-seed{seed}")
    if not (path / "model.safetensors").exists():
        model, head = build_random(SIZES[size], seed)
        save_neutral(model, head, SIZES[size], path)
    return path


def load_transformer(path: Path):
    """The plain GPT2LMHeadModel of a neutral checkpoint, and its value-head tensors."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel

    arch = json.loads((path / "arch.json").read_text())
    with torch.random.fork_rng(devices=[]):
        model = GPT2LMHeadModel(GPT2Config(**arch))
    state = load_file(str(path / "model.safetensors"))
    v_head = {k[len("v_head.summary."):]: state.pop(k) for k in list(state) if k.startswith("v_head.summary.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and not k.endswith(".attn.bias") and not k.endswith("masked_bias")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    return model, v_head


def load_policy(lib: str, path: Path, peft_config=None):
    """A value-head policy of ``lib`` with the checkpoint's weights (value-head dropout off)."""
    import torch

    _, _, value_head_cls, _ = library(lib)
    model, v_head = load_transformer(path)
    kwargs = {"summary_dropout_prob": 0.0}
    if peft_config is not None:
        kwargs["peft_config"] = peft_config
    policy = value_head_cls.from_pretrained(model, **kwargs)
    with torch.no_grad():
        policy.v_head.summary.weight.copy_(v_head["weight"])
        policy.v_head.summary.bias.copy_(v_head["bias"])
    return policy


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["c_attn"], bias="none",
                      task_type="CAUSAL_LM")


# ------------------------------------------------------------------------------------------ data


def synthetic_batch(n: int, query_len: tuple[int, int], response_len: tuple[int, int], vocab: int, seed: int):
    """Deterministic queries, responses (no special ids) and scores, identical in both environments."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lo = 3  # ids 0..2 are EOS, PAD, UNK
    queries = [torch.randint(lo, vocab, (int(torch.randint(query_len[0], query_len[1] + 1, (1,), generator=g)),),
                             generator=g) for _ in range(n)]
    responses = [torch.randint(lo, vocab, (int(torch.randint(response_len[0], response_len[1] + 1, (1,), generator=g)),),
                               generator=g) for _ in range(n)]
    scores = [torch.randn((), generator=g) for _ in range(n)]
    return queries, responses, scores


def left_padded(queries: list, pad_id: int) -> tuple:
    """One left-padded batch of 1-d id tensors: ``(input_ids, attention_mask)``, both (n, longest)."""
    import torch

    width = max(len(q) for q in queries)
    ids = torch.full((len(queries), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, q in enumerate(queries):
        ids[i, width - len(q):], mask[i, width - len(q):] = q, 1
    return ids, mask


def cut_after_eos(rows, eos_id: int) -> list:
    """Each generated row up to and including its first ``eos_id`` (the whole row when it has none)."""
    return [row[: int((row == eos_id).nonzero()[0]) + 1] if (row == eos_id).any() else row for row in rows]


def profiled_step(lib: str, args: dict):
    """The step bench's trainer and batch for the profiling scripts: ``(trainer, tokenizer, queries, responses,
    scores)`` on the random ``args["size"]`` model (batch 32 / mini-batch 8 on tiny, 8 / 4 otherwise)."""
    PPOConfig, PPOTrainer, _, _ = library(lib)
    size = args.get("size", "tiny")
    tokenizer = load_tokenizer(tokenizer_json_path("default"))
    policy = load_policy(lib, ensure_random_checkpoint(size, seed=0))
    bs, mb = args.get("batch_size", 32 if size == "tiny" else 8), args.get("mini_batch_size", 8 if size == "tiny" else 4)
    trainer = PPOTrainer(PPOConfig(batch_size=bs, mini_batch_size=mb, ppo_epochs=args.get("ppo_epochs", 4),
                                   learning_rate=1e-5, seed=0,
                                   accelerator_kwargs={"mixed_precision": args["mixed_precision"]}
                                   if args.get("mixed_precision") else {}), policy, None, tokenizer)
    vocab = min(len(tokenizer), SIZES[size]["vocab_size"])
    return (trainer, tokenizer, *synthetic_batch(bs, (8, 16), (16, 32), vocab, seed=1))


def rt_polarity_lines() -> list[str]:
    """All snippets of the rt-polarity corpus (latin-1 text files), or [] when it is not present."""
    lines: list[str] = []
    for name in ("rt-polarity.pos.txt", "rt-polarity.neg.txt"):
        p = RT_POLARITY / name
        if p.exists():
            lines += [l.strip() for l in p.read_text(encoding="latin-1").splitlines() if l.strip()]
    return lines


class PhaseClock:
    """Seconds per phase of each step, from synchronised timers around named methods of a trainer instance.

    ``wrap(trainer, "_sample", "generation")`` times every call of ``trainer._sample`` as the phase
    "generation" (``when(args, kwargs)`` can restrict it to some calls); ``end_step()`` closes a step. A method
    that does not exist is an error: a renamed method must not silently drop out of the table.
    """

    def __init__(self):
        self.current: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, phase: str, when=None) -> None:
        method = getattr(obj, name, None)
        if method is None:
            raise AttributeError(f"{type(obj).__name__} has no method {name!r} to time as phase {phase!r}")

        def timed(*args, **kwargs):
            if when is not None and not when(args, kwargs):
                return method(*args, **kwargs)
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[phase] = self.current.get(phase, 0.0) + clock() - start

        setattr(obj, name, timed)

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def matmul_params(model) -> int:
    """Weights that take part in a matmul per token (linear layers and the LM head; not the input embedding,
    which is a lookup): the N of the 2 x N FLOPs-per-token estimate."""
    import torch

    seen, total = set(), 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        kind = type(module).__name__
        if isinstance(module, torch.nn.Linear) or kind == "Conv1D":
            if id(weight) not in seen:
                seen.add(id(weight))
                total += weight.numel()
    return total


class Timer:
    def __enter__(self):
        self.t = clock()
        return self

    def __exit__(self, *exc):
        self.seconds = clock() - self.t
