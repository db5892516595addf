"""Reproducibility: the same code and params give byte-identical DVC-tracked outputs in any directory.

A teammate who clones the project elsewhere and re-runs a stage must get the hashes recorded in ``dvc.lock``
(else ``dvc status`` after a re-run lists changed outputs and a registered version's weights hash cannot be
reproduced). Each stage here runs in two projects at different absolute paths (different lengths, so a path
written anywhere shows), the second as from a shell without ``HF_HUB_OFFLINE``; then every file under data/,
models/, metrics/ and plots/ is compared byte by byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _pipeline_project import make_project

TRACKED = ("data", "models", "metrics", "plots")
"""The project folders whose files DVC (or git, for metrics/plots) tracks as stage outputs."""


def tracked_files(root: Path) -> dict[str, bytes]:
    """relative path -> bytes of every file of the stage outputs under ``root``."""
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for folder in TRACKED for p in sorted((root / folder).rglob("*")) if p.is_file()}


def differences(a: dict[str, bytes], b: dict[str, bytes]) -> list[str]:
    """Files present in only one listing, or whose bytes differ (with the first differing line when text)."""
    out = [f"only in one project: {name}" for name in sorted(set(a) ^ set(b))]
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            try:
                lines = zip(a[name].decode().splitlines(), b[name].decode().splitlines())
                first = next(((x, y) for x, y in lines if x != y), ("", ""))
            except UnicodeDecodeError:
                first = ("<binary>", "<binary>")
            out.append(f"{name}: {first[0]!r} != {first[1]!r}")
    return out


def test_saved_training_arguments_leave_out_where_and_how_the_process_ran(tmp_path):
    from transformers import TrainingArguments

    from rlhf_core.trainers.base import RUN_ENVIRONMENT_ARGS, portable_training_args

    here = TrainingArguments(output_dir=str(tmp_path / "a"), seed=3, report_to=[], disable_tqdm=True)
    there = TrainingArguments(output_dir=str(tmp_path / "elsewhere" / "b"), seed=3, report_to=[], disable_tqdm=False)
    saved = portable_training_args(here)
    assert saved == portable_training_args(there)
    assert not set(RUN_ENVIRONMENT_ARGS) & set(saved) and str(tmp_path) not in json.dumps(saved)
    assert saved["seed"] == 3 and saved["learning_rate"] == here.learning_rate  # what shapes training stays
    assert set(saved) == set(here.to_dict()) - set(RUN_ENVIRONMENT_ARGS)


def run_in_two_environments(projects, stages, monkeypatch) -> None:
    """Run ``stages`` in the first project offline (``HF_HUB_OFFLINE=1``, as ``make run`` sets it), then in the
    second as from a shell without it (a plain ``dvc repro``): transformers then loads tokenizers with
    ``local_files_only=False``. Only the tokenizer loader is told so: nothing here can reach a hub."""
    from tasks.run.stage_task import run_stage

    first, second = projects
    for stage in stages:
        run_stage(stage, str(first))
    with monkeypatch.context() as patch:
        patch.setattr("transformers.tokenization_utils_base.is_offline_mode", lambda: False)
        for stage in stages:
            run_stage(stage, str(second))


def test_drop_load_environment_rewrites_only_tokenizer_configs_that_hold_the_keys(tmp_path):
    from tasks.store.outputs import drop_load_environment

    loaded = tmp_path / "model" / "tokenizer_config.json"
    nested = tmp_path / "model" / "tokenizer" / "tokenizer_config.json"
    nested.parent.mkdir(parents=True)
    loaded.write_text('{"local_files_only": true, "pad_token": "<pad>", "is_local": true, "bos_token": "<s>"}')
    nested.write_text('{"pad_token": "<pad>"}')
    assert drop_load_environment(tmp_path / "model") == [loaded]
    assert loaded.read_text() == '{\n  "bos_token": "<s>",\n  "pad_token": "<pad>"\n}\n'
    assert nested.read_text() == '{"pad_token": "<pad>"}'  # nothing to drop: left byte for byte


@pytest.fixture
def two_projects(tmp_path, monkeypatch):
    """The tiny project at two absolute paths of different lengths (no git/DVC: the tasks run through ``.fn``)."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    return make_project(tmp_path / "a", git_dvc=False), make_project(tmp_path / "second" / "project-b", git_dvc=False)


def test_differences_names_the_file_and_line():
    a = {"models/sft/training_args.json": b'{\n  "output_dir": "/runs/a"\n}', "x": b"1"}
    b = {"models/sft/training_args.json": b'{\n  "output_dir": "/runs/bb"\n}', "y": b"1"}
    assert differences(a, b) == ["only in one project: x", "only in one project: y",
                                 "models/sft/training_args.json: '  \"output_dir\": \"/runs/a\"' != "
                                 "'  \"output_dir\": \"/runs/bb\"'"]
    assert differences(a, dict(a)) == []


