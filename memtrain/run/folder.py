"""Run folders that lose nothing and change nothing silently: ownership, a lock and the run's config.

A run folder is marked as memtrain's by a ``.memtrain-run`` file and written only under the names memtrain owns
(``RUN_OUTPUTS``): a folder holding anything else is refused unless overwrite, and even then memtrain replaces
only its own files and never one it did not write. A run holds an exclusive lock on its folder
(``.memtrain-lock``, with the holder's pid, host and start time) for as long as it uses it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memtrain.errors import ConfigError
from memtrain.files import atomic_write_bytes, free_bytes, write_fix
from memtrain.message import arg
from memtrain.report import format_bytes
from memtrain.run.checkpoints import RunCheckpoints, RunWriteError

try:  # POSIX; elsewhere the lock is a pid file only
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

RUN_FORMAT = 1  # of the run folder (marker, config.json); a newer one is refused
MARKER = ".memtrain-run"
LOCK = ".memtrain-lock"

# Files whose presence means a folder holds a run's results (a new run must not silently replace them).
RUN_FILES = ("metrics.jsonl", "model.safetensors", "checkpoints")
# Every name memtrain writes at a run folder's top level: the only names overwrite replaces.
RUN_OUTPUTS = (MARKER, LOCK, "config.json", *RUN_FILES, "report.json", "loss.png", "memory.png", "sample.txt", "hf",
               "tensorboard")
_TRASH_PREFIX = ".overwritten."


# -- the run folder -----------------------------------------------------------------------------------------
def _is_temporary(name: str) -> bool:
    """A temporary of ``atomic_write`` (``.<name>.<random>.tmp``) of a run output, or an overwrite's trash."""
    return name.startswith(_TRASH_PREFIX) or (name.endswith(".tmp") and
                                              any(name.startswith(f".{n}.") for n in RUN_OUTPUTS))


def _holder() -> dict[str, Any]:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def _record() -> bytes:
    """What the lock file holds: this process as the folder's holder."""
    return json.dumps(_holder()).encode()


