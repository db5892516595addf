"""The sampling loop (``trainers/decode``: static KV cache, fixed-shape token step) against ``model.generate``.

Greedy decoding gives ``generate``'s tokens (the test also checks the top-two logit margin along the path is far
above the two computations' rounding differences, so equality holds on every CPU kind). Sampling draws from the
distribution ``generate`` draws from: the loop's log-probs along its own samples equal ``generate``'s processed
distribution (temperature, top-k, top-p, suppressed tokens, minimum length), the exponential race samples the
categorical distribution, and for the same seed the tokens are ``generate``'s. The token step reads no value on
the host (it runs on the meta device, where any read raises): the property a CUDA graph capture needs. The step
runner, with a stand-in graph backend that replays the step itself, gives the eager tokens.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from rlhf_core.models.tiny import tiny_causal_lm
from rlhf_core.trainers import decode as D
from rlhf_core.trainers.decode import decode, decode_settings, sample_exponential_race, static_cache_fits
from rlhf_core.trainers.generation import generate_batched, pad_queries


@pytest.fixture(scope="module")
def setup(decoding_setup):
    return decoding_setup


def _settings(model, tok, batch, **kwargs):
    settings = decode_settings(model, batch["input_ids"].shape[1], {"pad_token_id": tok.pad_token_id, **kwargs})
    assert settings is not None
    return settings


def _ours(model, tok, prompts, graphs=None, eos_check_every=None, **kwargs):
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    return decode(model, batch["input_ids"], batch["attention_mask"], _settings(model, tok, batch, **kwargs),
                  takes_logits_to_keep=True, graphs=graphs, eos_check_every=eos_check_every)


def _theirs(model, tok, prompts, **kwargs):
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    return model.generate(**batch, pad_token_id=tok.pad_token_id, **kwargs)


def _greedy_margin(model, sequences, attention_mask, width):
    """Smallest top-1 minus top-2 logit over the generated positions of ``sequences`` (teacher-forced)."""
    mask = torch.cat([attention_mask, torch.ones_like(sequences[:, width:])], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, width - 1:-1]
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 12}, {"max_new_tokens": 9, "min_new_tokens": 4},
                                    {"max_new_tokens": 6, "suppress_tokens": [5, 6, 7]},
                                    {"max_new_tokens": 12, "repetition_penalty": 1.3}])
def test_greedy_tokens_equal_generate(setup, kwargs):
    tok, model, prompts = setup
    ours, logprobs = _ours(model, tok, prompts, do_sample=False, **kwargs)
    theirs = _theirs(model, tok, prompts, do_sample=False, **kwargs)
    assert ours.shape == theirs.shape and torch.equal(ours, theirs)
    assert logprobs.shape == (len(prompts), ours.shape[1] - 7) and (logprobs <= 0).all()
    # the static cache's logits differ from generate's by ~1e-6 (another summation length): a margin 100x that
    # means no CPU kind can see another argmax
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    if not {"suppress_tokens", "min_new_tokens", "repetition_penalty"} & set(kwargs):
        assert _greedy_margin(model, ours, batch["attention_mask"], 7) > 1e-4


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 12, "top_k": 0, "top_p": 1.0},
                                    {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20, "top_p": 0.9},
                                    # Qwen2-Instruct's generation_config
                                    {"max_new_tokens": 8, "temperature": 0.7, "top_k": 20, "top_p": 0.8,
                                     "repetition_penalty": 1.1}])
def test_sampled_tokens_equal_generate_for_the_same_seed(setup, kwargs):
    """Same random numbers in the same order. (A race decided by the last bit of a probability could still go
    the other way on some CPU: about 1e-6 per token, so this is ~1e-4 for the whole test.)"""
    tok, model, prompts = setup
    torch.manual_seed(5)
    ours, _ = _ours(model, tok, prompts, do_sample=True, **kwargs)
    torch.manual_seed(5)
    theirs = _theirs(model, tok, prompts, do_sample=True, **kwargs)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kwargs", [{"temperature": 0.7, "top_k": 20, "top_p": 0.9},
                                    {"top_k": 0, "top_p": 0.8, "suppress_tokens": [5, 6]},
                                    {"top_k": 50, "min_new_tokens": 5},
                                    {"repetition_penalty": 1.5, "min_p": 0.02, "temperature": 0.8}])
def test_logprobs_are_generates_processed_distribution(setup, kwargs):
    """Along our own samples, each token's log-prob equals log-softmax of the scores generate's processors give
    for the same prefix (generate one token from each prefix with output_scores)."""
    tok, model, prompts = setup
    torch.manual_seed(2)
    ours, logprobs = _ours(model, tok, prompts, do_sample=True, max_new_tokens=6, **kwargs)
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    width = batch["input_ids"].shape[1]
    for t in range(ours.shape[1] - width):
        prefix = ours[:, :width + t]
        mask = torch.cat([batch["attention_mask"], torch.ones_like(prefix[:, width:])], dim=1)
        step_kwargs = dict(kwargs)
        if "min_new_tokens" in step_kwargs:  # the prefix already holds t new tokens
            step_kwargs["min_new_tokens"] = max(0, step_kwargs["min_new_tokens"] - t)
            if step_kwargs["min_new_tokens"] == 0:
                del step_kwargs["min_new_tokens"]
        out = model.generate(input_ids=prefix, attention_mask=mask, pad_token_id=tok.pad_token_id, do_sample=True,
                             max_new_tokens=1, output_scores=True, return_dict_in_generate=True, **step_kwargs)
        expected = out.scores[0].float().log_softmax(-1).gather(-1, ours[:, width + t, None])[:, 0]
        alive = logprobs[:, t] != 0  # finished rows hold the pad id with log-prob 0
        assert torch.allclose(logprobs[alive, t], expected[alive], atol=1e-4), t  # logits differ by ~1e-6


def test_greedy_stops_at_eos_and_pads_finished_rows(setup):
    tok, model, prompts = setup
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    with torch.no_grad():
        positions = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)  # left padding: count real tokens
        first = model(**batch, position_ids=positions).logits[:, -1].argmax(-1)  # each row's greedy first token
    # make row 0's first greedy token the EOS: that row finishes at once, the others go on
    settings = decode_settings(model, batch["input_ids"].shape[1], {"max_new_tokens": 5, "do_sample": False,
                                                                     "eos_token_id": int(first[0]), "pad_token_id": 1})
    out, logprobs = decode(model, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True)
    width = batch["input_ids"].shape[1]
    assert out[0, width] == first[0] and (out[0, width + 1:] == 1).all()
    assert logprobs[0, 0] < 0 and (logprobs[0, 1:] == 0).all()


@pytest.mark.parametrize("do_sample", [False, True])
def test_reading_eos_every_few_tokens_changes_no_token(setup, do_sample):
    """Steps after every row finished only append pads, which the output drops: every=1 and every=4 agree."""
    tok, model, prompts = setup
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    with torch.no_grad():
        first = model(**batch, position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    eos = int(first[1].argmax())  # row 1 stops at once; the others stop when they draw it, or run to the end
    outs = []
    for every in (1, 4):
        torch.manual_seed(7)
        outs.append(_ours(model, tok, prompts, eos_check_every=every, do_sample=do_sample, max_new_tokens=11,
                          eos_token_id=eos))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_exponential_race_samples_the_categorical_distribution():
    torch.manual_seed(0)
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0]]).expand(60000, -1)
    counts = torch.bincount(sample_exponential_race(probs), minlength=4).float() / 60000
    assert counts[3] == 0  # a zero-probability token is never drawn
    assert torch.allclose(counts[:3], torch.tensor([0.6, 0.3, 0.1]), atol=0.01)  # ~5 standard errors


def test_sampling_matches_generates_distribution(setup):
    tok, model, prompts = setup
    prompt = [prompts[1]] * 400
    freq = []
    for fast in (True, False):
        torch.manual_seed(1)
        import rlhf_core.trainers.generation as G

        original = G.decode_plan
        if not fast:
            G.decode_plan = lambda *a: "forced by the test"
        try:
            out = generate_batched(model, tok, prompt, device="cpu", batch_size=200, return_prompt=False,
                                   do_sample=True, top_k=20, temperature=0.8, max_new_tokens=1)
        finally:
            G.decode_plan = original
        freq.append(torch.bincount(torch.stack([o[0] for o in out]), minlength=model.config.vocab_size).float() / 400)
    # same next-token distribution: total variation within sampling noise of 400 draws each
    assert 0.5 * (freq[0] - freq[1]).abs().sum() < 0.2


def test_other_settings_go_to_generate(setup):
    tok, model, _ = setup
    assert decode_settings(model, 4, {"max_new_tokens": 3, "no_repeat_ngram_size": 2}) is None
    assert D.decode_plan(model, 4, {"max_new_tokens": 3, "no_repeat_ngram_size": 2}) == \
        "generation settings: no_repeat_ngram_size"
    assert decode_settings(model, 4, {"max_new_tokens": 3, "num_beams": 2}) is None
    assert decode_settings(model, 4, {"max_length": 9}) is None  # only max_new_tokens is implemented
    assert decode_settings(model, 4, {"max_new_tokens": 3, "top_p": 0.9, "temperature": 0.7}) is not None
    # neutral values add no processor in generate either (TRL 1.16's GRPO passes repetition_penalty=1.0)
    assert decode_settings(model, 4, {"max_new_tokens": 3, "repetition_penalty": 1.0, "num_beams": 1}) is not None


def _qwen2(**extra):
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=128, vocab_size=512, **extra))


def test_models_the_static_cache_does_not_fit_go_to_generate(setup):
    _, model, _ = setup
    assert static_cache_fits(model) and static_cache_fits(_qwen2())
    assert not static_cache_fits(_qwen2(use_sliding_window=True, sliding_window=4, max_window_layers=0))
    eager = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    eager.config._attn_implementation = "flash_attention_2"  # takes no custom 4-d mask
    assert not static_cache_fits(eager)


@pytest.mark.parametrize("build", [
    lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512)), _qwen2])
def test_token_step_reads_no_value_on_the_host(build):
    """On the meta device every tensor has a shape and no value: the step runs only if nothing in it (model
    forward, processors, sampling, bookkeeping) reads a value back, as replaying one CUDA graph per token needs."""
    settings = D.DecodeSettings(max_new_tokens=8, do_sample=True, eos_ids=(0, 3), pad_id=1, suppress_ids=(1,),
                                eos_blocked_steps=2, temperature=0.7, top_k=20, top_p=0.9,
                                min_p=0.05, repetition_penalty=1.1)
    with torch.device("meta"):
        model = build().eval()
        state = D.DecodeState(model, 3, 16, settings, torch.device("meta"), torch.float32)
        D.token_step(model, state)
        D.token_step(model, state)
        assert state.out.device.type == "meta"
        with pytest.raises(RuntimeError, match="meta"):  # what a host read does there
            bool(state.unfinished.any())


# Operators that read a value or size the result by the data on a GPU (``isin`` sorts and uniques its inputs there).
HOST_READS = {"item", "_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "isin", "bincount", "repeat_interleave"}


@pytest.mark.parametrize("build", [
    lambda: GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512)), _qwen2])
def test_token_step_calls_no_operator_that_reads_values(build):
    """The meta-device run cannot see a GPU kernel that syncs inside (``isin`` on CUDA); this lists the step's
    operators as dispatched and refuses the ones that do."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    settings = D.DecodeSettings(max_new_tokens=8, do_sample=True, eos_ids=(0, 3), pad_id=1, suppress_ids=(1,),
                                eos_blocked_steps=2, temperature=0.7, top_k=20, top_p=0.9,
                                min_p=0.05, repetition_penalty=1.1)
    model = build().eval()
    state = D.DecodeState(model, 64, 16, settings, torch.device("cpu"), torch.float32)
    state.start(torch.randint(0, 512, (64, 4)), torch.ones(64, 4, dtype=torch.long), settings)
    state.slot.fill_(4)
    with torch.no_grad(), Record() as record:
        D.token_step(model, state)
    assert record.names and not (record.names & HOST_READS), record.names & HOST_READS


