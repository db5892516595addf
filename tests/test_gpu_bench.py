"""The GPU bench's CPU-testable parts (bench/gpu/): card peaks, model FLOPs and decode bytes, which bundle wheel an
interpreter installs, the plan, the tables; the workloads' GPU behaviour (synchronised timers, no forced CPU); and,
``slow``, ``SMOKE=1 bash bench/gpu/run.sh``: the same runner, installs and rows on this CPU at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "bench" / "gpu"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu():
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(GPU))
    names = ("peaks", "roofline", "install", "bundle", "driver", "render")
    return {name: load(GPU / f"{name}.py", f"gpu_{name}") for name in names}


def test_device_names_map_to_their_card(gpu):
    peaks = gpu["peaks"]
    assert peaks.card("NVIDIA H100 80GB HBM3") == "H100 SXM" and peaks.card("NVIDIA H100 PCIe") == "H100 PCIe"
    assert peaks.card("NVIDIA H200") == "H200 SXM" and peaks.card("NVIDIA H200 NVL") == "H200 NVL"
    assert peaks.card("cpu: AMD EPYC") is None and peaks.peak("NVIDIA A100-SXM4-80GB", "bf16") is None
    assert peaks.peak("NVIDIA H200", "hbm") == 4.8 and peaks.peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4


def test_qwen2_shape_has_the_published_dimensions(gpu):
    """24 layers of hidden 896 with 2 KV heads of 64; 494.0 M parameters (tied head), 358 M of them in matmuls
    besides the 136 M-parameter head: the counts published for Qwen2-0.5B."""
    import common
    from transformers import Qwen2Config, Qwen2ForCausalLM

    roofline = gpu["roofline"]
    assert roofline.shape("qwen2-0.5b") == roofline.Shape(layers=24, hidden=896, kv_width=128)
    assert roofline.shape("gpt2s") == roofline.Shape(layers=12, hidden=768, kv_width=768)
    online = load(ROOT / "bench" / "workloads" / "online.py", "online_workload")
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**online.ARCHS["qwen2-0.5b"][1]))
    per_layer = 2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864  # q, o; k, v; gate, up, down
    assert common.matmul_params(model) == 24 * per_layer + 896 * 151936
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 494.0


def test_flops_and_bytes_by_hand(gpu):
    r = gpu["roofline"]
    s = r.Shape(layers=2, hidden=8, kv_width=4)
    # 3 tokens through 10 matmul weights: 2*10*3 = 60; 5 attention pairs: 4*2*8*5 = 320
    assert r.forward_flops(10, s, tokens=3, pairs=5) == 380
    assert r.sequence_pairs(2, 3) == 12  # two rows of 1 + 2 + 3 pairs
    assert r.decode_pairs(1, prompt=2, new=3) == 3 + 4 + 5  # the t-th new token sees 2 + t keys
    # 3 steps: weights 10 params x 2 bytes x 3 = 60; KV: 2 (K, V) x 2 layers x 4 wide x 2 bytes x 12 pairs = 384
    assert r.decode_bytes(10, s, rows=1, prompt=2, new=3, bytes_per_value=2) == 60 + 384
    online = r.phase_flops("online", 10, s, rows=1, prompt_tokens=2, completion_tokens=3)
    ppo = r.phase_flops("ppo", 10, s, rows=1, prompt_tokens=2, completion_tokens=3, ppo_epochs=4)
    full = r.forward_flops(10, s, 5, r.sequence_pairs(1, 5))
    assert online["reference forward"] == full and online["policy update"] == 3 * full and "policy forward" not in online
    assert ppo["policy forward"] == full and ppo["policy update"] == 12 * full
    assert online["generation"] == r.forward_flops(10, s, 3, 12)


def test_an_interpreter_installs_its_own_twin(gpu, tmp_path):
    install = gpu["install"]
    assert install.installable("multiprocess-0.70.19-py312-none-any.whl", (3, 12))
    assert not install.installable("multiprocess-0.70.19-py312-none-any.whl", (3, 11))
    assert install.installable("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 12))
    assert not install.installable("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.whl", (3, 9))
    assert install.installable("vaderSentiment-3.3.2-py2.py3-none-any.whl", (3, 11))
    assert not install.installable("x-1.0-cp312-cp312-macosx_11_0_arm64.whl", (3, 12))
    for folder, name in (("wheels", "multiprocess-0.70.19-py312-none-any.whl"),
                         ("twins", f"multiprocess-0.70.19-py{sys.version_info[0]}{sys.version_info[1]}-none-any.whl")):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).touch()
    here = install.wheel_for("multiprocess==0.70.19", tmp_path)
    assert here.parent.name == ("wheels" if sys.version_info[:2] == (3, 12) else "twins")
    with pytest.raises(SystemExit, match="no wheel of dill==0.4.1"):
        install.wheel_for("dill==0.4.1", tmp_path)


def test_wheel_lists_parse_and_name_their_bad_line(gpu, tmp_path):
    bundle = gpu["bundle"]
    sets = bundle.requirements()
    assert set(sets) == {"ours", "trl", "trl116"}
    assert "transformers==5.23.0" in sets["ours"] and "transformers==4.57.6" in sets["trl"]
    assert "trl==1.16.0" in sets["trl116"] and not any(r.startswith("trl==") for r in sets["ours"])
    bad = tmp_path / "wheels.txt"
    bad.write_text("ours transformers==5.23.0\nours peft\n")
    with pytest.raises(ValueError, match=r"wheels.txt:2: expected 'SET NAME==VERSION'"):
        bundle.requirements(bad)
    assert bundle.version_specific("multiprocess-0.70.19-py312-none-any.whl")
    assert not bundle.version_specific("tokenizers-0.23.3-cp310-abi3-manylinux2014_x86_64.whl")
    assert not bundle.version_specific("six-1.0-py2.py3-none-any.whl")


def test_the_plan_runs_every_workload_and_library_with_the_same_arguments_as_the_smoke_run(gpu, monkeypatch):
    driver = gpu["driver"]
    rows = driver.plan()
    assert {(r.workload, r.lib) for r in rows} == {
        ("generate", "ours"), ("generate", "trl"), ("generate", "hf"), ("step", "ours"), ("step", "trl"),
        ("online", "ours"), ("online", "trl116"), ("ppo_loop", "ours"), ("parity", "ours"), ("parity", "trl"),
        ("decode_parity", "ours")}
    assert all((ROOT / "bench" / "workloads" / f"{driver.FILES[r.workload]}.py").exists() for r in rows)
    first = [r for r in rows if not r.second]
    for label in {r.label for r in first if r.lib != "ours" and r.label != "parity"}:  # every peer row has ours
        assert any(r.label in (label, label + " weights") and r.lib == "ours" for r in first), label
    gpu_sizes = driver.sizes()
    monkeypatch.setattr(driver, "SMOKE", True)
    smoke = driver.sizes()
    # the smoke run passes the same arguments (tiny values): it overrides no argument the GPU run lacks
    assert all(set(driver.SMOKE_SIZES[k]) <= set(driver.GPU_SIZES[k]) for k in driver.SMOKE_SIZES)
    assert smoke["gen"]["size"] == "tiny" and set(smoke["gen"]) == set(gpu_sizes["gen"])
    assert gpu_sizes["gen"]["num_prompts"] == 64 and gpu_sizes["gen"]["max_new_tokens"] == 128
    assert gpu_sizes["qwen"]["arch"] == "qwen2-0.5b" and gpu_sizes["qwen"]["bf16"]
    # the target rows first: generate x3, the decode's parity in fp32 and bf16, the PPO default / TRL bf16 pair,
    # GRPO and RLOO bf16 against TRL 1.16
    assert [(r.label, r.lib) for r in rows[:11]] == [
        ("generate", "ours"), ("generate", "trl"), ("generate", "hf"), ("decode parity fp32", "ours"),
        ("decode parity default", "ours"), ("ppo default", "ours"), ("ppo bf16", "trl"),
        ("grpo bf16", "ours"), ("grpo bf16", "trl116"), ("rloo bf16", "trl116"), ("rloo bf16", "ours")]
    assert all(r.label.startswith("qwen2") for r in rows[11:15])
    assert gpu_sizes["step"]["warmup"] >= 4 and gpu_sizes["step"]["steps"] >= 5
    monkeypatch.setenv("PASSES", "1")
    assert not any(r.second for r in driver.plan())
    monkeypatch.setenv("ONLY", "ppo fp32, parity")  # a rerun of named rows: those labels, every library
    assert {(r.label, r.lib) for r in driver.plan()} == {
        ("ppo fp32", "ours"), ("ppo fp32", "trl"), ("parity", "ours"), ("parity", "trl")}


def test_every_workload_that_builds_a_ppo_config_pins_its_precision():
    """On a GPU ``PPOConfig``'s default picks bf16 weights: a row that does not pass ``bf16_weights`` measures that
    default whatever its label says (the 2026-11-28 H200 run's decode-parity and PPO-parity rows did)."""
    for path in sorted((ROOT / "bench" / "workloads").glob("*.py")):
        text = path.read_text()
        if "PPOConfig(" in text:
            assert text.count("bf16_weights_kwargs(") >= text.count("PPOConfig("), path.name


def test_results_reach_out_after_every_save(gpu, tmp_path, monkeypatch):
    """The device tool returns only $OUT: every save copies the results and the log there."""
    driver = gpu["driver"]
    log = tmp_path / "log.txt"
    log.write_text("a line")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv("LOG", str(log))
    report = {"rows": [], "probe": {}, "started": "t0"}
    driver.save(report, tmp_path / "results-gpu.json")
    assert json.loads((tmp_path / "out" / "results-gpu.json").read_text()) == report
    assert (tmp_path / "out" / "results-gpu.md").read_text().startswith("# GPU bench results")
    assert (tmp_path / "out" / "gpu-bench-log.txt").read_text() == "a line"


def test_clock_waits_for_the_gpu_and_online_uses_it(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import common

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(1))
    common.clock()
    assert calls == [1]
    online = load(ROOT / "bench" / "workloads" / "online.py", "online_workload")
    kwargs = online.config_kwargs({**online.DEFAULTS, "bf16": True}, "unused-output-dir")
    assert kwargs["use_cpu"] is False and kwargs["bf16"] is True  # CUDA present: nothing forces the CPU


def test_tables_compare_ours_with_the_peers_and_the_card(gpu):
    """Rows as the driver records them, on an H200: ratios of medians, the bandwidth floor, MFU by phase."""
    render = gpu["render"]
    gen = {"size": "gpt2s", "num_prompts": 64, "query_len": [4, 12], "max_new_tokens": 128}
    device = "NVIDIA H200"

    def row(label, lib, workload, args, result):
        return {"label": label, "lib": lib, "workload": workload, "args": args, "device": device,
                "result": {"lib": lib, "device": device, **result}}

    stats = {"replays": 126, "eager_steps": 2, "captures": 1, "capture_failures": []}
    steps = [{"generation": 1.0, "reward": 0.1, "reference forward": 0.4}] * 3
    rows = [
        row("generate", "ours", "generate", gen, {"seconds": [0.1, 0.1], "generated_tokens": [8192, 8192],
                                                  "prompt_tokens": 512, "decode_stats": stats}),
        row("generate", "trl", "generate", gen, {"seconds": [2.0], "generated_tokens": [8192], "prompt_tokens": 512}),
        row("ppo fp32", "ours", "step", {}, {"step_seconds": [1.0, 3.0, 2.0], "cuda_max_memory_allocated": 8e9,
                                             "matmul_params": 124e6, "rows": 64, "prompt_tokens_per_step": 3584,
                                             "tokens_per_step": 10752, "size": "gpt2s", "ppo_epochs": 4}),
        row("ppo fp32", "trl", "step", {}, {"step_seconds": [4.0], "cuda_max_memory_allocated": 9e9}),
        row("qwen2-0.5b grpo", "ours", "online", {"completions_per_step": 64},
            {"step_seconds": [9.0, 2.0, 2.0, 2.0], "phase_seconds": [{}] + steps, "arch": "qwen2-0.5b",
             "prompt_tokens": [0, 400, 400, 400], "completion_tokens": [0, 8192, 8192, 8192],
             "matmul_params": 493961216}),
        row("decode parity fp32", "ours", "decode_parity", gen,
            {"precision": "fp32", "prompts": 64, "tokens": 8192, "max_gap": 0.0, "tolerance": 1e-3,
             "over_tolerance": 0, "same_as_transformers_generate": 63, "decode_stats": stats}),
    ]
    text = render.render({"rows": rows, "probe": {"device": device}, "started": "t0"})
    assert "| classic TRL 0.11.4 | fp32 (its generate ignores mixed precision) | 2 | 4,096 | 20 | 1 |" in text
    assert "126 CUDA-graph replays" in text and "H200 SXM" in text
    r = gpu["roofline"]
    ppo = r.phase_flops("ppo", 124e6, r.shape("gpt2s"), 64, 3584, 10752 - 3584, 4)
    ppo_mfu = 100 * (sum(ppo.values()) - ppo["generation"]) / 2.0 / 989.4e12  # the median step: 2 s
    assert f"| ppo fp32 | 2 | 4 | 0.5 | trl | {ppo_mfu:.2g}% / - | 8 / 9 | 0.889 |" in text
    assert "| generate [ours] | 1 | 126 | 2 | none | 0 |" in text  # every row that sampled: its DECODE_STATS
    assert "| fp32 | 8192 | 0 | 0 (> 0.001) | 63 of 64 | 126 / 2 |" in text  # the decode's greedy tokens re-scored
    # the policy update is the rest of the step: 2.0 - 1.0 - 0.1 - 0.4
    assert "| qwen2-0.5b grpo ours | policy update | 0.5 | 25% |" in text
    flops = r.phase_flops("online", 493961216, r.shape("qwen2-0.5b"), 64, 400, 8192)
    mfu = 100 * flops["generation"] / 1.0 / 989.4e12
    assert f"| qwen2-0.5b grpo ours | generation | 1 | 50% | 8,192 | {mfu:.2g}% |" in text
    floor_line = next(line for line in text.splitlines() if line.startswith("| bandwidth floor"))
    assert "4.8 TB/s" in floor_line and "ours at" in floor_line


@pytest.mark.slow
def test_smoke_run_of_the_gpu_bench(tmp_path):
    """``SMOKE=1 bash bench/gpu/run.sh``, first pass: installs the bundle's three library sets into --target folders
    when there is a bundle (else the local venvs stand in), then runs every workload of the plan at tiny sizes."""
    bundle = (GPU / "bundle" / "wheels").exists()
    venvs = all((ROOT / p).exists() for p in ("bench/.trl-venv/bin/python", "bench/.trl116-venv/bin/python"))
    if not (bundle or venvs):
        pytest.skip("neither bench/gpu/bundle (make bench-gpu-bundle) nor the TRL venvs (make bench) are here")
    env = {**os.environ, "SMOKE": "1", "PASSES": "1", "WORK": str(tmp_path / "work"),
           "RESULTS": str(tmp_path / "results-gpu")}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(GPU / "run.sh")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "results-gpu.json").read_text())
    assert report["smoke"] and len(report["rows"]) == 25
    assert all("result" in r and r["device"].startswith("cpu") for r in report["rows"])
    if bundle:  # the library sets came from the --target folders
        assert all("/site-" in env_["transformers_from"] for env_ in report["environments"].values())
    assert report["parity"]["weights_max_abs_diff"] < 1e-4
    text = (tmp_path / "results-gpu.md").read_text()
    assert "## Generation" in text and "qwen2-0.5b grpo trl 1.16.0" in text and "Rows that did not run" not in text
    # issue 23's rows: PPO at its default precision, GRPO/RLOO in bf16, each beside its peer
    assert all(f"| {label} |" in text for label in ("ppo default", "grpo bf16", "rloo bf16"))
    assert "qwen2-0.5b ppo default" in text
