"""Crash safety: a failed or killed save leaves the previous checkpoint loadable; SIGTERM saves and exits 75."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlhf_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from rlhf_core import checkpointing as ckpt
from rlhf_core.models.tiny import tiny_causal_lm

ROOT = Path(__file__).resolve().parents[1]


def make_trainer(tokenizer) -> PPOTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm(tokenizer, seed=0))
    return PPOTrainer(PPOConfig(batch_size=2, mini_batch_size=1, ppo_epochs=1, learning_rate=1e-3), model, None, tokenizer)


def one_step(trainer: PPOTrainer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    queries = [torch.randint(3, 300, (3,), generator=g) for _ in range(2)]
    responses = [torch.randint(3, 300, (4,), generator=g) for _ in range(2)]
    trainer.step(queries, responses, [torch.tensor(1.0), torch.tensor(-1.0)])


def weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ---------------------------------------------------------------------------------------------- atomic directory


def test_a_failing_write_leaves_the_previous_directory_untouched(tmp_path):
    target = tmp_path / "ckpt"
    with ckpt.atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError, match="disk full"), ckpt.atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "a.txt").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary left behind


def test_a_crash_between_the_two_renames_is_recovered(tmp_path, monkeypatch):
    """The fallback swap (no atomic exchange on this platform/filesystem)."""
    target = tmp_path / "ckpt"
    with ckpt.atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("first")
    real_rename, calls = Path.rename, []
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)

    def crash_on_second_rename(self, dest):
        calls.append(self)
        # 1: .tmp -> target (refused: target exists), 2: target -> .old, 3: .tmp -> target: the process "dies"
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_rename(self, dest)

    monkeypatch.setattr(Path, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt), ckpt.atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("second")
    monkeypatch.undo()
    assert not target.exists()  # the worst moment: only <target>.old-<pid> holds the checkpoint
    assert (ckpt.checkpoint_dir(target) / "a.txt").read_text() == "first"  # recovered on load


SWAPPER = """
import sys
from pathlib import Path
from rlhf_core import checkpointing as ckpt
target, name, count = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
for i in range(count):
    with ckpt.atomic_directory(target) as tmp:
        (tmp / "who.txt").write_text(name * 64)