class ReplayItself:
    """A stand-in graph backend: 'records' the step by keeping it, and replays it eagerly."""

    warmup_steps = 2

    def __init__(self, fail: bool = False):
        self.fail, self.recorded, self.warmups = fail, 0, 0

    @contextlib.contextmanager
    def warmup(self):
        self.warmups += 1
        yield

    def record(self, step):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.recorded += 1
        return step


@pytest.mark.parametrize("do_sample", [False, True])
def test_step_runner_replays_the_eager_tokens_and_keeps_the_state(setup, do_sample):
    tok, model, prompts = setup
    backend = ReplayItself()
    D._KEPT.pop(model, None)
    runs = []
    for graphs in (None, backend, backend):  # eager, then recorded, then the kept state replayed again
        torch.manual_seed(3)
        runs.append(_ours(model, tok, prompts, graphs=graphs, do_sample=do_sample, max_new_tokens=10))
    # the kept state's cache is rounded up to 64 slots (eager: 17): the same tokens, logits within rounding
    for seq, logprobs in runs[1:]:
        assert torch.equal(seq, runs[0][0]) and torch.allclose(logprobs, runs[0][1], atol=1e-5)
    assert backend.recorded == 1 and backend.warmups == backend.warmup_steps and len(D._KEPT[model]) == 1
    state = next(iter(D._KEPT[model].values())).state
    assert state.out.shape[1] == D.CACHE_BUCKET  # 7 + 10 slots rounded up to the bucket
    # a shorter prompt set in the same bucket, and another length, reuse the state and still match eager
    short = [p[:2] for p in prompts]
    torch.manual_seed(4)
    eager = _ours(model, tok, short, do_sample=do_sample, max_new_tokens=5)
    torch.manual_seed(4)
    kept = _ours(model, tok, short, graphs=backend, do_sample=do_sample, max_new_tokens=5)
    assert torch.equal(eager[0], kept[0]) and len(D._KEPT[model]) == 1 and backend.recorded == 1


