"""Exact resume: N steps straight == k steps, process SIGKILLed right after saving, resume for N-k steps.

Each run happens in a fresh subprocess (tiny models, float32, one thread), so the comparison covers what a
real restart loses: every RNG, the optimizer and scheduler, the KL controller, the running score moments,
the step counter and the dataloader position. Weights must be bit-identical and every logged stat equal
(timing keys aside).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
N_STEPS, KILL_AT = {"ppo": 5, "dpo": 5}, {"ppo": 3, "dpo": 2}

SCRIPT = textwrap.dedent(
    r'''
    import json, os, signal, sys
    import torch
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    from safetensors.torch import save_file
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments
    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.models.tiny import build_tokenizer, tiny_causal_lm
    from rlhf_core.tracking import MemoryTracker
    from rlhf_core.trainers.preference.dpo import DPOTrainer

    mode, out = sys.argv[1], sys.argv[2]
    n_steps, kill_at = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    tok = build_tokenizer()

    def dump_weights(model, name):
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        seen, unique = set(), {}
        for k, v in state.items():  # tied weights: keep one copy
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr()); unique[k] = v
        save_file(unique, os.path.join(out, name))

    def clean(obj):
        if isinstance(obj, dict):
            return {k: clean(v) for k, v in obj.items() if not str(k).startswith("time/")}
        if isinstance(obj, (list, tuple)):
            return [clean(v) for v in obj]
        if hasattr(obj, "tolist"):
            return obj.tolist()
        return obj

    # ------------------------------------------------------------------ PPO
    PROMPTS = ["This movie was", "I", "The plot", "A good film", "The actors", "It", "Honestly the", "My friend",
               "The ending", "What a"]

    def ppo_trainer():
        torch.manual_seed(0)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tok, seed=0))
        data = Dataset.from_dict({"query": PROMPTS, "input_ids": [tok.encode(p) for p in PROMPTS]})
        config = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=3,
                           use_score_scaling=True, use_score_norm=True, adap_kl_ctrl=True, init_kl_coef=0.1)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        trainer = PPOTrainer(config, model, None, tok, dataset=data, optimizer=optimizer, lr_scheduler=scheduler)
        trainer.tracker = MemoryTracker()
        return trainer

    def ppo_run(trainer, start, stop, log):
        def batches():
            while True:
                yield from trainer.dataloader
        it = batches()
        half = len(tok) // 2
        for step in range(start, stop):
            batch = next(it)
            queries = [torch.tensor(ids) for ids in batch["input_ids"]]
            responses = trainer.generate(queries, return_prompt=False, batch_size=4, max_new_tokens=5,
                                         do_sample=True, top_k=0, top_p=1.0)
            scores = [(r < half).float().mean() * 2 for r in responses]
            stats = trainer.step(queries, responses, scores)
            trainer.log_stats(stats, {"query": batch["query"], "response": [tok.decode(r) for r in responses]}, scores)
            log.append({"step": step, "queries": batch["query"], "stats": clean(stats)})
        return {"stats": log, "tracked": clean({"metrics": trainer.tracker.metrics, "tables": trainer.tracker.tables})}

    # ------------------------------------------------------------------ DPO
    ROWS = {
        "prompt": ["The film was", "This morning I", "The story is", "The music was", "Our guide", "The cast"],
        "chosen": [" great and warm", " loved the film", " lovely", " wonderful", " kind", " superb"],
        "rejected": [" terrible", " hated it and the pacing", " boring and dull", " awful", " rude", " flat"],
    }

    class KillAfterSave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == kill_at["dpo"]:
                control.should_save = True
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == kill_at["dpo"]:
                os.kill(os.getpid(), signal.SIGKILL)

    def dpo_trainer(run_dir, callbacks=()):
        args = TrainingArguments(
            output_dir=run_dir, max_steps=n_steps["dpo"], per_device_train_batch_size=2, learning_rate=5e-3, seed=3,
            report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
            lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=1.0,
        )
        return DPOTrainer(model=tiny_causal_lm(tok, seed=0), args=args, train_dataset=Dataset.from_dict(ROWS),
                          tokenizer=tok, max_length=32, max_prompt_length=8, callbacks=list(callbacks))

    def dpo_logs(trainer):
        return [e for e in trainer.state.log_history if "train_runtime" not in e]

    # ------------------------------------------------------------------ modes
    def ppo_first():
        trainer = ppo_trainer()
        ppo_run(trainer, 0, kill_at["ppo"], [])
        trainer.save_state(ppo_ckpt, extra={"next_step": kill_at["ppo"]})

    def ppo_second():
        k = kill_at["ppo"]
        straight = ppo_trainer()
        result = {"straight": ppo_run(straight, 0, n_steps["ppo"], [])}
        dump_weights(straight.model, "ppo-straight.safetensors")
        resumed = ppo_trainer()
        extra = resumed.load_state(ppo_ckpt)
        assert extra == {"next_step": k}, extra
        result["resumed"] = ppo_run(resumed, k, n_steps["ppo"], [])
        result["resumed_optimizer_steps"] = resumed.current_step
        dump_weights(resumed.model, "ppo-resumed.safetensors")
        json.dump(result, open(os.path.join(out, "ppo.json"), "w"))

    def dpo_first():  # killed by SIGKILL right after the checkpoint of step kill_at["dpo"]
        dpo_trainer(os.path.join(out, "dpo-run"), [KillAfterSave()]).train()
        raise SystemExit("not killed")

    def dpo_second():
        straight = dpo_trainer(os.path.join(out, "dpo-straight"))
        straight.train()
        dump_weights(straight.model, "dpo-straight.safetensors")
        resumed = dpo_trainer(os.path.join(out, "dpo-run"))
        resumed.load_state(os.path.join(out, "dpo-run", f"checkpoint-{kill_at['dpo']}"))
        resumed.train()
        dump_weights(resumed.model, "dpo-resumed.safetensors")
        json.dump({"straight": dpo_logs(straight), "resumed": dpo_logs(resumed), "global_step": resumed.state.global_step},
                  open(os.path.join(out, "dpo.json"), "w"))

    ppo_ckpt = os.path.join(out, "ppo-checkpoint")
    if mode == "first":
        ppo_first()  # the PPO checkpoint is complete; the process still dies by SIGKILL below, not by exiting
        dpo_first()
    else:
        ppo_second()
        dpo_second()
    '''
)


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONHASHSEED="0", TRANSFORMERS_NO_ADVISORY_WARNINGS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _run(script: Path, mode: str, out: Path, timeout: float = 150) -> tuple[int, str]:
    args = [sys.executable, str(script), mode, str(out), json.dumps(N_STEPS), json.dumps(KILL_AT)]
    proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Process 1: PPO k steps + save_state, DPO k steps + checkpoint, SIGKILL. Process 2: straight and resumed runs."""
    out = tmp_path_factory.mktemp("resume")
    script = out / "resume_script.py"
    script.write_text(SCRIPT)
    code, err = _run(script, "first", out)
    assert code == -signal.SIGKILL, f"the first half should die by SIGKILL, got {code}:\n{err}"
    code, err = _run(script, "second", out)
    assert code == 0, f"resume failed ({code}):\n{err}"
    return out


