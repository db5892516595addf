"""Shared test setup: the hub is offline, trackers stay quiet, threads are bounded."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models: more threads only add overhead


@pytest.fixture(scope="session")
def make_tokenizer():
    """Fresh copies of one byte-level BPE tokenizer trained once per session on the built-in corpus (pad distinct
    from EOS). The trained one is never handed out: trainers and loggers may set attributes on the tokenizer they
    are given (GRPO and RLOO set left padding, as TRL does), which must not leak into another test."""
    from rlhf_core.models.tiny import build_tokenizer

    pristine = build_tokenizer()
    return lambda: copy.deepcopy(pristine)


@pytest.fixture
def tokenizer(make_tokenizer):
    """This test's own copy of the session's tokenizer."""
    return make_tokenizer()


@pytest.fixture
def bf16_accelerator():
    """A CPU ``Accelerator`` with bf16 mixed precision (autocast), and accelerate's process-wide state reset
    afterwards: without the reset every later ``Accelerator()`` in the session would inherit bf16."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True, mixed_precision="bf16")
    AcceleratorState._reset_state(True)


@pytest.fixture(scope="session")
def decoding_setup():
    """``(tokenizer, model, prompts)`` for decoding tests: a left-padding tokenizer, a tiny GPT-2 in eval mode
    (seed 0) and four 1-d prompts of 3, 7, 5 and 2 tokens."""
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm

    tok = build_tokenizer(padding_side="left")
    torch.manual_seed(0)
    model = tiny_causal_lm(tok, seed=0).eval()
    g = torch.Generator().manual_seed(3)
    return tok, model, [torch.randint(3, 300, (n,), generator=g) for n in (3, 7, 5, 2)]

try:  # property tests: the same examples on every run (no flaky CI), no per-example deadline on a busy machine
    from hypothesis import settings

    settings.register_profile("repo", derandomize=True, deadline=None, print_blob=True)
    settings.load_profile("repo")
except ImportError:  # hypothesis is a dev dependency; its tests skip without it
    pass


@pytest.fixture(autouse=True)
def _isolate_mlflow_tracking_uri():
    """Undo a test's ``mlflow.set_tracking_uri``: it also sets ``$MLFLOW_TRACKING_URI``, which our tasks read
    first, so one test's store would become every later test's store (and their subprocesses')."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture(scope="session")
def committed_tree(tmp_path_factory):
    """The checkout's last commit, extracted into a temporary folder (``git archive HEAD``).

    Tests of "what is committed is true" (dvc.lock, metrics, plots, the README table) read this, never the
    working tree: the documented journeys change the working tree on purpose (``make run`` on another CPU,
    ``dvc exp run`` applies an experiment, ``make intake`` adds a batch), and a test must not fail because a
    user did what the README says. Outside a git checkout (an unpacked archive) the folder itself is the state."""
    import subprocess
    import tarfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=root, capture_output=True)
    if archive.returncode != 0:
        return root
    target = tmp_path_factory.mktemp("committed")
    tar_path = target.parent / f"{target.name}.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(target, filter="data")
    tar_path.unlink()
    return target


@pytest.fixture
def stage_project(tmp_path, monkeypatch):
    """A copy of the project (params, code paths; no git or DVC) in which single stages run, with no tracking URI or
    parent run inherited from the environment: the stage tests' project."""
    from _pipeline_project import make_project

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RLHF_PARENT_RUN_ID", raising=False)
    return make_project(tmp_path / "proj", git_dvc=False)