def test_a_step_that_cannot_be_recorded_runs_eagerly(setup):
    tok, model, prompts = setup
    D._KEPT.pop(model, None)
    failures = len(D.DECODE_STATS["capture_failures"])
    eager, _ = _ours(model, tok, prompts, do_sample=False, max_new_tokens=9)
    fallback, _ = _ours(model, tok, prompts, graphs=ReplayItself(fail=True), do_sample=False, max_new_tokens=9)
    assert torch.equal(eager, fallback)
    assert len(D.DECODE_STATS["capture_failures"]) == failures + 1
    assert "stream is capturing" in D.DECODE_STATS["capture_failures"][-1]
    D._KEPT.pop(model, None)


def test_a_kept_state_follows_weight_updates_and_mode_changes(setup):
    """A captured step reads the parameters' memory: in-place updates are seen; new storage or another
    train/eval flag gets a new state (and a new recording)."""
    tok, _, prompts = setup
    torch.manual_seed(0)
    model = tiny_causal_lm(tok, seed=1).eval()
    backend = ReplayItself()
    first, _ = _ours(model, tok, prompts, graphs=backend, do_sample=False, max_new_tokens=6)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place (tied with the embedding): another greedy path
    after, _ = _ours(model, tok, prompts, graphs=backend, do_sample=False, max_new_tokens=6)
    expected, _ = _ours(model, tok, prompts, do_sample=False, max_new_tokens=6)
    assert torch.equal(after, expected) and not torch.equal(after, first) and backend.recorded == 1
    model.train()
    _ours(model, tok, prompts, graphs=backend, do_sample=False, max_new_tokens=6)
    assert backend.recorded == 2


