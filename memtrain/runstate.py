"""Files of a run that lose nothing: atomic writes and checksummed, resumable checkpoints.

Every file is written to a temporary name in the same folder, fsynced, then renamed over the old one: a crash
leaves the old file or the new one, never half of either. A checkpoint is a folder holding the tensors
(safetensors) and a JSON document with everything else plus the tensors file's SHA-256; it is assembled under a
temporary name and renamed into place only when complete. Resuming never unpickles anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from memtrain.errors import ConfigError, MemtrainError

CHECKPOINT_PREFIX = "step-"
# Files whose presence marks a folder as holding a run's results.
RUN_FILES = ("metrics.jsonl", "model.safetensors", "checkpoints")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves either the old file or the new one, never half of it."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], Any]) -> None:
    """Runs ``write(tmp)`` on a temporary file beside ``path``, fsyncs it and renames it over ``path``."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)  # the rename itself survives a power cut
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_weights_file(state_dict: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Saves a model's state dict as safetensors, atomically; tied weights are stored once, under their first name
    (``safetensors.torch.load_model`` restores the ties)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...], torch.dtype]] = set()
    for name, value in state_dict.items():
        value = value.detach().cpu()
        key = (value.untyped_storage().data_ptr(), tuple(value.shape), value.dtype)
        if key in seen:
            continue
        seen.add(key)
        tensors[name] = value.contiguous()
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp)))


# -- nested state <-> (tensors, JSON) -----------------------------------------------------------------------
def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replaces every tensor in a nested structure by a reference, collecting the tensors by key."""
    return _flatten(obj, tensors, path, views={}, storages=set())


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], path: str, *, views: dict[tuple[Any, ...], str],
             storages: set[int]) -> Any:
    def recurse(value: Any, sub: str) -> Any:
        return _flatten(value, tensors, sub, views=views, storages=storages)

    if isinstance(obj, torch.Tensor):
        value = obj.detach().cpu()
        view = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        if view in views:  # tied weights: store once, refer twice
            return {"__tensor__": views[view]}
        key = views[view] = path or "tensor"
        # A view of a storage already stored is stored as its own copy (safetensors refuses overlapping tensors).
        stored = value.clone() if value.untyped_storage().data_ptr() in storages else value.contiguous()
        storages.add(stored.untyped_storage().data_ptr())
        tensors[key] = stored
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: recurse(v, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[k, recurse(v, f"{path}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [recurse(v, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [recurse(v, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise MemtrainError(f"cannot store a {type(obj).__name__} at {path!r} in a checkpoint (only tensors, numbers, "
                        "strings, lists, tuples and dicts). To resolve this error, convert it to one of those.")


def unflatten_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__items__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__items__"]}
        if "__tuple__" in obj:
            return tuple(unflatten_state(v, tensors) for v in obj["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# -- checkpoints --------------------------------------------------------------------------------------------
class RunCheckpoints:
    """The checkpoints of one run, in ``folder/checkpoints/step-NNNNNNN/``; the newest ``keep`` are kept.

    Example:
        >>> import tempfile
        >>> ckpts = RunCheckpoints(tempfile.mkdtemp())
        >>> _ = ckpts.save(3, {"w": torch.ones(2), "note": "hi"})
        >>> step, state, skipped = ckpts.load_latest()
        >>> step, state["note"], state["w"].tolist(), skipped
        (3, 'hi', [1.0, 1.0], [])
    """

    def __init__(self, folder: str | os.PathLike[str], *, keep: int = 2):
        self.root = Path(folder) / "checkpoints"
        self.keep = max(1, keep)

    def paths(self) -> list[Path]:
        """Checkpoint folders, newest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)]
        return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)), reverse=True)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Writes ``state`` as the checkpoint of ``step``; older ones beyond ``keep`` are removed afterwards."""
        from safetensors.torch import save_file

        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{CHECKPOINT_PREFIX}{step:07d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=self.root))
        try:
            tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten_state(state, tensors)
            tensor_file = tmp / "tensors.safetensors"
            save_file(tensors, str(tensor_file))
            with open(tensor_file, "rb") as f:
                os.fsync(f.fileno())
            meta = {"step": step, "sha256": _sha256(tensor_file), "state": skeleton}
            (tmp / "meta.json").write_text(json.dumps(meta))
            with open(tmp / "meta.json", "rb") as f:
                os.fsync(f.fileno())
            if final.exists():  # the same step saved again (after a resume): swap, never delete first
                old = final.with_name(f".{final.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for stale in self.paths()[self.keep:]:
            shutil.rmtree(stale, ignore_errors=True)
        return final

    def verify(self, path: Path) -> str | None:
        """None if the checkpoint at ``path`` is complete and intact, else what is wrong with it."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            return f"meta.json unreadable ({e})"
        tensor_file = path / "tensors.safetensors"
        if not tensor_file.is_file():
            return "tensors.safetensors missing"
        if _sha256(tensor_file) != meta.get("sha256"):
            return "tensors.safetensors does not match its checksum (truncated or corrupt)"
        return None

    def load_latest(self) -> tuple[int, dict[str, Any], list[str]] | None:
        """The newest intact checkpoint as (step, state, skipped), where skipped says which were corrupt and why."""
        from safetensors.torch import load_file

        skipped = []
        for path in self.paths():
            problem = self.verify(path)
            if problem is not None:
                skipped.append(f"{path.name}: {problem}")
                continue
            meta = json.loads((path / "meta.json").read_text())
            state = unflatten_state(meta["state"], load_file(str(path / "tensors.safetensors")))
            return meta["step"], state, skipped
        if skipped:
            raise MemtrainError(f"no intact checkpoint in {self.root}: {'; '.join(skipped)}. To resolve this error, "
                                "start a new run (another --out) or restore a checkpoint from a backup.")
        return None


