"""Run folders that lose nothing and change nothing silently: ownership, a lock, atomic files, checksummed
checkpoints and an append-only metrics log.

A run folder is marked as memtrain's by a ``.memtrain-run`` file and written only under the names memtrain owns
(``RUN_OUTPUTS``): a folder holding anything else is refused unless overwrite, and even then memtrain replaces
only its own files and never one it did not write. A run holds an exclusive lock on its folder
(``.memtrain-lock``, with the holder's pid, host and start time) for as long as it uses it.

Every file is written to a temporary name in the same folder, fsynced, then renamed over the old one: a crash
leaves the old file or the new one, never half of either. A checkpoint is a folder holding the tensors
(safetensors), a JSON document with everything else, and a ``SHA256SUMS`` of both (``sha256sum -c`` checks it);
it is assembled under a temporary name and renamed into place only when complete. A checkpoint that cannot be
read whole is skipped for the previous one, saying why. Resuming never unpickles anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import random
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch import nn

from memtrain.errors import ConfigError, MemtrainError
from memtrain.files import atomic_write, atomic_write_bytes, replace_folder, sha256_file
from memtrain.unwrap import is_fsdp2

try:  # POSIX; elsewhere the lock is a pid file only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

RUN_FORMAT = 1  # of the run folder (marker, config.json); a newer one is refused
CHECKPOINT_FORMAT = 2  # 2: meta.json and tensors.safetensors both listed in SHA256SUMS
MARKER = ".memtrain-run"
LOCK = ".memtrain-lock"
CHECKPOINT_PREFIX = "step-"
_CHECKPOINT_NAME = re.compile(r"step-(\d+)")
_CHECKPOINT_TEMPORARY = re.compile(r"\.step-(\d+)\.(.+)")  # .step-0000004.<random>.tmp, .step-0000004.old
SUMS = "SHA256SUMS"
CHECKPOINT_FILES = ("meta.json", "tensors.safetensors")

# Files whose presence means a folder holds a run's results (a new run must not silently replace them).
RUN_FILES = ("metrics.jsonl", "model.safetensors", "checkpoints")
# Every name memtrain writes at a run folder's top level: the only names overwrite replaces.
RUN_OUTPUTS = (MARKER, LOCK, "config.json", *RUN_FILES, "report.json", "loss.png", "memory.png", "sample.txt", "hf")
_TRASH_PREFIX = ".overwritten."


class RunWriteError(MemtrainError):
    """A file of the run could not be written (a full disk, a read-only filesystem): an environment fault, not
    bad input. The message names the file and the last good checkpoint, which is intact."""


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


# -- checkpoints --------------------------------------------------------------------------------------------
class CheckpointDamaged(MemtrainError):
    """A checkpoint that cannot be read whole (internal: the loader falls back to the previous one)."""


# What reading or restoring a damaged checkpoint raises: a bad header, a missing key, a wrong shape or type.
_DAMAGE = (CheckpointDamaged, SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError)


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
        from safetensors.torch import save_file

        final = self.root / f"{CHECKPOINT_PREFIX}{step:07d}"
        tmp = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=self.root))
            tensors: dict[str, torch.Tensor] = {}
            skeleton = flatten_state(state, tensors)
            save_file(tensors, str(tmp / "tensors.safetensors"))
            meta = {"format": CHECKPOINT_FORMAT, "step": step, "state": skeleton}
            (tmp / "meta.json").write_text(json.dumps(meta))
            # The sums list every file: an edit of meta.json (e.g. the scheduler's last_epoch) is damage too.
            (tmp / SUMS).write_text("".join(f"{sha256_file(tmp / name)}  {name}\n" for name in CHECKPOINT_FILES))
            replace_folder(tmp, final)  # the same step saved again (after a resume) is swapped
        except OSError as e:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RunWriteError(write_fault(e, final, self, exclude=final)) from None
        except BaseException:
            if tmp is not None:
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

    def verify(self, path: Path) -> str | None:
        """None if the checkpoint at ``path`` is complete and matches its checksums, else what is wrong with it."""
        try:
            lines = (path / SUMS).read_text().splitlines()
        except FileNotFoundError:
            return f"{SUMS} missing (an incomplete checkpoint, or one written by an older memtrain)"
        except (OSError, UnicodeDecodeError) as e:
            return f"{SUMS} unreadable ({e})"
        sums = dict(reversed(line.split(None, 1)) for line in lines if len(line.split(None, 1)) == 2)
        for name in CHECKPOINT_FILES:
            if name not in sums:
                return f"{SUMS} does not list {name}"
            if not (path / name).is_file():
                return f"{name} missing"
            if sha256_file(path / name) != sums[name]:
                return f"{name} does not match its checksum (edited, truncated or corrupt)"
        return None

    def read(self, path: Path) -> tuple[int, dict[str, Any]]:
        """The (step, state) of one checkpoint.

        Raises:
            CheckpointDamaged: it is incomplete, fails its checksums, or its contents cannot be decoded.
        """
        from safetensors.torch import load_file

        problem = self.verify(path)
        if problem is not None:
            raise CheckpointDamaged(problem)
        step, meta = self._read_meta(path)
        try:
            state = unflatten_state(meta["state"], load_file(str(path / "tensors.safetensors")))
        except _DAMAGE as e:
            raise CheckpointDamaged(f"tensors.safetensors cannot be decoded ({type(e).__name__}: {e})") from None
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

    def readable(self) -> Iterator[tuple[Path, int | None, dict[str, Any] | str]]:
        """Each checkpoint, newest first, as (path, step, state) or (path, None, what is wrong with it)."""
        for path in self.paths():
            try:
                step, state = self.read(path)
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
                             "another out_dir, or restore a checkpoint from a backup.")

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


def _signature(path: Path) -> tuple[tuple[int, int], ...] | None:
    """(size, mtime_ns) of each file of a checkpoint: what an edit or a rewrite changes; None if one is missing."""
    try:
        return tuple((st.st_size, st.st_mtime_ns) for st in (os.stat(path / n) for n in (*CHECKPOINT_FILES, SUMS)))
    except OSError:
        return None


def write_fault(error: OSError, path: Path, checkpoints: RunCheckpoints | None, *,
                exclude: Path | None = None) -> str:
    """The message of a failed write: which file, why, and which checkpoint is still intact."""
    where = error.filename or path
    good = [p for p in checkpoints.paths() if p != exclude] if checkpoints is not None else []
    intact = (f"the last good checkpoint, {good[0]}, is intact" if good else
              "no checkpoint was written before it")
    return (f"could not write {where} ({error.strerror or error}): {intact}. To resolve this error, free space "
            "on that disk or make the folder writable, then continue the run with resume=True.")


@contextlib.contextmanager
def write_faults(path: Path, checkpoints: RunCheckpoints | None) -> Iterator[None]:
    """Turns an OSError while writing ``path`` into one RunWriteError naming it and the last good checkpoint."""
    try:
        yield
    except OSError as e:
        raise RunWriteError(write_fault(e, path, checkpoints)) from None


# -- the run folder -----------------------------------------------------------------------------------------
def _is_temporary(name: str) -> bool:
    """A temporary of ``atomic_write`` (``.<name>.<random>.tmp``) of a run output, or an overwrite's trash."""
    return name.startswith(_TRASH_PREFIX) or (name.endswith(".tmp") and
                                              any(name.startswith(f".{n}.") for n in RUN_OUTPUTS))


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _alive(holder: Mapping[str, Any]) -> bool:
    """Whether the process named by a lock's holder may still run (another host's cannot be checked: yes)."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user
        return True
    return True


def _describe(holder: Mapping[str, Any]) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since')}"
            if holder else "a process that left no record")


class RunFolder:
    """The folder of one run, owned by memtrain: checked before anything is written, locked while the run uses it.

    ``check()`` writes nothing; ``lock()`` takes the folder (creating it if needed); ``commit()`` marks it as a
    memtrain run and, with ``overwrite``, removes the previous run's files (only names in ``RUN_OUTPUTS``: what
    memtrain did not write is never deleted). ``release()`` gives the lock back; before ``commit()`` it also
    undoes what ``lock()`` created, so a run that fails its set-up leaves the folder as it was.

    Args:
        path: the run folder.
        overwrite: a previous run's results there may be replaced (its files only).
        resume: the run there is continued; it must hold a checkpoint.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False, resume: bool = False):
        self.path = Path(path)
        self.overwrite, self.resume = overwrite, resume
        self.notes: list[str] = []  # what lock() found and did, for the log
        self._fd: int | None = None
        self._created_folder = self._created_lock = self._committed = False

    # -- checks (nothing written) -----------------------------------------------------------------------
    def check(self) -> None:
        """Raises one ConfigError if the run may not use this folder; writes nothing."""
        out, shown = self.path, str(self.path)
        if os.path.islink(out) and not os.path.exists(out):
            raise ConfigError(f"out_dir={shown!r} is a symbolic link to {os.readlink(out)!r}, which does not exist "
                              "(or is a loop of links). To resolve this error, pass a folder path, or create the "
                              "link's target.")
        if out.exists() and not out.is_dir():
            raise ConfigError(f"out_dir={shown!r} is a file. To resolve this error, pass a folder path.")
        if not out.exists():
            self._check_creatable()
            if self.resume:
                raise ConfigError(f"resume=True: {shown!r} does not exist, so there is no run to continue. To "
                                  "resolve this error, pass the out_dir of the run to continue, or drop resume=True.")
            return
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"out_dir={shown!r} is not writable. To resolve this error, pass a folder you can "
                              "write to.")
        # The lock alone is a run setting the folder up (this one, under lock()), not a foreign file.
        names = sorted(p.name for p in out.iterdir() if not _is_temporary(p.name) and p.name != LOCK)
        marker = self.marker()
        if marker is None and names:
            self._check_foreign(names)
            return
        if marker is not None and marker.get("format", RUN_FORMAT) > RUN_FORMAT:
            raise ConfigError(f"out_dir={shown!r} holds a run of a newer memtrain (run format {marker['format']}; "
                              f"this one reads {RUN_FORMAT}). To resolve this error, upgrade memtrain, or pass "
                              "another out_dir.")
        existing = [name for name in RUN_FILES if (out / name).exists()]
        if existing and not (self.overwrite or self.resume):
            raise ConfigError(
                f"out_dir={shown!r} already holds a run's results ({', '.join(existing)}). To resolve this error, "
                "pass resume=True to continue it, another out_dir, or overwrite=True to replace it."
            )
        if self.resume and not RunCheckpoints(out).paths():
            fix = ("pass overwrite=True to start it again (it stopped before its first checkpoint)" if existing or
                   marker is not None else "drop resume=True to start a new run there, or pass the out_dir of the "
                   "run to continue")
            raise ConfigError(f"resume=True: {shown!r} holds no checkpoint to resume from. To resolve this error, "
                              f"{fix}.")

    def _check_creatable(self) -> None:
        parent = self.path.absolute().parent
        while not parent.exists() and parent != parent.parent:
            if os.path.islink(parent):
                raise ConfigError(f"out_dir={str(self.path)!r} cannot be created: {str(parent)!r} is a symbolic "
                                  "link to nothing. To resolve this error, pass another out_dir.")
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"out_dir={str(self.path)!r} cannot be created: {str(parent)!r} is not a writable "
                              "folder. To resolve this error, pass an out_dir in a folder you can write to.")

    def _check_foreign(self, names: list[str]) -> None:
        shown = str(self.path)
        listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        if self.resume:
            raise ConfigError(f"resume=True: {shown!r} is not a memtrain run folder (no {MARKER} marker; it holds "
                              f"{listed}). To resolve this error, pass the out_dir of the run to continue.")
        clashes = [name for name in names if name in RUN_OUTPUTS]
        if clashes:
            raise ConfigError(
                f"out_dir={shown!r} holds {', '.join(clashes)}, which memtrain did not write (the folder has no "
                f"{MARKER} marker) and a run would replace. To resolve this error, pass another out_dir (a new or "
                "empty folder); memtrain never replaces files it did not write, even with overwrite=True."
            )
        if not self.overwrite:
            raise ConfigError(
                f"out_dir={shown!r} is not empty and not a memtrain run folder (no {MARKER} marker; it holds "
                f"{listed}). To resolve this error, pass a new or empty out_dir, or overwrite=True to write the "
                "run beside those files (memtrain never deletes what it did not write)."
            )

    def marker(self) -> dict[str, Any] | None:
        """The folder's marker, or None when it is not a memtrain run folder."""
        try:
            value = json.loads((self.path / MARKER).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {"format": RUN_FORMAT}  # a damaged marker still marks the folder as memtrain's
        return value if isinstance(value, dict) else {"format": RUN_FORMAT}

    # -- the lock ---------------------------------------------------------------------------------------
    def lock(self) -> RunFolder:
        """Takes the folder for this process: checks it, locks it, re-checks it under the lock (another run may
        have written in between) and removes what writers that died mid-write left there.

        Raises:
            ConfigError: another live run holds the folder (its pid, host and start time are named), or a check fails.
        """
        self.check()
        try:
            self._created_folder = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            lock_path = self.path / LOCK
            self._created_lock = not lock_path.exists()
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._undo()
            raise ConfigError(f"out_dir={str(self.path)!r} cannot be written ({e.strerror}). To resolve this error, "
                              "pass an out_dir you can write to.") from None
        try:
            self._take(fd, lock_path)
        except BaseException:
            os.close(fd)
            self._undo()
            raise
        self._fd = fd
        try:
            self.check()  # under the lock now: no other run changes the folder any more
            removed = [p.name for p in self.path.iterdir() if _is_temporary(p.name)]
            for name in removed:
                p = self.path / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            in_checkpoints, restored = RunCheckpoints(self.path).clean_temporaries()
            removed += in_checkpoints
        except BaseException:
            self.release()
            raise
        if removed:
            self.notes.append(f"removed {len(removed)} temporar{'y' if len(removed) == 1 else 'ies'} of a writer that "
                              f"died mid-write: {', '.join(removed)}")
        if restored:
            self.notes.append(f"put back {', '.join(restored)}: a writer died between the two renames that "
                              "replace it")
        return self

    def _take(self, fd: int, lock_path: Path) -> None:
        previous = _read_holder(fd)
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._refuse(previous, lock_path, stale=not _alive(previous))
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
                self._take_pid_file(previous, lock_path)  # a filesystem without flock (some NFS mounts)
            else:
                if os.fstat(fd).st_ino != os.stat(lock_path).st_ino:  # the file was replaced while we locked it
                    self._refuse(_read_holder_at(lock_path), lock_path, stale=False)
                if previous:
                    self.notes.append(f"the previous run in this folder ({_describe(previous)}) ended without "
                                      "releasing its lock (killed?): taken over")
        else:
            self._take_pid_file(previous, lock_path)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder()).encode(), 0)
        os.fsync(fd)

    def _take_pid_file(self, previous: dict[str, Any], lock_path: Path) -> None:
        # NOTE: without flock two runs starting in the same instant can both take the folder; the pid file still
        # catches every run that starts while another is alive, and a dead holder's file is stale.
        if previous and _alive(previous) and previous.get("pid") != os.getpid():
            self._refuse(previous, lock_path, stale=False)
        if previous:
            self.notes.append(f"removed the stale lock of {_describe(previous)}, which is no longer running")

    def _refuse(self, holder: dict[str, Any], lock_path: Path, *, stale: bool) -> None:
        if stale:
            raise ConfigError(
                f"out_dir={str(self.path)!r} is locked ({lock_path}): its holder, {_describe(holder)}, is no longer "
                "running, but a process it started still holds the lock. To resolve this error, end that process "
                f"(`fuser -v {lock_path}` shows it), or pass another out_dir."
            )
        raise ConfigError(
            f"out_dir={str(self.path)!r} is in use by another run: {_describe(holder)} (lock file {lock_path}). To "
            "resolve this error, wait for that run to end or stop it, or pass another out_dir."
        )

    def commit(self) -> None:
        """Set-up succeeded: marks the folder as a memtrain run and, with overwrite, removes the previous run's
        files (moved aside in one rename each, then deleted; only names memtrain owns)."""
        if self._committed:
            return
        if self.overwrite:
            trash = Path(tempfile.mkdtemp(prefix=_TRASH_PREFIX, dir=self.path))
            for name in RUN_OUTPUTS:
                if name not in (MARKER, LOCK) and (self.path / name).exists():
                    os.replace(self.path / name, trash / name)
            shutil.rmtree(trash, ignore_errors=True)
        if self.marker() is None:
            atomic_write_bytes(self.path / MARKER, json.dumps({"format": RUN_FORMAT, "tool": "memtrain"}).encode())
        self._committed = True

    def release(self) -> None:
        """Gives the lock back (its record is cleared); before commit() also removes what lock() created."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
                if fcntl is not None:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
        if not self._committed:
            self._undo()

    def _undo(self) -> None:
        if self._created_lock:
            with contextlib.suppress(OSError):
                (self.path / LOCK).unlink()
        if self._created_folder:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only if still empty
        self._created_folder = self._created_lock = False

    def __enter__(self) -> RunFolder:
        return self.lock()

    def __exit__(self, *exc: object) -> None:
        self.release()

    # -- the run's config -------------------------------------------------------------------------------
    def write_config(self, config: Mapping[str, Any], command: Mapping[str, Any] | None,
                     plan: Mapping[str, Any] | None = None) -> None:
        """config.json: the run's settings (and the command's flags that started it), for a resume from the folder
        alone, and the plan it started with (whose optimizer a resume keeps)."""
        doc = {"format": RUN_FORMAT, "train": dict(config), "command": dict(command) if command else None,
               "plan": dict(plan) if plan else None}
        atomic_write_bytes(self.path / "config.json", json.dumps(doc, indent=2, default=str).encode())


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        data = os.pread(fd, 4096, 0)
        value = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _read_holder_at(path: Path) -> dict[str, Any]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return {}
    try:
        return _read_holder(fd)
    finally:
        os.close(fd)


def read_run_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The config.json of a run folder.

    Raises:
        ConfigError: it is missing or unreadable (the message says which, for a log line).
    """
    path = Path(folder) / "config.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{str(path)!r} is missing") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(path)!r} is unreadable ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("train"), dict):
        raise ConfigError(f"{str(path)!r} is not a memtrain run config (no \"train\" settings)")
    return doc