def test_a_rotary_model_decodes_under_autocast(setup):
    """Under bf16 autocast a rotary model's keys leave the rotation in fp32 while its values are bf16: the static
    cache keeps each in its own dtype (one shared dtype failed), and greedy tokens are generate's."""
    tok, _, prompts = setup
    torch.manual_seed(0)
    model = _qwen2().eval()
    batch = pad_queries(prompts, tok.pad_token_id, left=True)
    settings = _settings(model, tok, batch, do_sample=False, max_new_tokens=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = decode(model, batch["input_ids"], batch["attention_mask"], settings, takes_logits_to_keep=True)
        theirs = model.generate(**batch, pad_token_id=tok.pad_token_id, do_sample=False, max_new_tokens=6)
    assert torch.equal(ours, theirs)
    layer = D.static_cache(1, 8).layers[0]
    layer.lazy_initialization(torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4, dtype=torch.bfloat16))
    assert layer.keys.dtype == torch.float32 and layer.values.dtype == torch.bfloat16


def test_no_graph_is_recorded_with_autocasts_weight_cast_cache_live(monkeypatch):
    """A capture under autocast turns the weight-cast cache off (the cached casts die with the autocast region,
    and a graph reading them would sample from freed memory). CUDA's graph calls are stand-ins here; the
    autocast is the CPU's (the class reads the device type from ``device_type``)."""
    from rlhf_core.trainers import cuda_graphs

    class Graph:
        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())
    backend = cuda_graphs.CudaGraphs()
    backend.device_type = "cpu"
    weight = torch.randn(8, 8)
    seen = []

    def step():
        out = torch.randn(2, 8) @ weight  # a cast of the fp32 weight inside the capture
        seen.append((torch.is_autocast_cache_enabled(), torch.is_autocast_enabled("cpu"), out.dtype))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        step()  # eager (a warm-up step): the cache is on
        backend.record(step)
        step()  # back in the caller's region: its cache as it was
    assert seen == [(True, True, torch.bfloat16), (False, True, torch.bfloat16), (True, True, torch.bfloat16)]
    backend.record(step)  # outside autocast nothing changes
    assert seen[-1][1:] == (False, torch.float32)


