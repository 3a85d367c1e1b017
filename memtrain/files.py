"""Files written so that a crash leaves the old contents or the new, never half: atomic writes and folder swaps
(fsynced before the rename, the rename fsynced after), and a file's SHA-256."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import SafetensorError


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flushes a file's or a folder's contents to disk (a folder's: its names, so a rename survives a power cut)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(staging: Path, target: Path) -> None:
    """Renames the complete folder ``staging`` to ``target``, after its files are on disk, so that a crash leaves
    the old ``target`` or the new one, never a mix.

    An existing ``target`` is swapped, never deleted first: two renames, with the old folder kept as
    ``.<name>.old`` beside it until the new one is in place (``RunCheckpoints.clean_temporaries`` puts a
    checkpoint caught between the two renames back)."""
    for file in staging.rglob("*"):
        if file.is_file():
            fsync_path(file)
    fsync_path(staging)
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(staging, target)
    fsync_path(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a crash leaves either the old file or the new one, never half of it."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], Any]) -> None:
    """Runs ``write(tmp)`` on a temporary file beside ``path``, fsyncs it and renames it over ``path``.

    Raises:
        OSError: the write failed (a full disk, a file-size limit), safetensors' SafetensorError included.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)  # the rename itself survives a power cut
    except SafetensorError as e:
        tmp.unlink(missing_ok=True)
        os_error = as_os_error(e, path)
        if os_error is None:
            raise
        raise os_error from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# safetensors reports the OS's error inside its message: "... I/O error: No space left on device (os error 28)".
_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)")


def as_os_error(error: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """The OSError behind a failed write: ``error`` itself, or the one a ``SafetensorError`` wraps (safetensors
    raises its own type for a full disk or a file-size limit, not an OSError); None for any other error."""
    if isinstance(error, OSError):
        return error
    match = _OS_ERROR_IN_MESSAGE.search(str(error)) if isinstance(error, SafetensorError) else None
    if match is None:
        return None
    code = int(match.group(1))
    return OSError(code, os.strerror(code), str(path))


def write_fix(error: OSError) -> str:
    """What frees a write the OS refused: space, a raised file-size limit, or write permission."""
    if error.errno == errno.EFBIG:
        return "raise the file-size limit (`ulimit -f unlimited`) or write to a filesystem that allows larger files"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "free space on that disk (or raise your quota)"
    return "free space on that disk or make the folder writable"


def free_bytes(path: str | os.PathLike[str]) -> int | None:
    """The bytes free on the filesystem holding ``path`` (its nearest existing folder), or None if unknown."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
