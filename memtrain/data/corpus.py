"""The built-in corpus: the Python standard library's own source, as byte tokens (vocabulary 256), cut into
fixed windows of ``(x, y)``.

The corpus is real text present on every machine with Python, so the main job needs no download. Tokens are
held in one numpy array (not Python lists), so DataLoader workers share it instead of copying it on access
(Python objects grow in every worker by copy-on-access: pytorch issue 13246).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from memtrain.errors import ConfigError
from memtrain.message import arg

# Trees of the standard library that are not library code (tests, vendored packages, the IDE).
_SKIPPED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"})


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files, in a deterministic order (sorted relative paths)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_corpus(max_bytes: int = 8 * 2**20) -> np.ndarray:
    """The first ``max_bytes`` bytes of the standard library's source, files joined by a blank line.

    Returns:
        A ``uint8`` array of byte tokens (vocabulary 256).
    """
    chunks, total = [], 0
    for path in stdlib_source_files():
        data = path.read_bytes() + b"\n\n"
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total == 0:
        raise ConfigError("no Python standard library source found under "
                          f"{sysconfig.get_paths()['stdlib']}. To resolve this error, train on a text file of your "
                          "own: text_file_tokens(path=...).")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()


def data_file(path: str | os.PathLike[str], kind: str) -> Path:
    """``path`` as a ``Path`` if it is a regular file, else one ConfigError saying what it is instead.

    Args:
        kind: what the caller reads, for the fix (e.g. ``"a text file"``).
    """
    p = Path(path)
    if p.is_file():
        return p
    what = ("is a directory" if p.is_dir() else "is not a regular file (a FIFO, socket or device)" if p.exists()
            else "no such file")
    raise ConfigError(f"{arg('path', str(path))}: {what}. To resolve this error, pass the path of {kind}.")


def is_jsonl(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a ``.jsonl`` file, in any case (``docs.JSONL``), a name that is only the extension
    (``.jsonl``, whose ``Path.suffix`` is empty) included."""
    return Path(path).name.lower().endswith(".jsonl")


def text_file_tokens(path: str | os.PathLike[str]) -> np.ndarray:
    """The bytes of a text file as ``uint8`` tokens."""
    p = data_file(path, "a text file")
    tokens = np.fromfile(p, dtype=np.uint8)
    if tokens.size < 2:
        raise ConfigError(f"{arg('path', str(path))} holds {tokens.size} bytes; at least two windows of text are "
                          "needed. To resolve this error, pass a longer text file.")
    return tokens


class ByteWindows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` tokens: item ``i`` is ``(x, y)`` with ``y`` shifted by one.

    Example:
        >>> ds = ByteWindows(np.arange(10, dtype=np.uint8), seq_len=4)
        >>> len(ds), ds[1][0].tolist(), ds[1][1].tolist()
        (2, [4, 5, 6, 7], [5, 6, 7, 8])
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ConfigError(f"{arg('seq_len', text=str(seq_len))} must be >= 1. To resolve this error, pass the "
                              f"model's sequence length, e.g. {arg('seq_len', 256)}.")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def split_windows(tokens: np.ndarray, seq_len: int, *, val_fraction: float = 0.05) -> tuple[ByteWindows, ByteWindows]:
    """Splits a token stream into a training and a held-out part (the last ``val_fraction``), as windows."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive). To resolve this "
                          "error, pass e.g. val_fraction=0.05.")
    cut = int(len(tokens) * (1.0 - val_fraction))
    train, val = ByteWindows(tokens[:cut], seq_len), ByteWindows(tokens[cut:], seq_len)
    if len(train) == 0 or len(val) == 0:
        raise ConfigError(f"{len(tokens)} tokens make {len(train)} training and {len(val)} validation windows of "
                          f"{seq_len} tokens. To resolve this error, use more text or a shorter {arg('seq_len')}.")
    return train, val


def builtin_corpus(seq_len: int, *, max_bytes: int = 8 * 2**20, val_fraction: float = 0.05) -> tuple[ByteWindows, ByteWindows]:
    """The built-in corpus as (train, validation) windows of ``seq_len`` byte tokens."""
    return split_windows(stdlib_corpus(max_bytes), seq_len, val_fraction=val_fraction)