def test_a_captured_step_reads_the_written_slots_rounded_to_a_segment(setup, monkeypatch):
    """With a graph backend each step attends to the cache slots written so far rounded up to ``KV_SEGMENT`` (one
    graph per length), not the whole bucketed cache: same tokens as eager, fewer K/V slots read."""
    tok, model, prompts = setup
    D._KEPT.pop(model, None)
    monkeypatch.setattr(D, "KV_SEGMENT", 8)
    layer_class = D._static_layer_class()
    read = []
    update = layer_class.update

    def spy(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        read.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(layer_class, "update", spy)
    torch.manual_seed(3)
    eager, eager_lp = _ours(model, tok, prompts, do_sample=True, max_new_tokens=20, top_k=0)
    backend = ReplayItself()
    read.clear()
    torch.manual_seed(3)
    kept, kept_lp = _ours(model, tok, prompts, graphs=backend, do_sample=True, max_new_tokens=20, top_k=0)
    assert torch.equal(kept, eager) and torch.allclose(kept_lp, eager_lp, atol=1e-5)
    layers = model.config.n_layer
    steps = read[layers:][::layers]  # the first layer's reads, after the prefill's
    assert read[0] == D.CACHE_BUCKET  # the prefill attends to the whole (bucketed) cache
    # the step writing slot 7 + k (k = 0..18) reads ceil((8 + k) / 8) * 8 slots: 8, then 16, then 24, then 32
    assert steps == [-(-(8 + k) // 8) * 8 for k in range(19)]
    assert backend.recorded == 3  # lengths 16, 24 and 32; the first two steps (8, 16 slots) ran as warm-ups
    D._KEPT.pop(model, None)


def test_the_opt_in_compiled_token_step_gives_the_eager_tokens_once_compiled_per_length(setup, monkeypatch):
    """``RLHF_CORE_COMPILE_DECODE=1``: the kept step runs through torch.compile (a counting stand-in backend here:
    dynamo's guards decide recompilation, not the backend): one compilation per attended length, none for a second
    call of the same shape, and the eager tokens."""
    tok, model, prompts = setup
    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(len(graph_module.graph.nodes))
        return graph_module.forward

    monkeypatch.setenv("RLHF_CORE_COMPILE_DECODE", "1")
    monkeypatch.setattr(D, "DECODE_COMPILE_BACKEND", counting)
    torch._dynamo.reset()
    D._KEPT.pop(model, None)
    eager, _ = _ours(model, tok, prompts, do_sample=False, max_new_tokens=40)
    assert not graphs  # no backend: nothing kept, nothing compiled
    for _ in range(2):
        compiled, _ = _ours(model, tok, prompts, graphs=ReplayItself(), do_sample=False, max_new_tokens=40)
        assert torch.equal(compiled, eager)
    assert len(graphs) == 2  # 7 + 40 slots: steps attend to 32, then 64 (the bucket); the second call compiles none
    torch._dynamo.reset()
    D._KEPT.pop(model, None)
