"""Checksummed checkpoints that fall back when damaged, and write faults that name the file and the intact
checkpoint.

Every file is written to a temporary name in the same folder, fsynced, then renamed over the old one: a crash
leaves the old file or the new one, never half of either. A checkpoint is a folder holding the tensors
(safetensors), a JSON document with everything else, under FSDP2 each rank's shards of the weights and the
optimizer state (``SHARDS``), and a ``SHA256SUMS`` of every file (``sha256sum -c`` checks it);
it is assembled under a temporary name and renamed into place only when complete. A checkpoint that cannot be
read whole is skipped for the previous one, saying why. Resuming never unpickles anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import SafetensorError

from memtrain.errors import MemtrainError
from memtrain.files import as_os_error, free_bytes, replace_folder, sha256_file, write_fix
from memtrain.message import Message, arg
from memtrain.report import format_bytes

CHECKPOINT_FORMAT = 2  # 2: meta.json and tensors.safetensors both listed in SHA256SUMS
CHECKPOINT_PREFIX = "step-"
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")
_CHECKPOINT_TEMPORARY = re.compile(r"\.step-(\d+)\.(.+)")  # .step-0000004.<random>.tmp, .step-0000004.old
SUMS = "SHA256SUMS"
CHECKPOINT_FILES = ("meta.json", "tensors.safetensors")
# A sharded checkpoint's folder of shards (torch.distributed.checkpoint's: .metadata and each rank's files), listed in
# SUMS too; its state's SHARDS key names it (the path, once read).
SHARDS = "shards"


class RunWriteError(MemtrainError):
    """A file of the run could not be written (a full disk, a read-only filesystem): an environment fault, not
    bad input. The message names the file and the last good checkpoint, which is intact."""


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


# -- checkpoints --------------------------------------------------------------------------------------------
class CheckpointDamaged(MemtrainError):
    """A checkpoint that cannot be read whole (internal: the loader falls back to the previous one)."""


# What reading or restoring a damaged checkpoint raises: a bad header, a missing key, a wrong shape or type.
CHECKPOINT_DAMAGE = (CheckpointDamaged, SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError,
                     AttributeError, RuntimeError)


class RunCheckpoints:
    """The checkpoints of one run, in ``folder/checkpoints/step-NNNNNNN/``; the newest ``keep`` intact ones are kept.

    Names under ``checkpoints/`` that are not ``step-<number>`` folders are ignored (never read, never removed).

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
        self._verified: dict[str, tuple[tuple[int, int], ...]] = {}  # name -> _signature when found intact

    def paths(self) -> list[Path]:
        """Checkpoint folders, newest first."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            match = _CHECKPOINT_NAME.fullmatch(p.name)
            if match and p.is_dir():
                found.append((int(match.group(1)), p))
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Writes ``state`` as the checkpoint of ``step``; ones older than the ``keep`` newest intact are removed after.

        Raises:
            RunWriteError: a file could not be written (the checkpoints already there are untouched).
        """
        return self.finish(step, self.begin(step), state)

    def begin(self, step: int) -> Path:
        """The temporary folder the checkpoint of ``step`` is assembled in (``finish`` renames it into place): a
        sharded checkpoint's ranks write their shards into its ``SHARDS`` folder first.

        Raises:
            RunWriteError: the folder could not be made.
        """
        final = self.root / f"{CHECKPOINT_PREFIX}{step:07d}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=self.root))
        except OSError as e:
            raise RunWriteError(write_fault(e, final, self, exclude=final)) from None

    def finish(self, step: int, tmp: Path, state: dict[str, Any], shard_sums: dict[str, str] | None = None) -> Path:
        """Writes ``state`` into ``tmp`` (from ``begin``) beside the shards already there (``shard_sums``: their
        SHA-256 by path in the checkpoint, every rank's), lists every file in ``SUMS`` and renames the folder into
        place as the checkpoint of ``step``; ones older than the ``keep`` newest intact are removed after. ``tmp`` is
        removed where anything fails.

        Raises:
            RunWriteError: a file could not be written (the checkpoints already there are untouched).
        """
        final = self.root / f"{CHECKPOINT_PREFIX}{step:07d}"
        needed = None
        missing = [name for name in shard_sums or {} if not (tmp / name).is_file()]
        if missing:  # written by a rank on another node, into a folder of the same name on its own disk
            shutil.rmtree(tmp, ignore_errors=True)
            raise RunWriteError(f"the checkpoint of step {step} lacks {', '.join(missing[:3])} here, which other "
                                f"ranks wrote: under FSDP2 every rank writes its shards into the run folder. To "
                                f"resolve this error, put {arg('out_dir')} on storage every node shares (the same "
                                f"path on each), then continue the run with {arg('resume', True)}.")
        try:
            tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten_state(state, tensors)
            meta_text = json.dumps({"format": CHECKPOINT_FORMAT, "step": step, "state": skeleton})
            needed = sum(t.nbytes for t in tensors.values()) + len(meta_text) + 4096  # + headers and SHA256SUMS
            safetensors.torch.save_file(tensors, str(tmp / "tensors.safetensors"))
            (tmp / "meta.json").write_text(meta_text)
            # The sums list every file: an edit of meta.json (e.g. the scheduler's last_epoch) is damage too.
            sums = {name: sha256_file(tmp / name) for name in CHECKPOINT_FILES} | dict(sorted((shard_sums or {}).items()))
            (tmp / SUMS).write_text("".join(f"{digest}  {name}\n" for name, digest in sums.items()))
            replace_folder(tmp, final)  # the same step saved again (after a resume) is swapped
        except (OSError, SafetensorError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            os_error = as_os_error(e, final)
            if os_error is None:
                raise
            raise RunWriteError(write_fault(os_error, final, self, exclude=final, needed_bytes=needed)) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(final)
        return final

    def _prune(self, written: Path) -> None:
        """Removes every checkpoint older than the ``keep``-th newest intact one.

        Only intact checkpoints count: a damaged one (which a resume skips) must not push the last good one
        out, nor, newer than the one just written (a resume from before it), remove that one. Damaged ones
        newer than the oldest kept stay, for a person to look at, until enough intact ones follow."""
        intact = 0
        for path in self.paths():
            if intact >= self.keep:
                shutil.rmtree(path, ignore_errors=True)
            elif path == written:
                intact += 1
                signature = _signature(path)  # just written whole: the next save need not hash it again
                if signature is not None:
                    self._verified[path.name] = signature
            elif self._intact(path):
                intact += 1

    def _intact(self, path: Path) -> bool:
        """Whether ``path`` passes ``verify`` and its meta.json is a checkpoint's; a result is remembered while its
        files keep their size and mtime, so that pruning at every save does not hash every kept checkpoint again."""
        signature = _signature(path)
        if signature is not None and self._verified.get(path.name) == signature:
            return True
        if self.verify(path) is not None:
            return False
        try:
            self._read_meta(path)
        except CheckpointDamaged:
            return False
        if signature is not None:
            self._verified[path.name] = signature
        return True

    def verify(self, path: Path, *, collective: bool = False) -> str | None:
        """None if the checkpoint at ``path`` is complete and matches its checksums, else what is wrong with it.

        ``collective``: every rank of torch.distributed verifies the same checkpoint; each hashes its share of the
        files and all learn every rank's verdict, so no rank reads a whole sharded checkpoint to check it.
        """
        problem = self._problem(path, collective)
        if collective:
            verdicts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, problem)
            problem = next((v for v in verdicts if v is not None), None)
        return problem

    def _problem(self, path: Path, collective: bool) -> str | None:
        try:
            lines = (path / SUMS).read_text().splitlines()
        except FileNotFoundError:
            return f"{SUMS} missing (an incomplete checkpoint, or one written by an older memtrain)"
        except (OSError, UnicodeDecodeError) as e:
            return f"{SUMS} unreadable ({e})"
        sums = _listed(lines)
        for name in CHECKPOINT_FILES:
            if name not in sums:
                return f"{SUMS} does not list {name}"
        for name in sums:  # a sharded checkpoint's shards too
            if not (path / name).is_file():
                return f"{name} missing"
        names = list(sums)
        for name in names[dist.get_rank()::dist.get_world_size()] if collective else names:
            if sha256_file(path / name) != sums[name]:
                return f"{name} does not match its checksum (edited, truncated or corrupt)"
        return None

    def read(self, path: Path, *, collective: bool = False) -> tuple[int, dict[str, Any]]:
        """The (step, state) of one checkpoint (``collective``: every rank reads it, see ``verify``).

        Raises:
            CheckpointDamaged: it is incomplete, fails its checksums, or its contents cannot be decoded.
        """
        problem = self.verify(path, collective=collective)
        if problem is not None:
            raise CheckpointDamaged(problem)
        step, meta = self._read_meta(path)
        try:
            state = unflatten_state(meta["state"], safetensors.torch.load_file(str(path / "tensors.safetensors")))
        except CHECKPOINT_DAMAGE as e:
            raise CheckpointDamaged(f"tensors.safetensors cannot be decoded ({type(e).__name__}: {e})") from None
        if state.get(SHARDS) is not None:  # the weights and optimizer state are each rank's shards, read on restore
            if f"{state[SHARDS]}/.metadata" not in _listed((path / SUMS).read_text().splitlines()):
                raise CheckpointDamaged(f"{SUMS} does not list the shards' {state[SHARDS]}/.metadata")
            state[SHARDS] = path / state[SHARDS]
        return step, state

    def _read_meta(self, path: Path) -> tuple[int, dict[str, Any]]:
        """The step and meta.json of a checkpoint whose checksums are right; CheckpointDamaged if it is not one."""
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise CheckpointDamaged(f"meta.json unreadable ({e})") from None
        step = int(_CHECKPOINT_NAME.fullmatch(path.name).group(1))
        if not (isinstance(meta, dict) and meta.get("format") == CHECKPOINT_FORMAT and meta.get("step") == step
                and isinstance(meta.get("state"), dict)):
            raise CheckpointDamaged(f"meta.json does not describe the checkpoint of step {step}")
        return step, meta

    def readable(self, *, collective: bool = False) -> Iterator[tuple[Path, int | None, dict[str, Any] | str]]:
        """Each checkpoint, newest first, as (path, step, state) or (path, None, what is wrong with it)
        (``collective``: every rank reads them, see ``verify``)."""
        for path in self.paths():
            try:
                step, state = self.read(path, collective=collective)
            except CheckpointDamaged as e:
                yield path, None, str(e)
                continue
            yield path, step, state

    def load_latest(self) -> tuple[int, dict[str, Any], list[str]] | None:
        """The newest intact checkpoint as (step, state, skipped), where skipped says which were damaged and why."""
        skipped = []
        for path, step, state in self.readable():
            if step is None:
                skipped.append(f"{path.name}: {state}")
                continue
            return step, state, skipped
        if skipped:
            raise self.none_intact(skipped)
        return None

    def none_intact(self, skipped: list[str]) -> MemtrainError:
        return MemtrainError(f"no checkpoint in {self.root} can be resumed: {'; '.join(skipped)}. To resolve this "
                             "error, resume with the model and settings of the original run, start a new run in "
                             f"another {arg('out_dir')}, or restore a checkpoint from a backup.")

    def clean_temporaries(self) -> tuple[list[str], list[str]]:
        """Removes what writers that died mid-write left under ``checkpoints/`` (only the lock holder may call this:
        then no writer is alive). A checkpoint caught mid-swap is put back.

        Returns:
            (the names removed, the checkpoints put back).
        """
        removed: list[str] = []
        restored: list[str] = []
        if not self.root.is_dir():
            return removed, restored
        for p in sorted(self.root.iterdir()):
            match = _CHECKPOINT_TEMPORARY.fullmatch(p.name)
            if not match:
                continue
            final = self.root / f"{CHECKPOINT_PREFIX}{match.group(1)}"
            if match.group(2) == "old" and not final.exists():
                os.replace(p, final)  # killed between the two renames of a swap: the old copy is the good one
                restored.append(f"checkpoints/{final.name}")
                continue
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            removed.append(f"checkpoints/{p.name}")
        return removed, restored


