"""Safe defaults, checked over the repository's own source and on real saves.

- weights only as safetensors (no ``*.bin``/pickled weights, no ``training_args.bin``);
- ``torch.load`` only with ``weights_only=True``;
- ``trust_remote_code`` off unless the user sets it;
- servers the project starts bind 127.0.0.1 (never 0.0.0.0);
- secret-looking params never reach a tracker (at any depth);
- output paths cannot escape the project directory unless explicitly allowed;
- dependencies locked: every line of requirements.lock pinned, every declared dependency in it, make uses it.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from tasks.spec.paths import resolve_output_path
from rlhf_core.tracking import MemoryTracker, public_params

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("rlhf_core", "tasks", "flows", "examples", "bench")
THIS_FILE = Path(__file__).resolve()


def project_files(*suffixes: str, dirs=SOURCE_DIRS) -> list[Path]:
    """Project-owned files (virtualenvs, caches and hidden directories skipped)."""
    files = []
    for d in dirs:
        for path in (ROOT / d).rglob("*"):
            rel = path.relative_to(ROOT).parts
            if any(part.startswith(".") or part in ("__pycache__", "site-packages") for part in rel):
                continue
            if path.is_file() and path.suffix in suffixes:
                files.append(path)
    return files


def python_calls(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


# ---------------------------------------------------------------------------------------------- source checks


def test_torch_load_is_always_weights_only():
    offenders = []
    for path in project_files(".py", dirs=(*SOURCE_DIRS, "tests")):
        for call in python_calls(path):
            func = call.func
            if isinstance(func, ast.Attribute) and func.attr == "load" and getattr(func.value, "id", None) == "torch":
                if not any(k.arg == "weights_only" and _is_true(k.value) for k in call.keywords):
                    offenders.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not offenders, f"torch.load without weights_only=True: {offenders}"


def test_trust_remote_code_is_never_on_by_default():
    offenders = []
    for path in project_files(".py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code" and _is_true(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.value.lineno} passes trust_remote_code=True")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults \
                    + node.args.kw_defaults
                for arg, default in zip(args, defaults):
                    if arg.arg == "trust_remote_code" and default is not None and _is_true(default):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} defaults trust_remote_code=True")
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "trust_remote_code" \
                    and node.value is not None and _is_true(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} field trust_remote_code = True")
    for config in (ROOT / "params.yaml", ROOT / "dvc.yaml"):
        if config.exists() and re.search(r"trust_remote_code:\s*(true|yes|on)\b", config.read_text(), re.IGNORECASE):
            offenders.append(f"{config.name} turns trust_remote_code on")
    assert not offenders, offenders


SERVER_COMMANDS = re.compile(r"(mlflow (ui|server)|prefect server start|uvicorn|tensorboard --logdir|http\.server)")


def test_servers_the_project_starts_bind_loopback():
    offenders = []
    texts = project_files(".py", ".sh", ".yaml", ".yml", ".toml", ".md", dirs=(*SOURCE_DIRS, "docs"))
    texts += [p for p in (ROOT / "Makefile", ROOT / "README.md", ROOT / "prefect.yaml", ROOT / "dvc.yaml",
                          ROOT / "params.yaml", ROOT / "pyproject.toml") if p.exists()]
    for path in texts:
        for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{lineno}"
            if "0.0.0.0" in line and "never" not in line.lower():
                offenders.append(f"{where} mentions 0.0.0.0")
            if SERVER_COMMANDS.search(line) and "--host" in line and "--host 127.0.0.1" not in line:
                offenders.append(f"{where} starts a server on a non-loopback host")
    for path in project_files(".py"):
        for call in python_calls(path):
            for k in call.keywords:
                if k.arg in ("host", "bind") and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str) \
                        and k.value.value not in ("127.0.0.1", "localhost", "::1"):
                    offenders.append(f"{path.relative_to(ROOT)}:{call.lineno} binds {k.value.value}")
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------- saves


def _weight_files(directory: Path) -> set[str]:
    return {p.name for p in directory.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".safetensors")}


def test_trainer_saves_and_checkpoints_hold_safetensors_and_no_pickles(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import TrainingArguments

    from rlhf_core.models.tiny import tiny_causal_lm
    from rlhf_core.trainers.sft import SFTTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="steps", save_steps=1, disable_tqdm=True)
    data = Dataset.from_dict({"text": ["a good film", "a bad film"]})
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, train_dataset=data, tokenizer=tokenizer,
                         dataset_text_field="text", max_seq_length=16)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    final = _weight_files(tmp_path / "final")
    assert final == {"model.safetensors"}, final
    checkpoint = _weight_files(tmp_path / "sft" / "checkpoint-1")
    # optimizer/scheduler/RNG state: tensors only, read back with torch.load(weights_only=True); no .bin anywhere
    assert "model.safetensors" in checkpoint and not {n for n in checkpoint if n.endswith(".bin")}, checkpoint
    assert json.loads((tmp_path / "final" / "training_args.json").read_text())["max_steps"] == 1
    from transformers.trainer_pt_utils import safe_globals  # numpy arrays/dtypes only: transformers' RNG file

    with safe_globals():
        for name in checkpoint - {"model.safetensors"}:
            torch.load(tmp_path / "sft" / "checkpoint-1" / name, weights_only=True)  # no pickled code needed


def test_ppo_save_pretrained_and_save_state_write_safetensors_weights(tokenizer, tmp_path):
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    trainer = PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1), model, None, tokenizer)
    trainer.save_pretrained(str(tmp_path / "policy"))
    trainer.save_state(tmp_path / "state")
    assert _weight_files(tmp_path / "policy") == {"model.safetensors"}
    assert _weight_files(tmp_path / "state") == {"model.safetensors", "optimizer.pt", "rng_state.pt"}
    for name in ("optimizer.pt", "rng_state.pt"):
        torch.load(tmp_path / "state" / name, weights_only=True)


# ---------------------------------------------------------------------------------------------- secrets


def test_secrets_are_never_logged_as_params_even_nested():
    params = {"learning_rate": 1e-3, "hub_token": "tok-123", "tracker_kwargs": {"api_key": "key-456", "run_name": "r"},
              "nested": {"deeper": {"db_password": "pw-789", "ok": 1}}}
    clean = public_params(params)
    assert clean == {"learning_rate": 1e-3, "tracker_kwargs": {"run_name": "r"}, "nested": {"deeper": {"ok": 1}}}
    tracker = MemoryTracker()
    tracker.log_params(params)
    dumped = json.dumps(tracker.params)
    assert not any(secret in dumped for secret in ("tok-123", "key-456", "pw-789"))


def test_ppo_config_secrets_do_not_reach_the_tracker(tokenizer):
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import tiny_causal_lm

    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    config = PPOConfig(batch_size=2, mini_batch_size=1, log_with="memory",
                       project_kwargs={"hub_token": "tok-abc"}, accelerator_kwargs={})
    trainer = PPOTrainer(config, model, None, tokenizer)
    assert "tok-abc" not in json.dumps(trainer.tracker.params, default=str)


# ---------------------------------------------------------------------------------------------- output paths


def test_output_paths_stay_inside_the_project(tmp_path):
    root = tmp_path / "project"
    (root / "models").mkdir(parents=True)
    assert resolve_output_path(root, "models/ppo") == (root / "models" / "ppo").resolve()
    assert resolve_output_path(root, "./metrics/../metrics/ppo.json") == (root / "metrics" / "ppo.json").resolve()
    for escaping in ("../elsewhere", "/etc/cron.d/x", "models/../../x", "~/x"):
        with pytest.raises(ValueError, match="outside the project"):
            resolve_output_path(root, escaping)
    (root / "link").symlink_to(tmp_path, target_is_directory=True)  # a symlink out of the project
    with pytest.raises(ValueError, match="outside the project"):
        resolve_output_path(root, "link/escaped")
    with pytest.raises(ValueError, match="empty"):
        resolve_output_path(root, "")
    assert resolve_output_path(root, "../scratch", allow_outside=True) == (tmp_path / "scratch").resolve()


# ---------------------------------------------------------------------------------------------- dependency lock


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_dependencies_are_locked_and_make_installs_the_lock():
    import tomllib

    lock_lines = [line.strip() for line in (ROOT / "requirements.lock").read_text().splitlines()
                  if line.strip() and not line.startswith("#")]
    unpinned = [line for line in lock_lines if not re.fullmatch(r"[A-Za-z0-9_.\-\[\],]+==[A-Za-z0-9_.+!\-]+", line)]
    assert not unpinned, f"requirements.lock lines that are not exact pins: {unpinned[:5]}"
    locked = {_norm(line.split("==")[0].split("[")[0]) for line in lock_lines}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [d for extra in project.get("optional-dependencies", {}).values()
                                                 for d in extra]
    names = {_norm(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in declared}
    makefile = (ROOT / "Makefile").read_text()
    missing = sorted(n for n in names - locked if not (n == "torch" and "torch==" in makefile))
    assert not missing, f"declared but not in requirements.lock: {missing}"
    assert "tools/install_lock.py requirements.lock" in makefile and "--no-deps -e ." in makefile
    installer = (ROOT / "tools" / "install_lock.py").read_text()  # uv or pip, both with -r: the lock as written
    assert '"-r", lock' in installer and '"install", "--disable-pip-version-check", "-r", lock' in installer