"""


def test_two_writers_swapping_one_target_never_leave_it_missing(tmp_path):
    """Issue 12.2: two processes replace one directory many times while this one reads it."""
    target = tmp_path / "models" / "sft"
    with ckpt.atomic_directory(target) as tmp:
        (tmp / "who.txt").write_text("0" * 64)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    writers = [subprocess.Popen([sys.executable, "-c", SWAPPER, str(target), name, "300"], env=env,
                                stderr=subprocess.PIPE, text=True) for name in "ab"]
    reads, missing, torn = 0, 0, []
    while any(w.poll() is None for w in writers):
        reads += 1
        if not target.is_dir():
            missing += 1
            continue
        try:
            text = (target / "who.txt").read_text()
        except FileNotFoundError:  # resolved the previous directory just as its displacer deleted it
            continue
        if text not in ("0" * 64, "a" * 64, "b" * 64):
            torn.append(text)
    errors = [w.stderr.read() for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert reads > 100 and missing == 0 and torn == []
    assert sorted(p.name for p in target.parent.iterdir()) == ["sft"]  # no temporaries or .old left
    assert (target / "who.txt").read_text() in ("a" * 64, "b" * 64)


def test_two_threads_swapping_one_target(tmp_path):
    import threading

    target, failures = tmp_path / "ckpt", []

    def swap(name: str) -> None:
        try:
            for _ in range(100):
                with ckpt.atomic_directory(target) as tmp:
                    (tmp / "who.txt").write_text(name)
        except BaseException as err:  # noqa: BLE001 (reported below)
            failures.append(err)

    threads = [threading.Thread(target=swap, args=(n,)) for n in "ab"]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert failures == [] and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_atomic_directories_respect_the_umask(tmp_path):
    """Issue 12.6: model directories were created 0700 (tempfile.mkdtemp); now 0777 less the umask."""
    previous = os.umask(0o022)
    try:
        with ckpt.atomic_directory(tmp_path / "model") as tmp:
            (tmp / "w").write_text("x")
    finally:
        os.umask(previous)
    assert (tmp_path / "model").stat().st_mode & 0o777 == 0o755


def test_a_failed_ppo_save_keeps_the_previous_checkpoint_loadable(tokenizer, tmp_path, monkeypatch):
    trainer = make_trainer(tokenizer)
    one_step(trainer)
    trainer.save_state(tmp_path / "ckpt", extra={"version": 1})
    saved = weights(trainer)
    one_step(trainer, seed=1)

    def failing_save(obj, path):
        raise OSError("No space left on device")

    monkeypatch.setattr(ckpt, "save_torch", failing_save)
    with pytest.raises(OSError, match="No space"):
        trainer.save_state(tmp_path / "ckpt", extra={"version": 2})
    monkeypatch.undo()
    fresh = make_trainer(tokenizer)
    assert fresh.load_state(tmp_path / "ckpt") == {"version": 1}
    assert fresh.current_step == 1
    after = weights(fresh)
    assert all(torch.equal(saved[k], after[k]) for k in saved)


KILL_MID_SAVE = textwrap.dedent(
    r'''
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    sys.path.insert(0, sys.argv[2])
    from test_crash_safety import make_trainer, one_step
    from rlhf_core import checkpointing as ckpt
    from rlhf_core.models.tiny import build_tokenizer

    out = sys.argv[1]
    trainer = make_trainer(build_tokenizer())
    one_step(trainer)
    trainer.save_state(os.path.join(out, "ckpt"), extra={"version": 1})
    save_file({k: v.clone().contiguous() for k, v in trainer.model.pretrained_model.state_dict().items()
               if "lm_head" not in k}, os.path.join(out, "saved.safetensors"))
    one_step(trainer, seed=1)
    real = ckpt.save_torch

    def die_half_way(obj, path):
        real(obj, path)
        if str(path).endswith("optimizer.pt"):  # weights and optimizer written, the rest not
            os.kill(os.getpid(), signal.SIGKILL)

    ckpt.save_torch = die_half_way
    trainer.save_state(os.path.join(out, "ckpt"), extra={"version": 2})
    '''
)


def test_a_process_killed_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tokenizer, tmp_path):
    script = tmp_path / "kill_mid_save.py"
    script.write_text(KILL_MID_SAVE)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    leftovers = list(tmp_path.glob("ckpt.tmp-*"))
    assert len(leftovers) == 1 and (leftovers[0] / "optimizer.pt").exists()  # the half-written one
    fresh = make_trainer(tokenizer)
    assert fresh.load_state(tmp_path / "ckpt") == {"version": 1}
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "saved.safetensors")
    current = fresh.model.pretrained_model.state_dict()
    assert all(torch.equal(saved[k], current[k]) for k in saved)
    fresh.save_state(tmp_path / "ckpt", extra={"version": 3})  # the next save cleans the dead writer's temp
    assert not list(tmp_path.glob("ckpt.tmp-*"))


# ---------------------------------------------------------------------------------------------- SIGTERM


def ppo_stage(tokenizer, root: Path, total_steps: int, signal_at: int | None = None) -> tuple[int, list[int]]:
    """The documented stage pattern: resume if a checkpoint exists, stop cleanly on SIGTERM, exit 75."""
    trainer = make_trainer(tokenizer)
    state_dir = root / "state"
    start = trainer.load_state(state_dir)["next_step"] if ckpt.resumable_checkpoint(state_dir) else 0
    done = []
    with ckpt.GracefulStop() as stop:
        for step in range(start, total_steps):
            one_step(trainer, seed=step)
            done.append(step)
            if step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)  # what `kill <pid>` or a scheduler's preemption does
            if stop.requested:
                trainer.save_state(state_dir, extra={"next_step": step + 1})
                raise ckpt.Preempted(state_dir, step + 1, stop.signal_name)
    return done


def stage_main(tokenizer, root: Path, total_steps: int, signal_at: int | None = None) -> tuple[int, list[int]]:
    """What the entry point (``python -m flows.stage``) does: Preempted -> exit status 75."""
    from tasks.run.supervisor import exit_status

    try:
        return 0, ppo_stage(tokenizer, root, total_steps, signal_at)
    except ckpt.Preempted as stopped:
        assert stopped.signal_name == "SIGTERM" and "resume" in str(stopped)
        return exit_status(stopped), []


def test_sigterm_saves_at_the_step_boundary_and_a_rerun_resumes(tokenizer, tmp_path):
    previous = signal.getsignal(signal.SIGTERM)
    code, _ = stage_main(tokenizer, tmp_path, total_steps=4, signal_at=1)
    assert code == 75
    assert ckpt.read_json(tmp_path / "state" / ckpt.STATE_FILE)["step"] == 2  # saved after step index 1
    assert signal.getsignal(signal.SIGTERM) is previous  # handlers restored after the block
    code, done = stage_main(tokenizer, tmp_path, total_steps=4)
    assert (code, done) == (0, [2, 3])  # continued, did not start over


def test_sigterm_stops_a_transformers_trainer_with_a_checkpoint(tokenizer, tmp_path):
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from rlhf_core.trainers.base import GracefulStopCallback
    from rlhf_core.trainers.sft import SFTTrainer

    class SigtermAtStep2(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    def trainer(callbacks):
        args = TrainingArguments(output_dir=str(tmp_path / "sft"), max_steps=4, per_device_train_batch_size=2,
                                 report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
        data = Dataset.from_dict({"text": ["a good film", "a bad film", "so dull", "lovely music"]})
        return SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, train_dataset=data, tokenizer=tokenizer,
                          dataset_text_field="text", max_seq_length=16, callbacks=callbacks)

    with ckpt.GracefulStop() as stop:
        guard = GracefulStopCallback(stop)
        first = trainer([guard, SigtermAtStep2()])
        first.train()
    assert guard.stopped and first.state.global_step == 3
    checkpoint = tmp_path / "sft" / "checkpoint-3"
    assert (checkpoint / "trainer_state.json").exists() and not (checkpoint / "training_args.bin").exists()
    second = trainer([])
    second.train(resume_from_checkpoint=True)  # transformers finds checkpoint-3 (temp dirs never match)
    assert second.state.global_step == 4


# ---------------------------------------------------------------------------------------------- numerical guard (Trainer-based)


def _sft(tokenizer, tmp_path, max_steps=3):
    from datasets import Dataset
    from transformers import TrainingArguments

    from rlhf_core.trainers.sft import SFTTrainer

    args = TrainingArguments(output_dir=str(tmp_path / "sft-guard"), max_steps=max_steps, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1)
    data = Dataset.from_dict({"text": ["a good film", "a bad film", "so dull", "lovely music"]})
    trainer = SFTTrainer(model=tiny_causal_lm(tokenizer), args=args, train_dataset=data, tokenizer=tokenizer,
                         dataset_text_field="text", max_seq_length=16)
    param = next(p for p in trainer.model.parameters() if p.requires_grad)
    param.register_hook(lambda grad: grad * float("inf"))  # every step's gradients become non-finite
    return trainer


def test_trainer_steps_with_nonfinite_gradients_are_skipped_counted_and_change_nothing(tokenizer, tmp_path):
    trainer = _sft(tokenizer, tmp_path)
    trainer.nonfinite_guard.max_in_a_row = 100
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    with pytest.warns(UserWarning, match="non-finite gradients"):
        trainer.train()
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not trainer.optimizer.state_dict()["state"]  # AdamW never stepped
    logged = [e["skipped_updates"] for e in trainer.state.log_history if "loss" in e]
    assert logged == [1.0, 2.0, 3.0]


def test_too_many_nonfinite_trainer_steps_in_a_row_stop_the_run(tokenizer, tmp_path):
    trainer = _sft(tokenizer, tmp_path)
    trainer.nonfinite_guard.max_in_a_row = 2
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="2 optimizer steps in a row"):
        trainer.train()


def test_a_stop_request_before_the_loop_is_honoured_then_consumed():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for sig in previous:  # what an entry point does before loading models (tasks/run/supervisor.py)
            signal.signal(sig, ckpt.on_stop_signal)
        os.kill(os.getpid(), signal.SIGTERM)
        assert ckpt.stop_requested()
        with ckpt.GracefulStop() as stop:
            assert stop.requested and stop.signal_name == "SIGTERM"  # the loop stops at its first boundary
        assert not ckpt.stop_requested()
        assert signal.getsignal(signal.SIGTERM) is ckpt.on_stop_signal  # the entry point's handler is back
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_loop_off_the_main_thread_warns_unless_the_entry_point_installed_the_handler():
    import threading
    import warnings

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    caught: list[list] = []

    def loop() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with ckpt.GracefulStop():
                pass
        caught.append([str(w.message) for w in seen])

    try:
        for installed in (False, True):
            for sig, handler in previous.items():
                signal.signal(sig, ckpt.on_stop_signal if installed else handler)
            worker = threading.Thread(target=loop)
            worker.start()
            worker.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert len(caught[0]) == 1 and "install rlhf_core.checkpointing.on_stop_signal" in caught[0][0]
    assert caught[1] == []


def test_stage_checkpoints_live_outside_dvc_outs_and_are_keyed_by_params(tmp_path):
    from tasks.spec.paths import stage_checkpoint_dir

    a = stage_checkpoint_dir(tmp_path, "ppo", {"learning_rate": 1e-5, "steps": 10})
    b = stage_checkpoint_dir(tmp_path, "ppo", {"steps": 10, "learning_rate": 1e-5})
    c = stage_checkpoint_dir(tmp_path, "ppo", {"learning_rate": 2e-5, "steps": 10})
    assert a == b != c and a.parent == (tmp_path / ".checkpoints").resolve() and a.name.startswith("ppo-")
    for step in (3, 12):
        with ckpt.atomic_directory(tmp_path / "run" / f"checkpoint-{step}") as tmp:
            ckpt.write_json(tmp / ckpt.STATE_FILE, {"step": step})
    (tmp_path / "run" / "checkpoint-20.tmp-999999").mkdir()  # a dead writer's temporary never counts
    (tmp_path / "run" / "checkpoint-30").mkdir()  # nor a directory without a state file
    assert ckpt.latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoint-12"
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None


# ---------------------------------------------------------------------------------------------- corrupt states (12.5)


def _saved_state(directory: Path) -> Path:
    from safetensors.torch import save_file

    with ckpt.atomic_directory(directory) as tmp:
        save_file({"w": torch.arange(6.0)}, str(tmp / "model.safetensors"))
        torch.save({"step": torch.tensor(3)}, tmp / "optimizer.pt")
        (tmp / ckpt.STATE_FILE).write_text('{"next_step": 3}')
    return directory


@pytest.mark.parametrize(("name", "size"), [("model.safetensors", 5), ("model.safetensors", 60),
                                            ("optimizer.pt", 100), (ckpt.STATE_FILE, 4)])
def test_a_truncated_resume_state_is_moved_aside_and_the_stage_restarts(tmp_path, name, size):
    state = _saved_state(tmp_path / "ppo-abc")
    assert ckpt.checkpoint_problem(state) is None and ckpt.resumable_checkpoint(state) == state
    with open(state / name, "r+b") as fh:
        fh.truncate(size)
    with pytest.warns(RuntimeWarning, match=rf"corrupt resume state {state} \({name}: .*\) moved aside to "):
        assert ckpt.resumable_checkpoint(state) is None  # was: SafetensorError on every re-run
    (aside,) = tmp_path.glob("ppo-abc.corrupt-*")
    assert not state.exists() and (aside / name).stat().st_size == size
    assert ckpt.resumable_checkpoint(state) is None  # the next run starts afresh, no warning


def test_latest_checkpoint_skips_a_corrupt_newest_one(tmp_path):
    _saved_state(tmp_path / "checkpoint-10")
    newest = _saved_state(tmp_path / "checkpoint-20")
    (newest / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.warns(RuntimeWarning, match="checkpoint-20"):
        assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert len(list(tmp_path.glob("checkpoint-20.corrupt-*"))) == 1


def test_completed_stage_removes_resume_states_of_abandoned_params(tmp_path):
    base = tmp_path / ".checkpoints"
    for name in ("ppo-1111aaaa", "ppo-2222bbbb", "dpo-3333cccc", "ppo-4444dddd.corrupt-20260101-000000-1"):
        (base / name).mkdir(parents=True)
    from tasks.spec.paths import remove_stage_checkpoints

    removed = remove_stage_checkpoints(tmp_path, "ppo")
    assert sorted(p.name for p in removed) == ["ppo-1111aaaa", "ppo-2222bbbb"]
    assert sorted(p.name for p in base.iterdir()) == ["dpo-3333cccc", "ppo-4444dddd.corrupt-20260101-000000-1"]
