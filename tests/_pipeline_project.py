"""Test helper: a temporary git + DVC copy of the project with tiny parameters and its own MLflow store."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from tasks.spec.params import apply_overrides, read_raw

ROOT = Path(__file__).resolve().parents[1]

# The test profile: every stage in seconds on one CPU core (quality is not the point here).
TINY = {
    "prepare.num_reviews": 240,
    "sft.vocab_size": 300, "sft.hidden_size": 32, "sft.num_layers": 1, "sft.num_heads": 2, "sft.max_positions": 64,
    "sft.max_seq_length": 48, "sft.num_train_epochs": 1.0, "sft.per_device_train_batch_size": 32,
    "reward_model.num_train_epochs": 1.0, "reward_model.per_device_train_batch_size": 32,
    "ppo.batch_size": 8, "ppo.mini_batch_size": 4, "ppo.ppo_epochs": 1, "ppo.total_steps": 2, "ppo.max_new_tokens": 8,
    "dpo.num_train_epochs": 1.0, "dpo.per_device_train_batch_size": 32,
    "grpo.per_device_train_batch_size": 8, "grpo.num_generations": 4, "grpo.max_completion_length": 8,
    "grpo.max_steps": 2, "rloo.per_device_train_batch_size": 8, "rloo.num_generations": 4,
    "rloo.max_completion_length": 8, "rloo.max_steps": 2, "kto.per_device_train_batch_size": 32,
    "evaluate.num_prompts": 8, "evaluate.max_new_tokens": 8, "evaluate.batch_size": 8, "evaluate.num_samples": 4,
    "registry.max_kl": 1000.0,
    "registry.max_kl_increase": 1000.0,
}

COPY = ("rlhf_core", "tasks", "flows", "dvc.yaml", ".dvcignore", "incoming/README.md")


def write_params(root: Path, overrides: dict | None = None) -> None:
    raw = apply_overrides(read_raw(ROOT / "params.yaml"), {**TINY, **(overrides or {})})
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def make_task_folder(project: Path, task: str, overrides: dict | None = None) -> Path:
    """The shipped task folder ``pipelines/<task>`` in ``project`` (made by :func:`make_project`): its params.yaml
    with the tiny profile and ``overrides``, its ``incoming/``, and its dvc.yaml rendered (code deps point up at the
    copy's tasks/ and rlhf_core/, which mirror the checkout's)."""
    from tasks.run.dvc_yaml import render

    source, folder = ROOT / "pipelines" / task, project / "pipelines" / task
    (folder / "incoming").mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "incoming" / "README.md", folder / "incoming" / "README.md")
    raw = apply_overrides(read_raw(source / "params.yaml"), {**TINY, **(overrides or {})})
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (folder / "dvc.yaml").write_text(render(ROOT, source))  # only its paths section matters: the same as the copy's
    return folder


def run(cmd: list[str], cwd: Path, env: dict | None = None) -> str:
    env = {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ.get('PATH', '')}", **(env or {})}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout


def make_project(root: Path, overrides: dict | None = None, git_dvc: bool = True) -> Path:
    """Copy the code and config into ``root`` (a git + DVC repo with a local remote) with tiny params."""
    root.mkdir(parents=True, exist_ok=True)
    for name in COPY:
        src, dst = ROOT / name, root / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst)
    write_params(root, overrides)
    # as the project's own .gitignore: the stage outputs are DVC's (data/, models/), the stores are local
    (root / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/.dvc-remote/\n__pycache__/\n/data/\n/models/\n")
    if git_dvc:
        dvc = str(ROOT / ".venv" / "bin" / "dvc")
        run(["git", "init", "-q", "-b", "main"], root)
        run(["git", "config", "user.email", "test@example.com"], root)
        run(["git", "config", "user.name", "test"], root)
        run([dvc, "init", "-q"], root)
        run([dvc, "remote", "add", "-d", "local", ".dvc-remote"], root)
        run(["git", "add", "-A"], root)
        run(["git", "commit", "-q", "-m", "project"], root)
    return root


def mlflow_client(root: Path):
    import mlflow

    from tasks.store.mlflow_runs import mlflow_setup

    mlflow_setup(root)
    return mlflow.MlflowClient()