def test_prepare_sft_reward_model_dpo_outputs_are_byte_identical_across_directories(two_projects, monkeypatch):
    run_in_two_environments(two_projects, ("prepare", "sft", "reward_model", "dpo"), monkeypatch)
    a, b = (tracked_files(p) for p in two_projects)
    assert {"models/sft/model.safetensors", "models/sft/training_args.json", "models/reward_model/README.md",
            "models/dpo/model.safetensors", "metrics/dpo.json"} <= set(a)
    assert differences(a, b) == []
    # the saved training arguments hold no path of the machine that trained (nor of the scratch directory)
    for project in two_projects:
        saved = (project / "models" / "sft" / "training_args.json").read_text()
        assert str(project) not in saved and ".checkpoints" not in saved
        assert json.loads(saved)["seed"] == 0
        # nor how its tokenizer was loaded (transformers writes local_files_only = HF_HUB_OFFLINE)
        tokenizer_config = json.loads((project / "models" / "dpo" / "tokenizer_config.json").read_text())
        assert not {"is_local", "local_files_only"} & set(tokenizer_config) and tokenizer_config["pad_token"]


@pytest.mark.slow
def test_every_stage_gives_byte_identical_outputs_across_directories(two_projects, monkeypatch):
    from tasks.stages import NAMES

    # pipeline order: prepare, sft, reward_model, policies, evaluate, ddpo
    run_in_two_environments(two_projects, NAMES, monkeypatch)
    a, b = (tracked_files(p) for p in two_projects)
    for stage in ("ppo", "grpo", "rloo", "kto"):
        assert f"models/{stage}/model.safetensors" in a and f"metrics/{stage}.json" in a
    assert "metrics/evaluate.json" in a and "plots/evaluate.csv" in a
    assert differences(a, b) == []


ENTRY_POINT = """
import os, runpy, sys
sys.argv = [{module!r}, "--help"]
try:
    runpy.run_module({module!r}, run_name="__main__")  # the command line as `python -m` runs it, up to its help
except SystemExit:
    pass
import torch
print(torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), os.environ.get("MKL_CBWR"),
      "ONEDNN_MAX_CPU_ISA" in os.environ)
"""


def _after_an_entry_point(module: str, env: dict[str, str]) -> list[str]:
    """What torch and the environment say after ``python -m <module> --help`` ran in a fresh process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", ENTRY_POINT.format(module=module)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1].split()


ENTRY_POINTS = ("flows.pipeline", "flows.stage", "flows.retrain", "flows.ddpo", "flows.intake")
"""The command lines that train (flows.intake retrains after an intake): each configures its process before torch."""


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_the_pipeline_entry_points_train_on_one_thread_with_portable_kernels(module):
    """torch's result bits depend on its thread count and CPU kernels: a plain ``dvc repro`` (no ``OMP_NUM_THREADS``)
    must train as ``make run`` does (one thread), and every x86-64 CPU with AVX2 the same way (ATen's kernels at
    AVX2, MKL's CNR branch that Intel and AMD share, oneDNN capped at AVX2: docs/pipeline.md). A machine's own
    kernel setting is overridden (that is what is pinned); an explicit ``OMP_NUM_THREADS`` stays the user's choice;
    ``RLHF_CPU_KERNELS=native`` keeps the machine's kernels. On a one-core machine the thread check cannot tell."""
    import os

    import torch

    from flows.process import PORTABLE_CPU_KERNELS

    # (another test may have configured this process: its pins are in os.environ)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RLHF_CPU_KERNELS",
                                                             *PORTABLE_CPU_KERNELS)}
    native = torch.backends.cpu.get_cpu_capability()  # this test process: nothing pinned
    expected = "AVX2" if native in ("AVX2", "AVX512") else native  # a CPU without AVX2 keeps its default kernels
    assert _after_an_entry_point(module, {**env, "ATEN_CPU_CAPABILITY": "avx512"}) == ["1", expected, "COMPATIBLE",
                                                                                       "True"]
    threads, *_ = _after_an_entry_point(module, {**env, "OMP_NUM_THREADS": "2", "RLHF_CPU_KERNELS": "native",
                                                 "MKL_CBWR": "AUTO"})
    assert threads == "2"


def test_native_kernels_leave_the_environment_alone():
    from flows.process import configure_process

    environ = {"RLHF_CPU_KERNELS": "native", "MKL_CBWR": "AUTO"}
    configure_process(environ)
    assert environ["MKL_CBWR"] == "AUTO" and "ONEDNN_MAX_CPU_ISA" not in environ and environ["OMP_NUM_THREADS"] == "1"


def test_an_unknown_kernel_mode_is_refused_by_name():
    from flows.process import pin_cpu_kernels

    environ = {"RLHF_CPU_KERNELS": "fast"}
    with pytest.raises(ValueError, match="RLHF_CPU_KERNELS='fast'"):
        pin_cpu_kernels(environ)
    assert environ == {"RLHF_CPU_KERNELS": "fast"}  # nothing set
    assert pin_cpu_kernels({"RLHF_CPU_KERNELS": "native"}) == {}