def _listed(lines: list[str]) -> dict[str, str]:
    """A ``SUMS`` file's lines as {file name: SHA-256}."""
    return dict(reversed(line.split(None, 1)) for line in lines if len(line.split(None, 1)) == 2)


def _signature(path: Path) -> tuple[tuple[int, int], ...] | None:
    """(size, mtime_ns) of each file of a checkpoint (a sharded one's shards too): what an edit or a rewrite
    changes; None if one is missing."""
    try:
        names = {*CHECKPOINT_FILES, SUMS, *_listed((path / SUMS).read_text().splitlines())}
        return tuple((st.st_size, st.st_mtime_ns) for st in (os.stat(path / n) for n in sorted(names)))
    except (OSError, UnicodeDecodeError):
        return None


def write_fault(error: OSError, path: Path, checkpoints: RunCheckpoints | None, *,
                exclude: Path | None = None, needed_bytes: int | None = None) -> str:
    """The message of a failed write: which file, why, the bytes it needs and the disk has free, and which
    checkpoint is still intact."""
    where = error.filename or path
    good = [p for p in checkpoints.paths() if p != exclude] if checkpoints is not None else []
    intact = (f"the last good checkpoint, {good[0]}, is intact" if good else
              "no checkpoint was written before it")
    free = free_bytes(path)
    sizes = [f"it needs about {format_bytes(needed_bytes)}" if needed_bytes is not None else "",
             f"{format_bytes(free)} free in {Path(path).parent}" if free is not None else ""]
    sizes_text = "; ".join(s for s in sizes if s)
    return Message(f"could not write {where} ({error.strerror or error}){f'; {sizes_text}' if sizes_text else ''}: "
                   f"{intact}. To resolve this error, {write_fix(error)}, then continue the run with "
                   f"{arg('resume', True)}.")


@contextlib.contextmanager
def write_faults(path: Path, checkpoints: RunCheckpoints | None) -> Iterator[None]:
    """Turns a failed write of ``path`` (an OSError, or safetensors' SafetensorError wrapping one) into one
    RunWriteError naming it, the space free and the last good checkpoint."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        os_error = as_os_error(e, path)
        if os_error is None:
            raise
        raise RunWriteError(write_fault(os_error, path, checkpoints)) from None
