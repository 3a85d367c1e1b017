"""The built-in corpus: real, deterministic, split, windowed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memtrain import ConfigError
from memtrain.data.corpus import (
    ByteWindows,
    builtin_corpus,
    split_windows,
    stdlib_corpus,
    stdlib_source_files,
    text_file_tokens,
)


def test_corpus_is_the_standard_library_in_a_fixed_order():
    files = stdlib_source_files()
    names = [f.name for f in files]
    assert "os.py" in names and "argparse.py" in names
    assert not any("/test/" in f.as_posix() or "site-packages" in f.as_posix() for f in files)
    a, b = stdlib_corpus(max_bytes=2**16), stdlib_corpus(max_bytes=2**16)
    assert a.dtype == np.uint8 and a.size == 2**16 and np.array_equal(a, b)
    assert a[:200].tobytes().decode("utf-8", "replace").strip()  # real text


def test_windows_and_split():
    train, val = builtin_corpus(64, max_bytes=2**16, val_fraction=0.1)
    x, y = train[3]
    assert x.shape == y.shape == (64,) and x.dtype == torch.int64
    assert torch.equal(x[1:], y[:-1])
    assert len(train) > 8 * len(val) > 0
    # held-out windows come from the end of the stream, not from the training part
    assert not torch.equal(val[0][0], train[0][0])


def test_bad_inputs(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        text_file_tokens(tmp_path / "missing.txt")
    with pytest.raises(ConfigError, match="validation windows"):
        split_windows(np.zeros(10, dtype=np.uint8), 8)
    with pytest.raises(ConfigError):
        ByteWindows(np.zeros(10, dtype=np.uint8), 0)
    f = tmp_path / "t.txt"
    f.write_bytes(b"hello world " * 100)
    assert text_file_tokens(f).size == 1200