# -- the metrics log ----------------------------------------------------------------------------------------
class MetricsLog:
    """metrics.jsonl: one JSON line per optimizer step, appended (each step costs one line, whatever the run's
    length), flushed every step, fsynced at every checkpoint; on resume cut back to the checkpoint's step.
    """

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None

    def start(self, *, resume_step: int | None) -> tuple[list[dict[str, Any]], list[str]]:
        """Opens the log for appending. ``resume_step``: the checkpoint's step; lines after it are dropped (those
        steps run again), and a damaged line ends what is kept (the steps after it have no metrics).

        Returns:
            (the lines kept, notes for the log).
        """
        kept: list[dict[str, Any]] = []
        notes: list[str] = []
        if resume_step is None:
            self._file = open(self.path, "w", encoding="utf-8")
            return kept, notes
        if not self.path.exists():
            notes.append(f"metrics.jsonl is missing: the metrics of steps 1-{resume_step} are lost")
        else:
            data = self.path.read_bytes()
            end, damaged, dropped = 0, None, 0
            for number, line in enumerate(data.splitlines(keepends=True), 1):
                if kept and kept[-1]["step"] >= resume_step:
                    dropped += 1
                    continue
                try:
                    if not line.endswith(b"\n"):
                        raise ValueError("cut short")
                    value = json.loads(line)
                    if not isinstance(value, dict) or value.get("step") != len(kept) + 1:
                        raise ValueError(f"step {len(kept) + 1} expected")
                except ValueError as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
                    damaged = f"line {number} is damaged ({str(e)[:80]})"
                    break
                kept.append(value)
                end += len(line)
            if damaged is not None:
                lost = f"; the metrics of steps {len(kept) + 1}-{resume_step} are lost" if len(kept) < resume_step else ""
                notes.append(f"metrics.jsonl: {damaged}: kept the {len(kept)} lines before it{lost}")
            elif dropped:
                notes.append(f"metrics.jsonl: dropped {dropped} line(s) after step {resume_step} (not checkpointed: "
                             "those steps run again)")
            with open(self.path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        self._file = open(self.path, "a", encoding="utf-8")
        return kept, notes

    def append(self, line: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()  # in the OS's hands: a killed process loses no step it logged

    def sync(self) -> None:
        """Makes the lines written so far durable (called before each checkpoint: no checkpoint is ahead of them)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


# -- stopping on a signal -----------------------------------------------------------------------------------
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


def agree_on_stop(received: str | None, device: torch.device) -> str | None:
    """The signal any rank received, on every rank (None on all when none did), so that all stop after the same
    step: a rank that stopped alone would wait in the checkpoint's collectives while the others wait in the next
    step's. One all-reduce of one number per step, only under torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return received
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    code = torch.tensor([signal.Signals[received].value if received else 0], device=on)
    dist.all_reduce(code, op=dist.ReduceOp.MAX)
    value = int(code.item())
    return signal.Signals(value).name if value else None


# -- what defines a run -------------------------------------------------------------------------------------
# A dataset without a token stream that is not an in-memory list is hashed through this many evenly spaced
# examples at most: each is one __getitem__ (which may read a file or tokenise), paid at every start and resume.
FINGERPRINT_MAX_EXAMPLES = 65536


def data_fingerprint(dataset: Any) -> dict[str, Any]:
    """The number of examples and a SHA-256 of the data's contents, for a resume to refuse other data.

    What is hashed: the whole token stream where the dataset exposes one (numpy ``tokens``, plus ``starts``,
    ``lengths`` and ``loss_mask`` for documents; a ``PackedRows`` through its ``documents`` and packing
    settings); else every example of a list or tuple, and of any other dataset up to
    ``FINGERPRINT_MAX_EXAMPLES`` examples (that many, evenly spaced, beyond). Each example counts by its whole
    content (``_hash_item``): tensors and arrays by dtype, shape and bytes, other values by type and value, so
    two datasets of the same length with other contents fingerprint differently.
    """
    digest = hashlib.sha256()
    source = dataset if _token_stream(dataset) else getattr(dataset, "documents", None)
    if _token_stream(source):
        for name in ("tokens", "starts", "lengths", "loss_mask"):
            array = getattr(source, name, None)
            if isinstance(array, np.ndarray):
                digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
        if source is not dataset:  # rows built from the stream: how they were built is part of the data
            settings = {name: getattr(dataset, name) for name in ("seq_len", "pad_id", "ignore_index")
                        if isinstance(getattr(dataset, name, None), int)}
            digest.update(repr((type(dataset).__qualname__, sorted(settings.items()))).encode())
        of = "token stream"
    else:
        n = len(dataset)
        if isinstance(dataset, (list, tuple)) or n <= FINGERPRINT_MAX_EXAMPLES:
            indices: Any = range(n)
            of = "every example"
        else:
            indices = sorted({int(i) for i in np.linspace(0, n - 1, num=FINGERPRINT_MAX_EXAMPLES)})
            of = f"{len(indices)} sampled examples"
        for i in indices:
            _hash_item(digest, dataset[i])
    return {"examples": len(dataset), "sha256": digest.hexdigest(), "of": of}


def _token_stream(dataset: Any) -> bool:
    return isinstance(getattr(dataset, "tokens", None), np.ndarray)


def _hash_item(digest: Any, item: Any) -> None:
    """Feeds one example into ``digest``, type-tagged and length-prefixed so that no two different contents
    feed the same bytes ([[1, 2], [3]] and [[1], [2, 3]], int32 and float32 zeros, a (2, 3) and a (3, 2)).

    Tensors and arrays: dtype, shape and bytes; str/bytes/numbers/None: their repr; lists, tuples (named ones
    with their field names), dicts and dataclasses: their fields in order; any other object: its ``__dict__``,
    or its repr where it has none (a repr holding an address would make equal data differ: a refused resume,
    never a silent one)."""
    if isinstance(item, torch.Tensor):
        # The bytes through a uint8 view: bf16 (which numpy has not) has no .numpy() of its own.
        data = item.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        digest.update(f"T{item.dtype}{tuple(item.shape)}".encode())
        digest.update(memoryview(data).cast("B"))
    elif isinstance(item, np.ndarray):
        digest.update(f"N{item.dtype.str}{item.shape}".encode())
        digest.update(memoryview(np.ascontiguousarray(item).reshape(-1)).cast("B"))
    elif item is None or isinstance(item, (str, bytes, bool, int, float, complex, np.generic)):
        text = repr(item).encode()
        digest.update(f"S{type(item).__qualname__}:{len(text)}:".encode() + text)
    elif isinstance(item, Mapping):
        digest.update(f"M{type(item).__qualname__}:{len(item)}:".encode())
        for key, value in item.items():
            _hash_item(digest, key)
            _hash_item(digest, value)
    elif isinstance(item, (list, tuple)):
        fields = getattr(item, "_fields", None)  # a NamedTuple: its field names are part of its meaning
        digest.update(f"L{type(item).__qualname__}{fields or ''}:{len(item)}:".encode())
        for value in item:
            _hash_item(digest, value)
    elif dataclasses.is_dataclass(item) and not isinstance(item, type):
        _hash_item(digest, {f.name: getattr(item, f.name) for f in dataclasses.fields(item)})
        digest.update(type(item).__qualname__.encode())
    elif hasattr(item, "__dict__"):
        _hash_item(digest, vars(item))
        digest.update(type(item).__qualname__.encode())
    else:
        _hash_item(digest, repr(item))


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    """The model's class and every parameter's name and shape (what a checkpoint must fit)."""
    return {"class": type(model).__name__,
            "shapes": {name: list(p.shape) for name, p in model.named_parameters()}}


# How a resume treats a changed TrainConfig field. "refuse": the continued run would not be the run that was
# started (other examples, another optimisation, another optimizer-state layout); "apply": it changes when or how,
# not what, is computed (or extends the schedule), and is applied with a logged line.
RESUME_POLICY: dict[str, str] = {
    **dict.fromkeys(("seed", "lr", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "precision",
                     "offload_optimizer", "fsdp"), "refuse"),
    **dict.fromkeys(("max_steps", "save_every", "eval_every", "eval_batches", "progress", "sample_bytes",
                     "micro_batch_size", "checkpointing", "checkpoint_every", "offload_activations", "chunked_loss",
                     "compile"), "apply"),
}


def compare_runs(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One message per run-defining difference between a checkpoint's run and this one (empty: the same run)."""
    problems = []
    fix = ("To resolve this error, resume with the original {what}, or start a new run in another out_dir.")
    for key in now:
        if key not in saved or saved[key] == now[key]:
            continue
        if key == "data":
            problems.append(_data_difference(saved[key], now[key]) + " " + fix.format(what="data"))
        elif key == "model":
            problems.append(_model_difference(saved[key], now[key]) + " " + fix.format(what="model"))
        else:
            problems.append(f"resume: {key}={now[key]!r} now but {key}={saved[key]!r} in the run being resumed. To "
                            f"resolve this error, pass {key}={saved[key]!r} (or leave it out: `memtrain train --resume` "
                            "reads the run's config), or start a new run in another out_dir.")
    return problems


def _data_difference(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    if saved.get("examples") != now.get("examples"):
        return (f"resume: the training data differ from the run being resumed: {now.get('examples')} examples now, "
                f"{saved.get('examples')} then (another file, or the same file changed).")
    return (f"resume: the training data differ from the run being resumed: the same {now.get('examples')} examples, "
            f"but other contents (SHA-256 of the {now.get('of')} {str(now.get('sha256'))[:12]} now, "
            f"{str(saved.get('sha256'))[:12]} then): the file changed, or another file of the same size.")


def _model_difference(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    if saved.get("class") != now.get("class"):
        return f"resume: the model is a {now.get('class')} now but was a {saved.get('class')} in the run being resumed."
    old, new = saved.get("shapes", {}), now.get("shapes", {})
    parts = []
    for label, names in (("only in this model", [n for n in new if n not in old]),
                         ("only in the run being resumed", [n for n in old if n not in new])):
        if names:
            parts.append(f"{len(names)} parameter(s) {label} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    reshaped = [n for n in new if n in old and list(new[n]) != list(old[n])]
    if reshaped:
        parts.append(f"{len(reshaped)} of another shape ("
                     + ", ".join(f"{n}: {new[n]} now, {old[n]} then" for n in reshaped[:3])
                     + (", ..." if len(reshaped) > 3 else "") + ")")
    return f"resume: the model differs from the run being resumed: {'; '.join(parts) or 'its parameters differ'}."


def applied_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """One log line per changed setting a resume applies (RESUME_POLICY "apply")."""
    lines = []
    for key, policy in RESUME_POLICY.items():
        if policy == "apply" and key in saved and key in now and saved[key] != now[key]:
            note = " (the cosine schedule now ends there)" if key == "max_steps" else ""
            lines.append(f"resume: {key}={now[key]!r} applied (the run had {key}={saved[key]!r}){note}")
    return lines


# -- the state of a run ------------------------------------------------------------------------------------
def save_run_state(checkpoints: RunCheckpoints | None, step: int, micro: int, model: nn.Module,
                   optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, accumulator: Any,
                   run: dict[str, Any], extra: dict[str, Any], config: Mapping[str, Any] | None = None) -> None:
    """Everything a bit-identical resume needs: weights, optimizer (offloaded state included), scheduler, fp16
    scaler, accumulator counters, the data position (the step) and every RNG. Collective under FSDP2: every rank
    calls it, rank 0 (the one with ``checkpoints``) writes."""
    state = {
        "step": step,
        "micro_batch_size": micro,
        "run": run,  # what defines the run (seed, batch, data, model): a resume must match it to be the same run
        "config": dict(config or {}),  # the settings a resume may change (RESUME_POLICY "apply"), for its log
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


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    if is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return model.state_dict()


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    if is_fsdp2(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def resume_run(checkpoints: RunCheckpoints, run: dict[str, Any], restore: Callable[[int, dict[str, Any]], None]
               ) -> tuple[int, dict[str, Any], list[str]]:
    """Restores the newest checkpoint that is intact and fits, checked against this run's defining settings
    ``run`` first (one ConfigError listing every difference: another seed, batch, data or model would not
    continue the same run). A checkpoint that cannot be read or restored is damaged: the previous one is tried.

    Args:
        restore: loads a checkpoint's (step, state) into the run's objects; whatever it raises marks it damaged.

    Returns:
        (step, state, the damaged checkpoints skipped, each with what is wrong with it).
    """
    skipped: list[str] = []
    for path, step, state in checkpoints.readable():
        if step is None:
            skipped.append(f"{path.name}: {state}")
            continue
        ConfigError.raise_if(compare_runs(state.get("run", {}), run))
        try:
            restore(step, state)
        except ConfigError:  # raised on purpose (e.g. the run already reached max_steps): not damage
            raise
        except _DAMAGE as e:
            skipped.append(f"{path.name}: its state does not load ({type(e).__name__}: {str(e)[:200]})")
            continue
        return step, state, skipped
    raise checkpoints.none_intact(skipped)


def restore_run_state(step: int, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                      scheduler: Any, scaler: Any, accumulator: Any) -> None:
    """Loads a checkpoint's state into the run's objects (raises what the objects raise on a state that does not
    fit them)."""
    if is_fsdp2(model):
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
