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
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memtrain.errors import MemtrainError

CHECKPOINT_PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves either the old file or the new one, never half of it."""
    _atomic_write(Path(path), lambda tmp: tmp.write_bytes(data))


def _atomic_write(path: Path, write: Callable[[Path], Any]) -> None:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
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
    _atomic_write(Path(path), lambda tmp: save_file(tensors, str(tmp)))


# -- nested state <-> (tensors, JSON) -----------------------------------------------------------------------
def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """Replaces every tensor in a nested structure by a reference, collecting the tensors by key."""
    if isinstance(obj, torch.Tensor):
        key = path or "tensor"
        value = obj.detach().cpu()
        for other_key, other in tensors.items():  # tied weights: store once, refer twice
            if (other.data_ptr() == value.data_ptr() and other.shape == value.shape
                    and other.stride() == value.stride() and other.dtype == value.dtype):
                return {"__tensor__": other_key}
        # A view of a shared storage is stored as its own copy (safetensors refuses overlapping tensors).
        tensors[key] = value.clone() if _shares_storage(value, tensors) else value.contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: flatten_state(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        return {"__items__": [[k, flatten_state(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten_state(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [flatten_state(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise MemtrainError(f"cannot store a {type(obj).__name__} at {path!r} in a checkpoint (only tensors, numbers, "
                        "strings, lists, tuples and dicts). To resolve this error, convert it to one of those.")


def _shares_storage(value: torch.Tensor, tensors: dict[str, torch.Tensor]) -> bool:
    ptr = value.untyped_storage().data_ptr()
    return any(t.untyped_storage().data_ptr() == ptr for t in tensors.values())


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