def _assert_same_weights(out: Path, algo: str) -> None:
    from safetensors.torch import load_file

    straight, resumed = load_file(out / f"{algo}-straight.safetensors"), load_file(out / f"{algo}-resumed.safetensors")
    assert straight.keys() == resumed.keys()
    different = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert not different, f"{algo}: {len(different)} tensors differ after resume, e.g. {different[:3]}"


def test_ppo_resume_after_sigkill_is_bit_identical(runs):
    _assert_same_weights(runs, "ppo")
    result = json.loads((runs / "ppo.json").read_text())
    straight, resumed = result["straight"], result["resumed"]
    k = KILL_AT["ppo"]
    assert [s["step"] for s in resumed["stats"]] == list(range(k, N_STEPS["ppo"]))
    assert resumed["stats"] == straight["stats"][k:]  # same batches (data position), same stats
    assert resumed["tracked"]["metrics"] == straight["tracked"]["metrics"][k:]
    assert resumed["tracked"]["tables"] == straight["tracked"]["tables"][k:]
    assert result["resumed_optimizer_steps"] == N_STEPS["ppo"]
    # the run crossed an epoch boundary mid-way (10 prompts, batches of 4, last 2 dropped)
    assert len({q for s in straight["stats"] for q in s["queries"]}) > 4


def test_dpo_resume_after_sigkill_is_bit_identical(runs):
    _assert_same_weights(runs, "dpo")
    result = json.loads((runs / "dpo.json").read_text())
    assert result["global_step"] == N_STEPS["dpo"]
    assert len(result["straight"]) == N_STEPS["dpo"]
    assert result["resumed"] == result["straight"]  # every logged loss, grad norm, lr and DPO metric, step by step
    checkpoint = runs / "dpo-run" / f"checkpoint-{KILL_AT['dpo']}"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= names
    assert "training_args.bin" not in names and "training_args.json" in names
    assert not list((runs / "dpo-run").glob("*.tmp-*"))  # no half-written leftovers


def test_the_data_position_survives_accelerate_prepare_and_resumes_mid_epoch(tokenizer, tmp_path):
    from datasets import Dataset

    from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
    from rlhf_core.checkpointing import PositionTrackingLoader, ResumableRandomSampler
    from rlhf_core.models.tiny import tiny_causal_lm

    data = Dataset.from_dict({"query": [f"q{i}" for i in range(7)], "input_ids": [[5 + i] for i in range(7)]})

    def trainer():
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
        return PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, seed=11), model, None, tokenizer, dataset=data)

    first = trainer()
    loader = first.dataloader
    assert isinstance(loader, PositionTrackingLoader) and type(loader.loader).__name__ == "DataLoaderShard"
    assert isinstance(loader.loader.batch_sampler.sampler, ResumableRandomSampler)  # kept by accelerator.prepare
    assert len(loader) == 3  # 7 rows, batches of 2, last partial batch dropped
    epochs = [[b["query"] for b in loader] for _ in range(2)]
    assert epochs[0] != epochs[1]  # a new permutation each epoch (seed + epoch)
    iterator = iter(loader)
    seen = [next(iterator)["query"]]  # one batch into epoch 2; accelerate has already read the next one
    first.save_state(tmp_path / "state")
    rest = [b["query"] for b in iterator]
    resumed = trainer()
    resumed.load_state(tmp_path / "state")
    assert [b["query"] for b in resumed.dataloader] == rest  # exactly the batches the first run had left
    assert [b["query"] for b in resumed.dataloader] == [b["query"] for b in first.dataloader]  # and in step after