# What a write refuses for want of room: a full disk, a full quota, a file-size limit (``ulimit -f``).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


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
        export: the run there is exported again (``memtrain export``): it must be a memtrain run folder.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False, resume: bool = False,
                 export: bool = False):
        self.path = Path(path)
        self.overwrite, self.resume, self.export = overwrite, resume, export
        self.notes: list[str] = []  # what lock() found and did, for the log
        self._fd: int | None = None
        self._created_folder = self._created_lock = self._committed = False

    # -- checks (nothing written) -----------------------------------------------------------------------
    def check(self) -> None:
        """Raises one ConfigError if the run may not use this folder; writes nothing."""
        out, shown = self.path, str(self.path)
        if os.path.islink(out) and not os.path.exists(out):
            raise ConfigError(f"{arg('out_dir', shown)} is a symbolic link to {os.readlink(out)!r}, which does not "
                              "exist (or is a loop of links). To resolve this error, pass a folder path, or create "
                              "the link's target.")
        if out.exists() and not out.is_dir():
            raise ConfigError(f"{arg('out_dir', shown)} is a file. To resolve this error, pass a folder path.")
        if self.export and not (out / MARKER).is_file():
            what = f"is not a memtrain run folder (it holds no {MARKER})" if out.exists() else "does not exist"
            raise ConfigError(f"{shown!r} {what}. To resolve this error, "
                              "pass the --out folder of a memtrain train run.")
        if not out.exists():
            self._check_creatable()
            if self.resume:
                raise ConfigError(f"{arg('resume', True)}: {shown!r} does not exist, so there is no run to continue. "
                                  f"To resolve this error, pass the {arg('out_dir')} of the run to continue, or drop "
                                  f"{arg('resume', True)}.")
            return
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"{arg('out_dir', shown)} is not writable. To resolve this error, pass a folder you can "
                              "write to.")
        # The lock alone is a run setting the folder up (this one, under lock()), not a foreign file.
        names = sorted(p.name for p in out.iterdir() if not _is_temporary(p.name) and p.name != LOCK)
        marker = self.marker()
        if marker is None and names:
            self._check_foreign(names)
            return
        if marker is not None and marker.get("format", RUN_FORMAT) > RUN_FORMAT:
            raise ConfigError(f"{arg('out_dir', shown)} holds a run of a newer memtrain (run format "
                              f"{marker['format']}; this one reads {RUN_FORMAT}). To resolve this error, upgrade "
                              f"memtrain, or pass another {arg('out_dir')}.")
        existing = [name for name in RUN_FILES if (out / name).exists()]
        if self.export:
            return
        if existing and not (self.overwrite or self.resume):
            raise ConfigError(
                f"{arg('out_dir', shown)} already holds a run's results ({', '.join(existing)}). To resolve this "
                f"error, pass {arg('resume', True)} to continue it, another {arg('out_dir')}, or "
                f"{arg('overwrite', True)} to replace it."
            )
        if self.resume and not RunCheckpoints(out).paths():
            if (out / "model.safetensors").is_file():
                raise ConfigError(
                    f"{arg('resume', True)}: the run in {shown!r} finished (its model.safetensors is there) and its "
                    "checkpoints/ is gone, so there is nothing left to train. To resolve this error, keep the run "
                    f"as it is (memtrain export {shown} writes hf/ and sample.txt again from model.safetensors), "
                    f"or start a new run in another {arg('out_dir')}; {arg('overwrite', True)} would delete its "
                    "model.safetensors.")
            fix = (f"pass {arg('overwrite', True)} to start it again (it stopped before its first checkpoint)"
                   if existing or marker is not None else
                   f"drop {arg('resume', True)} to start a new run there, or pass the {arg('out_dir')} of the run to "
                   "continue")
            raise ConfigError(f"{arg('resume', True)}: {shown!r} holds no checkpoint to resume from. To resolve this "
                              f"error, {fix}.")

    def _check_creatable(self) -> None:
        parent = self.path.absolute().parent
        while not parent.exists() and parent != parent.parent:
            if os.path.islink(parent):
                raise ConfigError(f"{arg('out_dir', str(self.path))} cannot be created: {str(parent)!r} is a symbolic "
                                  f"link to nothing. To resolve this error, pass another {arg('out_dir')}.")
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{arg('out_dir', str(self.path))} cannot be created: {str(parent)!r} is not a writable "
                              f"folder. To resolve this error, pass an {arg('out_dir')} in a folder you can write to.")

    def _check_foreign(self, names: list[str]) -> None:
        shown = str(self.path)
        listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        if self.resume:
            raise ConfigError(f"{arg('resume', True)}: {shown!r} is not a memtrain run folder (no {MARKER} marker; it "
                              f"holds {listed}). To resolve this error, pass the {arg('out_dir')} of the run to "
                              "continue.")
        clashes = [name for name in names if name in RUN_OUTPUTS]
        if clashes:
            raise ConfigError(
                f"{arg('out_dir', shown)} holds {', '.join(clashes)}, which memtrain did not write (the folder has no "
                f"{MARKER} marker) and a run would replace. To resolve this error, pass another {arg('out_dir')} (a "
                f"new or empty folder); memtrain never replaces files it did not write, even with "
                f"{arg('overwrite', True)}."
            )
        if not self.overwrite:
            raise ConfigError(
                f"{arg('out_dir', shown)} is not empty and not a memtrain run folder (no {MARKER} marker; it holds "
                f"{listed}). To resolve this error, pass a new or empty {arg('out_dir')}, or {arg('overwrite', True)} "
                "to write the run beside those files (memtrain never deletes what it did not write)."
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
        lock_path = self.path / LOCK
        try:
            self._created_folder = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            self._created_lock = not lock_path.exists()
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self._undo()
            if e.errno in _NO_ROOM:
                raise self._no_room(e, lock_path) from None
            raise ConfigError(f"{arg('out_dir', str(self.path))} cannot be written ({e.strerror}). To resolve this "
                              f"error, pass an {arg('out_dir')} you can write to.") from None
        try:
            self._take(fd, lock_path)
        except BaseException as e:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no part of a record left for the next run to puzzle over
            os.close(fd)
            self._undo()
            if isinstance(e, OSError) and e.errno in _NO_ROOM:
                raise self._no_room(e, lock_path) from None
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
        record = _record()
        # A full disk may take part of the record and say so in the count: a lock naming no holder is no lock.
        if os.pwrite(fd, record, 0) != len(record):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)

    def _no_room(self, error: OSError, lock_path: Path) -> RunWriteError:
        """The one line of a disk (or quota, or file-size limit) with no room for the lock: the run folder is
        taken before anything else is written, so nothing of the run changed."""
        free = free_bytes(self.path)
        room = f"; it needs {len(_record())} B, {format_bytes(free)} free on its disk" if free is not None else ""
        return RunWriteError(f"could not write {lock_path} ({error.strerror or error}){room}: the lock that takes "
                             f"the run folder, written before anything else, so nothing of the run changed. To "
                             f"resolve this error, {write_fix(error)}, then run the command again.")

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
                f"{arg('out_dir', str(self.path))} is locked ({lock_path}): its holder, {_describe(holder)}, is no "
                "longer running, but a process it started still holds the lock. To resolve this error, end that "
                f"process (`fuser -v {lock_path}` shows it), or pass another {arg('out_dir')}."
            )
        raise ConfigError(
            f"{arg('out_dir', str(self.path))} is in use by another run: {_describe(holder)} (lock file "
            f"{lock_path}). To resolve this error, wait for that run to end or stop it, or pass another "
            f"{arg('out_dir')}."
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


