"""Files written so that a crash leaves the old contents or the new, never half: atomic writes and folder swaps
(fsynced before the rename, the rename fsynced after), and a file's SHA-256."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


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
        fsync_path(path.parent)  # the rename itself survives a power cut
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
