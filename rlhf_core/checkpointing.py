"""Checkpoint machinery shared by every trainer: atomic directories, RNG state, data position, graceful stop.

- ``atomic_directory(target)``: write a checkpoint into ``<target>.tmp-<random>-<pid>`` beside the target, fsync
  it, then swap it in with one atomic exchange (Linux ``renameat2``), so a crash at any point, or a reader at any
  moment, finds the previous checkpoint or the new one at ``target``; concurrent writers each land a whole one.
  Elsewhere two renames (``recover_directory`` puts ``<target>.old-<pid>`` back after a crash between them).
  Never half a checkpoint.
- ``capture_rng_state`` / ``restore_rng_state``: python ``random``, numpy's global generator and torch's CPU
  (and CUDA) generators, as tensors and plain values so ``torch.load(weights_only=True)`` reads them back.
- ``save_torch`` / ``load_torch``: ``torch.save`` and ``torch.load(weights_only=True)`` (no pickled code).
- ``ResumableRandomSampler`` + ``PositionTrackingLoader``: an epoch-seeded shuffle whose position (epoch and
  samples delivered) is part of the checkpoint, so a resumed run sees the same batches as a straight one.
- ``GracefulStop``: SIGTERM/SIGINT become a stop request checked at step boundaries (``stop_requested``); the
  training loop saves its state and raises ``Preempted``, which the caller's entry point maps to its exit status
  (the pipeline's CLIs: 75, "try again").

Only the standard library, numpy and torch are imported here, so ``rlhf_core`` stays importable anywhere.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import random
import secrets
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

class Preempted(Exception):
    """Raised by a training loop that saved its state on a stop request (SIGTERM/SIGINT): run it again to resume.

    An exception (not ``SystemExit``) so orchestrators (Prefect) see an ordinary task failure, and a command-line
    entry point can map it to its exit status (the pipeline's: 75, ``EX_TEMPFAIL``).
    """
    def __init__(self, checkpoint: str | os.PathLike, step: int | None = None, signal_name: str | None = None,
                 message: str | None = None) -> None:
        """``message``: said instead of the step and checkpoint, for a stop outside a training loop (between stages,
        where there is no step and no saved state)."""
        self.checkpoint, self.step, self.signal_name = str(checkpoint), step, signal_name
        super().__init__(message or f"stopped by {signal_name or 'a stop request'} at step {step}; state saved in "
                                    f"{checkpoint}; run the stage again to resume")


CHECKPOINT_FORMAT = 1
STATE_FILE = "trainer_state.json"
"""PPO: counters, controller and moments, data position (JSON). HF trainers: transformers' own ``TrainerState``."""


# ---------------------------------------------------------------------------------------------- atomic writes


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` and the directories themselves to disk."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pid_alive(pid: int) -> bool:
    """True while a process ``pid`` exists (also one of another user: signalling it is refused, not absent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_stale_siblings(target: Path) -> None:
    """Remove ``<target>.tmp-*-<pid>`` left by dead writers (a crash mid-save)."""
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def recover_directory(target: str | Path) -> Path:
    """If a crash fell between the two renames of the fallback swap, put the previous checkpoint back.

    Only an ``<target>.old-<pid>`` of a dead writer (or of this process) is taken: a live writer between its two
    renames finishes its own swap.
    """
    target = Path(target)
    if not target.exists():
        olds = [p for p in target.parent.glob(f"{target.name}.old-*") if _owner_gone_or_self(p)]
        olds.sort(key=lambda p: p.stat().st_mtime)
        if olds:
            with contextlib.suppress(OSError):  # another reader recovered it first
                olds[-1].rename(target)
    return target


def _owner_gone_or_self(path: Path) -> bool:
    pid = path.name.rsplit("-", 1)[-1]
    return not pid.isdigit() or int(pid) == os.getpid() or not pid_alive(int(pid))


_RENAME_EXCHANGE = 2  # linux/fs.h: atomically exchange two existing paths
_AT_FDCWD = -100


@functools.cache
def _renameat2() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 / not Linux
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the paths ``a`` and ``b`` (``renameat2(RENAME_EXCHANGE)``, Linux). False where the
    platform or filesystem cannot; ``FileNotFoundError`` if either is missing."""
    import ctypes

    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        raise FileNotFoundError(err, os.strerror(err), str(b))
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _swap_in(tmp: Path, target: Path) -> Path | None:
    """Put the complete directory ``tmp`` at ``target``; return where the previous ``target`` now is (to delete).

    A plain rename when ``target`` is absent; else an atomic exchange, so a reader never finds ``target``
    missing and concurrent writers each land a whole directory (the last one wins). Where exchange is not
    available, two renames (previous -> ``<target>.old-<pid>``, temporary -> target; ``recover_directory``
    repairs a crash between them).
    """
    while True:
        try:
            tmp.rename(target)
            return None
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
                raise
        try:
            if _exchange(tmp, target):
                return tmp
        except FileNotFoundError:
            continue  # another writer moved target away in between: try the plain rename again
        return _swap_by_two_renames(tmp, target)


def _swap_by_two_renames(tmp: Path, target: Path) -> Path:
    old = target.with_name(f"{target.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    target.rename(old)
    tmp.rename(target)
    return old


@contextlib.contextmanager
def atomic_directory(target: str | Path) -> Iterator[Path]:
    """Yield a new ``<target>.tmp-<random>-<pid>``; when the block succeeds, fsync it and swap it in for ``target``.

    On an exception the temporary directory is deleted and ``target`` is untouched. Safe with several writers
    (processes or threads) on one target: each gets its own temporary, the swap is atomic (``_swap_in``), and
    the previous directory is deleted by whoever displaced it. Directories get the default mode (0777 less the
    umask), unlike ``tempfile.mkdtemp``'s 0700.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(target)
    _clean_stale_siblings(target)
    tmp = target.with_name(f"{target.name}.tmp-{secrets.token_hex(4)}-{os.getpid()}")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    previous = _swap_in(tmp, target)
    _fsync_dir(target.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True))


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def save_torch(obj: Any, path: str | Path) -> None:
    """``torch.save`` of tensors and plain containers only (readable with ``weights_only=True``)."""
    torch.save(obj, str(path))


def load_torch(path: str | Path, map_location: Any = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True``: a checkpoint can never run code."""
    return torch.load(str(path), map_location=map_location, weights_only=True)


def save_module_weights(module: torch.nn.Module, path: str | Path) -> None:
    """``module.state_dict()`` as safetensors; tied tensors are stored once and their aliases in the metadata."""
    from safetensors.torch import save_file

    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_key: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for key, tensor in module.state_dict().items():
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and ident in first_key:
            aliases[key] = first_key[ident]
            continue
        first_key[ident] = key
        unique[key] = tensor.detach().cpu().contiguous()
    save_file(unique, str(path), metadata={"aliases": json.dumps(aliases)})


def load_module_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Load ``save_module_weights`` output into ``module`` (strict: every key must match)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as fh:
        aliases = json.loads((fh.metadata() or {}).get("aliases", "{}"))
    state = load_file(str(path))
    for alias, key in aliases.items():
        state[alias] = state[key]
    module.load_state_dict(state, strict=True)


def checkpoint_dir(path: str | Path) -> Path:
    """``path`` as a complete checkpoint directory (after crash recovery), or a clear error."""
    path = recover_directory(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no checkpoint here (expected a directory written by save_state)")
    return path


# ---------------------------------------------------------------------------------------------- RNG state


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy and torch generator states as tensors and plain values (``weights_only``-safe)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, torch.tensor(mt, dtype=torch.int64), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in mt.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------- data position


class ResumableRandomSampler(torch.utils.data.Sampler[int]):
    """A shuffle that can be resumed: epoch ``e`` is ``randperm(n)`` under seed ``seed + e``.

    ``consumed`` counts the indices handed out in the current epoch; iteration continues from there, so
    loading a saved ``state_dict`` resumes mid-epoch. No ``set_epoch`` on purpose: accelerate would reset
    the epoch from its own counter, which restarts at 0 in a resumed process.
    """

    def __init__(self, data_source_or_length: Any, seed: int = 0) -> None:
        source = data_source_or_length
        self.num_samples = source if isinstance(source, int) else len(source)
        self.seed = int(seed)
        self.epoch = 0
        self.consumed = 0

    def __len__(self) -> int:
        return self.num_samples

    def permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.permutation(self.epoch)
        while self.consumed < self.num_samples:
            index = order[self.consumed]
            self.consumed += 1
            yield index
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(f"checkpoint data position is for {state['num_samples']} samples, "
                             f"the dataset has {self.num_samples}")
        self.seed, self.epoch, self.consumed = int(state["seed"]), int(state["epoch"]), int(state["consumed"])


class PositionTrackingLoader:
    """Wraps a (prepared) dataloader over a ``ResumableRandomSampler`` and counts the batches it delivers.

    accelerate's loader reads one batch ahead, so the sampler alone runs ahead of what the user has seen.
    This wrapper records the position after the last batch actually yielded, and each new iteration
    rewinds the sampler there. Everything else (``len``, attributes) is the wrapped loader's.
    """

    def __init__(self, loader: Any, sampler: ResumableRandomSampler, batch_size: int, drop_last: bool = True) -> None:
        self.loader, self.sampler, self.batch_size, self.drop_last = loader, sampler, batch_size, drop_last
        self.epoch, self.consumed = sampler.epoch, sampler.consumed

    def __iter__(self) -> Iterator[Any]:
        remaining = self.sampler.num_samples - self.consumed
        if self.consumed and (remaining <= 0 or (self.drop_last and remaining < self.batch_size)):
            self.epoch, self.consumed = self.epoch + 1, 0  # the rest of the epoch would be dropped anyway
        self.sampler.epoch, self.sampler.consumed = self.epoch, self.consumed
        for batch in self.loader:
            self.consumed += self.batch_size
            yield batch
        self.epoch, self.consumed = self.epoch + 1, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, int]:
        return {**self.sampler.state_dict(), "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self.epoch, self.consumed = self.sampler.epoch, self.sampler.consumed


# ---------------------------------------------------------------------------------------------- graceful stop

_STOP = threading.Event()
_STOP_SIGNAL: list[str] = []


def on_stop_signal(signum: int, frame: Any) -> None:
    """The signal handler that turns SIGTERM/SIGINT into a stop request (a second Ctrl-C stops at once). An entry
    point whose training loop runs outside the main thread installs it for the whole process first."""
    name = signal.Signals(signum).name
    if _STOP.is_set() and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C stops at once
    _STOP_SIGNAL.append(name)
    _STOP.set()


class GracefulStop:
    """A stop request from SIGTERM/SIGINT, checked by the training loop at step boundaries.

    Pattern (a training stage)::

        with GracefulStop() as stop:
            for step in range(start, total):
                ...one training step...
                if stop.requested:
                    trainer.save_state(ckpt)      # atomic
                    raise Preempted(ckpt, step + 1, stop.signal_name)

    Signal handlers can only be installed from the main thread; when the loop runs elsewhere (a worker
    thread of an orchestrator), the process entry point installs :func:`on_stop_signal` for SIGTERM/SIGINT first.
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals = signals
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        # A request that arrived earlier (handlers installed by the entry point) is kept: the loop stops at
        # its first step boundary. The request is consumed when the block exits.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.getsignal(sig) for sig in self.signals}
            for sig in self.signals:
                signal.signal(sig, on_stop_signal)
        elif any(signal.getsignal(sig) is not on_stop_signal for sig in self.signals):
            warnings.warn("GracefulStop outside the main thread and no stop handlers installed: the entry point must "
                          "install rlhf_core.checkpointing.on_stop_signal for SIGTERM/SIGINT first", stacklevel=2)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        _STOP.clear()
        _STOP_SIGNAL.clear()

    @property
    def requested(self) -> bool:
        return _STOP.is_set()

    @property
    def signal_name(self) -> str | None:
        return _STOP_SIGNAL[0] if _STOP_SIGNAL else None

    def request(self) -> None:
        """Ask for a stop programmatically (tests, schedulers)."""
        _STOP_SIGNAL.append("request")
        _STOP.set()


def stop_requested() -> bool:
    """True once SIGTERM/SIGINT arrived under an active ``GracefulStop`` or :func:`on_stop_signal` handler."""
    return _STOP.is_set()


# ---------------------------------------------------------------------------------------------- resume helpers


def fingerprint(obj: Any) -> str:
    """A stable hash of a JSON-able object (e.g. a stage's params): resume only a checkpoint of the same run."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def checkpoint_problem(path: str | Path) -> str | None:
    """Why the checkpoint directory ``path`` cannot be resumed from (a truncated or garbled file), or None.

    Cheap structural checks, no tensors loaded: every ``*.safetensors`` header parses and covers the file, every
    ``*.pt``/``*.pth``/``*.bin`` is a complete zip (``torch.save``'s format; its directory is at the end, so a
    truncated file fails), every ``*.json`` parses.
    """
    import zipfile

    for file in sorted(Path(path).rglob("*")):
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(file), framework="pt") as handle:
                    handle.keys()
            elif file.suffix in (".pt", ".pth", ".bin"):
                with zipfile.ZipFile(file) as archive:
                    archive.infolist()
            elif file.suffix == ".json":
                json.loads(file.read_text())
        except Exception as err:  # noqa: BLE001 - any parse failure means "do not resume from this"
            return f"{file.name}: {type(err).__name__}: {str(err)[:200]}"
    return None


def quarantine(path: str | Path, problem: str) -> Path:
    """Move a corrupt checkpoint aside to ``<path>.corrupt-<time>`` with a warning naming both; returns the new path."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    path.rename(aside)
    message = f"corrupt resume state {path} ({problem}) moved aside to {aside}; the stage starts afresh"
    logging.getLogger("rlhf_core").warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return aside


def _usable(path: Path) -> bool:
    problem = checkpoint_problem(path)
    if problem is not None:
        quarantine(path, problem)
    return problem is None


def resumable_checkpoint(path: str | Path) -> Path | None:
    """``path`` if it holds a complete checkpoint (``save_state`` of any trainer), else None. A corrupt one
    (truncated file: ``SafetensorError: invalid header length`` on every re-run) is moved aside first."""
    path = recover_directory(path)
    return path if (path / STATE_FILE).is_file() and _usable(path) else None


def latest_checkpoint(directory: str | Path, prefix: str = "checkpoint-") -> Path | None:
    """The complete ``<prefix><step>`` checkpoint with the highest step in ``directory`` (temporaries ignored);
    corrupt ones are moved aside (``quarantine``) and the next older one is tried."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    steps = [(int(p.name[len(prefix):]), p) for p in directory.iterdir()
             if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and (p / STATE_FILE).is_file()]
    for _, candidate in sorted(steps, reverse=True):
        if _usable(candidate):
            return candidate
    return None


__all__ = [
    "CHECKPOINT_FORMAT", "GracefulStop", "Preempted", "PositionTrackingLoader",
    "ResumableRandomSampler",
    "STATE_FILE", "atomic_directory", "capture_rng_state", "checkpoint_dir", "fingerprint", "on_stop_signal",
    "checkpoint_problem", "latest_checkpoint", "load_torch", "pid_alive", "quarantine", "read_json",
    "recover_directory", "restore_rng_state",
    "resumable_checkpoint",
    "save_module_weights", "load_module_weights", "save_torch", "stop_requested", "write_json",
]
