"""The built-in corpus: real, deterministic, split, windowed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memtrain import ConfigError
from memtrain.data import (
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


# -- library errors name the argument, not a CLI flag (the CLI translates) ----------------------------------
def _bad_data_calls(tmp_path):
    from memtrain.data import TokenDocuments, _jsonl_records, _text_documents, tokenize_file

    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n  \n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1]\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"a")
    (tmp_path / "d.jsonl").mkdir()
    return {
        "missing text": lambda: text_file_tokens(tmp_path / "missing.txt"),
        "a directory": lambda: text_file_tokens(tmp_path),
        "tiny": lambda: text_file_tokens(tiny),
        "short windows": lambda: split_windows(np.zeros(10, dtype=np.uint8), 8),
        "missing jsonl": lambda: TokenDocuments.from_file(tmp_path / "missing.jsonl"),
        "jsonl a directory": lambda: TokenDocuments.from_file(tmp_path / "d.jsonl"),
        "missing tokenised": lambda: tokenize_file(tmp_path / "missing.txt", None),
        "bad lines": lambda: _jsonl_records(bad),
        "no records": lambda: _jsonl_records(empty),
        "no text": lambda: _text_documents(blank),
    }


@pytest.mark.parametrize("case", ["missing text", "a directory", "tiny", "short windows", "missing jsonl",
                                  "jsonl a directory", "missing tokenised", "bad lines", "no records", "no text"])
def test_data_errors_name_the_argument_not_a_cli_flag(case, tmp_path):
    import re

    with pytest.raises(ConfigError) as info:
        _bad_data_calls(tmp_path)[case]()
    message = str(info.value)
    assert not re.search(r"(?<![\w-])--[a-z]", message), f"{case}: a CLI flag in a library error: {message}"
    assert "To resolve this error" in message, message
    if case.startswith("missing") or "directory" in case:
        assert "path=" in message, message
    if "directory" in case:
        assert "is a directory" in message and "no such file" not in message, message
