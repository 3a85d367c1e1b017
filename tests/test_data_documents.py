"""Documents: .jsonl and text files read, split and cut without losing a pair; every bad input a ConfigError that
names the argument."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from memtrain.data.corpus import split_windows, text_file_tokens
from memtrain.data.documents import TokenDocuments, jsonl_records, text_documents
from memtrain.data.token_cache import tokenize_file
from memtrain.errors import ConfigError


def test_jsonl_documents_round_trip(tmp_path):
    texts = ["first document", "", "ünïcode ✓ text", "x", "a\n\nparagraphs stay in one document"]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)) + "\n")
    docs = TokenDocuments.from_file(path)
    kept = [t.encode() for t in texts if len(t.encode()) >= 2]  # a document needs one (input, target) pair
    assert [bytes(docs[i].tolist()) for i in range(len(docs))] == kept
    assert isinstance(docs.tokens, np.ndarray) and docs.tokens.dtype == np.uint8 and docs.starts.dtype == np.int64


def test_split_holds_out_the_last_documents_sharing_the_tokens():
    docs = TokenDocuments.from_texts([f"doc {i}" for i in range(20)])
    train, val = docs.split(0.1)
    assert (len(train), len(val)) == (18, 2) and train.tokens is docs.tokens is val.tokens
    assert bytes(val[1].tolist()) == b"doc 19"
    with pytest.raises(ConfigError, match="1 documents make 0 training"):
        TokenDocuments.from_texts(["only one"]).split(0.5)


def test_text_file_splits_on_blank_lines(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(b"one\ntwo\n\n\nthree\n  \t\nfour five\n")
    docs = TokenDocuments.from_file(path)
    assert [bytes(docs[i].tolist()) for i in range(len(docs))] == [b"one\ntwo\n", b"three\n", b"four five\n"]


def test_long_documents_are_cut_without_losing_a_next_token_pair():
    text = "".join(chr(97 + i % 26) for i in range(100))
    docs = TokenDocuments.from_texts([text, "short"], max_len=16)
    assert docs.lengths.max() == 16 and len(docs) == 8, docs.lengths  # ceil(99 / 15) = 7 pieces, then "short"
    pairs = [(int(a), int(b)) for i in range(7) for a, b in zip(docs[i][:-1], docs[i][1:], strict=True)]
    raw = text.encode()
    assert pairs == list(zip(raw[:-1], raw[1:], strict=True))


@pytest.mark.parametrize("line, needle", [("not json", "docs.jsonl: 1 bad line(s): line 2: not valid JSON"),
                                          ('{"body": "x"}', 'docs.jsonl: 1 bad line(s): line 2: "text" is missing')])
def test_bad_jsonl_lines_are_named(tmp_path, line, needle):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)):
        TokenDocuments.from_file(path)


def test_byte_documents_refuse_prompt_completion_records(tmp_path):
    """Bytes carry no loss mask: the prompt would be trained on as text, so a tokenizer's reader must take it."""
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"prompt": "Q", "completion": "A"}) + "\n")
    with pytest.raises(ConfigError, match=r"1 prompt/completion record\(s\).*tokenize_file"):
        TokenDocuments.from_file(path)


def test_empty_or_missing_files_raise(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        TokenDocuments.from_file(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ConfigError, match="holds no records"):
        TokenDocuments.from_file(tmp_path / "empty.jsonl")
    with pytest.raises(ConfigError, match="max_len=1 must be an integer >= 2"):
        TokenDocuments.from_texts(["abc"], max_len=1)


def _bad_data_calls(tmp_path):
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
        "bad lines": lambda: jsonl_records(bad),
        "no records": lambda: jsonl_records(empty),
        "no text": lambda: text_documents(blank),
    }


@pytest.mark.parametrize("case", ["missing text", "a directory", "tiny", "short windows", "missing jsonl",
                                  "jsonl a directory", "missing tokenised", "bad lines", "no records", "no text"])
def test_data_errors_name_the_argument_not_a_cli_flag(case, tmp_path):
    with pytest.raises(ConfigError) as info:
        _bad_data_calls(tmp_path)[case]()
    message = str(info.value)
    assert not re.search(r"(?<![\w-])--[a-z]", message), f"{case}: a CLI flag in a library error: {message}"
    assert "To resolve this error" in message, message
    if case.startswith("missing") or "directory" in case:
        assert "path=" in message, message
    if "directory" in case:
        assert "is a directory" in message and "no such file" not in message, message