# -- the run folder -----------------------------------------------------------------------------------------
# Everything a run writes at its top level: what --overwrite clears (after the new run's set-up succeeded).
RUN_OUTPUTS = (*RUN_FILES, "report.json", "loss.png", "memory.png", "sample.txt", "config.json")


def check_run_folder(out_dir: str | os.PathLike[str], *, overwrite: bool, resume: bool) -> Path:
    """Checks ``out_dir`` without writing: it must not hold another run's results unless ``overwrite`` or
    ``resume``, and ``resume`` needs a checkpoint there."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file. To resolve this error, pass a folder path.")
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not (overwrite or resume):
        raise ConfigError(
            f"--out {str(out)!r} already holds a run's results ({', '.join(existing)}). To resolve this error, "
            "pass --resume to continue it, another --out folder, or --overwrite to replace it."
        )
    if resume and not RunCheckpoints(out).paths():
        fix = ("pass --overwrite to start it again (it stopped before its first checkpoint)" if existing else
               "drop --resume to start a new run there, or pass the --out of the run to continue")
        raise ConfigError(f"--resume: {str(out)!r} holds no checkpoint to resume from. To resolve this error, {fix}.")
    return out


def clear_run_folder(out: Path) -> None:
    """Removes a previous run's outputs (for --overwrite): first moved aside in one rename each, then deleted."""
    trash = Path(tempfile.mkdtemp(prefix=".overwritten.", dir=out))
    for name in RUN_OUTPUTS:
        if (out / name).exists():
            os.replace(out / name, trash / name)
    shutil.rmtree(trash, ignore_errors=True)


class StopSignals:
    """Turns SIGTERM / SIGINT into a request to stop after the current step (with a checkpoint)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# -- the state of a run ------------------------------------------------------------------------------------
def save_run_state(checkpoints: RunCheckpoints | None, step: int, micro: int, model: nn.Module,
                   optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, accumulator: Any,
                   run: dict[str, Any], extra: dict[str, Any]) -> None:
    """Everything a bit-identical resume needs: weights, optimizer (offloaded state included), scheduler, fp16
    scaler, accumulator counters, the data position (the step) and every RNG. Collective under FSDP2: every rank
    calls it, rank 0 (the one with ``checkpoints``) writes."""
    state = {
        "step": step,
        "micro_batch_size": micro,
        "run": run,  # what defines the run (seed, batch, data): a resume must match it to be the same run
        "extra": extra,  # the loop's own bookkeeping (JSON-like), handed back on resume
        "model": model_state_dict(model),
        "optimizer": _optimizer_state(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None else None,
        "accumulator": accumulator.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
            "python": random.getstate(),
        },
    }
    if checkpoints is not None:
        checkpoints.save(step, state)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no rank runs ahead of a checkpoint that is still being written


def tied_duplicates(model: nn.Module) -> set[str]:
    """Names of parameters that are another name's parameter (a tied head), all but the first."""
    first: dict[int, str] = {}
    duplicates = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            duplicates.add(name)
        first.setdefault(id(p), name)
    return duplicates


def _is_fsdp(model: nn.Module) -> bool:
    return callable(getattr(model, "set_requires_gradient_sync", None))


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return model.state_dict()


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_run_state(checkpoints: RunCheckpoints, run: dict[str, Any]) -> tuple[int, dict[str, Any], list[str]]:
    """The newest intact checkpoint, checked against this run's defining settings ``run`` (one ConfigError listing
    every difference: resuming with another seed, batch or data would not continue the same run).

    Returns:
        (step, state, damaged checkpoints skipped with the reason).
    """
    loaded = checkpoints.load_latest()
    assert loaded is not None  # check_run_folder made sure a checkpoint exists
    step, state, skipped = loaded
    saved = state.get("run", {})
    ConfigError.raise_if(
        f"--resume: {key} is {run[key]!r} now but was {saved[key]!r} in the run being resumed. To resolve this "
        f"error, pass the original value ({RUN_FLAGS.get(key, key)} {saved[key]}), or start a new run."
        for key in run if key in saved and saved[key] != run[key]
    )
    return step, state, skipped


# The flag behind each run-defining setting, for error messages.
RUN_FLAGS = {"seed": "--seed", "global_batch_size": "--global-batch-size", "world_size": "torchrun --nproc_per_node",
             "train_examples": "--data/--seq-len", "seq_len": "--seq-len", "parameters": "--model/--hf-config"}


def restore_run_state(step: int, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Any, scaler: Any, accumulator: Any) -> None:
    """Loads a checkpoint's state (from ``load_run_state``) into the run's objects."""
    try:
        if _is_fsdp(model):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, state["model"], options=options)
            set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise ConfigError(f"--resume: the checkpoint of step {step} does not fit this model or optimizer "
                          f"({str(e).splitlines()[0][:300]}). To resolve this error, resume with the same model "
                          "flags as the original run, or start a new run with another --out.") from None
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and state["scaler"] is not None:
        scaler.load_state_dict(state["scaler"])
    accumulator.load_state_dict(state["accumulator"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    random.setstate(_as_tuples(state["rng"]["python"]))


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def read_metrics(path: Path | None, *, upto: int) -> list[dict[str, Any]]:
    """The metrics lines of the steps a resumed run keeps (later ones were not checkpointed)."""
    if path is None or not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [m for m in lines if m["step"] <= upto]
