"""Documents: variable-length examples held as one token array plus a start and a length each, and the readers
of ``.txt`` (documents split on blank lines) and ``.jsonl`` (text or prompt/completion records) files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from memtrain.data.corpus import data_file, is_jsonl, stdlib_corpus, text_file_tokens
from memtrain.errors import ConfigError
from memtrain.message import words

# A blank line: a newline, then lines holding only whitespace, then a newline.
# What separates two documents of a text file: a blank line (or several; spaces and tabs count as blank). One
# pattern for byte tokens (TokenDocuments.from_tokens) and for text (text_documents, which tokenize_file reads).
_BLANK_LINE = r"\n(?:[ \t\r\f\v]*\n)+"
_BLANK_LINES = re.compile(_BLANK_LINE.encode())

_MAX_LISTED_PROBLEMS = 20  # bad .jsonl lines named in the error; the rest are counted


class Document(NamedTuple):
    """One document whose loss covers only some of its tokens (a completion after its prompt).

    ``labels`` equals ``tokens`` where the model must learn to predict the token and is ``ignore_index`` (-100)
    elsewhere, aligned with ``tokens`` (Hugging Face's unshifted convention): the collates build the target of
    position ``t`` from ``labels[t + 1]``.
    """

    tokens: torch.Tensor  # (length,) int64
    labels: torch.Tensor  # (length,) int64; ignore_index on tokens that carry no loss


class TokenDocuments(Dataset):
    """Separate documents as one token array plus a start and a length per document.

    Variable-length examples cost nothing in padding only if batches group similar lengths (see
    ``LengthBucketSampler``); the arrays are shared by DataLoader workers instead of copied on access. Item ``i``
    is document ``i`` as an ``int64`` tensor of tokens (bytes, or a tokenizer's ids); ``PadCollate`` turns a list
    of them into ``(x, y)``. With a ``loss_mask`` (False on tokens that carry no loss, e.g. a prompt: see
    ``tokenize_file``) item ``i`` is a ``Document`` instead.

    Build one with ``from_file`` (a ``.jsonl`` file with a ``"text"`` field per line, or a text file split on
    blank lines), ``from_texts`` or ``from_tokens``. With ``max_len``, longer documents are cut into pieces of at
    most ``max_len`` tokens that overlap by one token, so no next-token pair is lost at a cut.

    Example:
        >>> docs = TokenDocuments.from_texts(["ab", "", "hello world"], max_len=6)
        >>> len(docs), docs.lengths.tolist(), bytes(docs[2].tolist())
        (3, [2, 6, 6], b' world')
    """

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 loss_mask: np.ndarray | None = None):
        tokens, starts, lengths = np.asarray(tokens), np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
        problems = []
        if tokens.ndim != 1:
            problems.append(f"tokens has shape {tokens.shape}; it must be one flat array. To resolve this error, "
                            "pass tokens.reshape(-1) with starts and lengths into it.")
        if loss_mask is not None:
            loss_mask = np.asarray(loss_mask, dtype=bool)
            if loss_mask.shape != tokens.shape:
                problems.append(f"loss_mask has shape {loss_mask.shape}; it must have one flag per token "
                                f"({tokens.shape}). To resolve this error, pass a bool array of the tokens' shape.")
        if starts.shape != lengths.shape or starts.ndim != 1:
            problems.append(f"starts {starts.shape} and lengths {lengths.shape} must be flat arrays of one size. To "
                            "resolve this error, pass one start and one length per document.")
        elif len(starts) and (starts.min() < 0 or lengths.min() < 1 or (starts + lengths).max() > len(tokens)):
            problems.append(f"document spans must lie inside the {len(tokens)} tokens and hold >= 1 token each. To "
                            "resolve this error, pass starts >= 0, lengths >= 1 and starts + lengths <= len(tokens).")
        if len(starts) == 0:
            problems.append("no documents. To resolve this error, give text holding at least one document of "
                            "two or more bytes.")
        ConfigError.raise_if(problems)
        self.tokens, self.starts, self.lengths, self.loss_mask = tokens, starts, lengths, loss_mask

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> torch.Tensor | Document:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, stop = self.starts[i], self.starts[i] + self.lengths[i]
        tokens = torch.from_numpy(self.tokens[start:stop].astype(np.int64))
        if self.loss_mask is None:
            return tokens
        labels = tokens.masked_fill(torch.from_numpy(~self.loss_mask[start:stop]), -100)
        return Document(tokens, labels)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def split(self, val_fraction: float = 0.05) -> tuple[TokenDocuments, TokenDocuments]:
        """(training, validation): the last ``val_fraction`` of the documents held out; the tokens are shared."""
        cut = held_out_cut(len(self), val_fraction)
        return (TokenDocuments(self.tokens, self.starts[:cut], self.lengths[:cut], self.loss_mask),
                TokenDocuments(self.tokens, self.starts[cut:], self.lengths[cut:], self.loss_mask))

    @classmethod
    def from_spans(cls, tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, *, max_len: int | None = None,
                   min_len: int = 2, loss_mask: np.ndarray | None = None) -> TokenDocuments:
        """Documents ``tokens[starts[i]:ends[i]]``, cut to ``max_len``; pieces under ``min_len`` tokens dropped."""
        problems = []
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2):
            problems.append(f"max_len={max_len!r} must be an integer >= 2 (one input and one target token), "
                            "or None. To resolve this error, pass max_len=seq_len + 1.")
        if isinstance(min_len, bool) or not isinstance(min_len, int) or min_len < 1:
            problems.append(f"min_len={min_len!r} must be an integer >= 1 (2 drops documents with no pair). To "
                            "resolve this error, pass e.g. min_len=2.")
        ConfigError.raise_if(problems)
        starts, lengths = np.asarray(starts, np.int64), np.asarray(ends, np.int64) - np.asarray(starts, np.int64)
        if max_len is not None and len(starts):
            # Pieces step by max_len - 1 so that the last token of a piece is the first of the next: every
            # (token, next token) pair of the document is still a training pair.
            stride = max_len - 1
            pieces = np.maximum(1, -(-(lengths - 1) // stride))
            doc = np.repeat(np.arange(len(starts)), pieces)
            k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            starts = starts[doc] + k * stride
            lengths = np.minimum(max_len, lengths[doc] - k * stride)
        keep = lengths >= min_len
        return cls(tokens, starts[keep], lengths[keep], loss_mask)

    @classmethod
    def from_tokens(cls, tokens: np.ndarray, *, max_len: int | None = None, min_len: int = 2) -> TokenDocuments:
        """Splits a byte-token array on blank lines; each document keeps the newline ending its last line."""
        data = np.asarray(tokens, dtype=np.uint8)
        separators = [(m.start(), m.end()) for m in _BLANK_LINES.finditer(data.tobytes())]
        bounds = np.array(separators, dtype=np.int64).reshape(-1, 2)
        starts = np.concatenate([[0], bounds[:, 1]])
        ends = np.concatenate([bounds[:, 0] + 1, [len(data)]])
        return cls.from_spans(data, starts, ends, max_len=max_len, min_len=min_len)

    @classmethod
    def from_texts(cls, texts: Iterable[str], *, max_len: int | None = None, min_len: int = 2) -> TokenDocuments:
        """One document per string, as UTF-8 bytes."""
        encoded = [t.encode("utf-8") for t in texts]
        ends = np.cumsum([len(b) for b in encoded], dtype=np.int64)
        tokens = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls.from_spans(tokens, ends - np.array([len(b) for b in encoded], np.int64), ends,
                              max_len=max_len, min_len=min_len)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], *, max_len: int | None = None,
                  min_len: int = 2) -> TokenDocuments:
        """A ``.jsonl`` file (one JSON object with a ``"text"`` string per line) or a text file split on blank lines."""
        p = Path(path)
        if not is_jsonl(p):
            return cls.from_tokens(text_file_tokens(p), max_len=max_len, min_len=min_len)
        records = jsonl_records(data_file(p, "a .jsonl file"))
        prompted = sum(bool(prompt) for prompt, _ in records)
        if prompted:
            # Bytes have no loss mask here: the prompt would be trained on as text, silently.
            raise ConfigError(f"{p} holds {prompted} prompt/completion record(s), whose loss belongs on the "
                              "completion only. To resolve this error, tokenise it with tokenize_file(path, "
                              'tokenizer) (a loss mask on the prompt), or write {"text": ...} records.')
        return cls.from_texts([text for _, text in records], max_len=max_len, min_len=min_len)


# The advice to hold out another fraction, in the command's terms (memtrain train holds out a fixed 5%).
_EVAL_DATA_INSTEAD = ("(memtrain train holds out the last 5% of them for validation), or pass --eval-data FILE, "
                      "with which every document of --data trains")


def held_out_cut(documents: int, val_fraction: float) -> int:
    """How many of ``documents`` train when the last ``val_fraction`` of them are held out (``split``'s rule),
    checked: both parts must hold a document. ``tokenize_file`` asks it before tokenising, so a file that cannot be
    split (one long line) is refused at once, not after minutes of tokenising.

    Raises:
        ConfigError: a fraction outside (0, 1), or too few documents for both parts.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive). To resolve this "
                          "error, pass e.g. val_fraction=0.05.")
    cut = int(documents * (1.0 - val_fraction))
    if cut == 0 or cut == documents:
        raise ConfigError(f"{documents} documents make {cut} training and {documents - cut} validation "
                          "documents. To resolve this error, use more documents (a .txt file's documents are "
                          "separated by blank lines, a .jsonl file's are its lines) "
                          f"{words('or another val_fraction', _EVAL_DATA_INSTEAD)}.")
    return cut


def stdlib_documents(max_len: int, *, max_bytes: int = 8 * 2**20) -> TokenDocuments:
    """The built-in corpus split on blank lines (functions, classes, paragraphs): mixed-length documents."""
    return TokenDocuments.from_tokens(stdlib_corpus(max_bytes), max_len=max_len)


def jsonl_records(path: Path) -> list[tuple[str, str]]:
    """(prompt, text) per record: ``{"text": ...}`` gives ("", text); ``{"prompt": ..., "completion": ...}``
    gives (prompt, completion). Every bad line is reported, with its number, in one ConfigError."""
    records, problems = [], []
    with path.open(encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e}). To resolve this error, re-encode it as UTF-8.") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(f"line {number}: not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(record, dict):
            problems.append(f"line {number}: a JSON {type(record).__name__}, not an object")
        elif "prompt" in record or "completion" in record:
            bad = [k for k in ("prompt", "completion") if not isinstance(record.get(k), str)]
            if bad:
                problems.append(f"line {number}: " + ", ".join(
                    f'"{k}" is {"missing" if k not in record else type(record[k]).__name__ + ", not a string"}'
                    for k in bad))
            elif not _surrogates(number, record, ("prompt", "completion"), problems):
                records.append((record["prompt"], record["completion"]))
        elif not isinstance(record.get("text"), str):
            problems.append(f'line {number}: "text" is ' + ("missing" if "text" not in record else
                                                          f"{type(record['text']).__name__}, not a string"))
        elif not _surrogates(number, record, ("text",), problems):
            records.append(("", record["text"]))
    if problems:
        listed = problems[:_MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        raise ConfigError(f"{path}: {len(problems)} bad line(s): " + "; ".join(listed) +
                          (f"; and {more} more" if more else "") + '. To resolve this error, write one JSON '
                          'object per line with a "text" string, or "prompt" and "completion" strings (the loss '
                          "is then on the completion only), in valid Unicode.")
    if not records:
        raise ConfigError(f"{path} holds no records. To resolve this error, write one JSON object per line, "
                          'e.g. {"text": "..."}.')
    return records


_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogates(number: int, record: dict, keys: tuple[str, ...], problems: list[str]) -> bool:
    """Whether a field of line ``number`` holds a lone surrogate (a JSON escape such as ``\\ud800``, half of a
    UTF-16 pair: not text, and no tokenizer encodes it); each is added to ``problems``."""
    found = False
    for key in keys:
        match = _SURROGATE.search(record[key])
        if match:
            problems.append(f'line {number}: "{key}" holds a lone surrogate \\u{ord(match.group()):04x} at '
                            f"character {match.start() + 1} (half of a UTF-16 pair, not text)")
            found = True
    return found


def text_documents(path: Path) -> list[tuple[str, str]]:
    """A text file's documents (split on blank lines), as ("", document)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e}). To resolve this error, re-encode it as UTF-8.") from None
    docs = [d for d in re.split(_BLANK_LINE, text) if d.strip()]
    if not docs:
        raise ConfigError(f"{path} holds no text. To resolve this error, pass a file with documents "
                          "separated by blank lines.")
    return [("", d) for d in docs]


def separator_note(tokenizer: Any) -> str | None:
    """What a tokenizer leaves between packed documents, when it is nothing: ``tokenize_file`` ends each document
    with the EOS token and the tokenizer may begin each with a BOS; with neither, the documents of a packed row run
    into each other with no token marking where one ends (attention still stays inside each, since the positions
    restart), so the model never learns to end a text. None when there is a separator."""
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None:
        try:
            if bos in tokenizer("a", add_special_tokens=True)["input_ids"]:
                return None
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "a" gets the note rather than a failure
            pass
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return (f"the tokenizer in {name} has no end-of-text token (eos_token) and adds no bos_token, so the packed "
            "documents have no token between them: the model never learns where a text ends (attention still stays "
            "inside each document). To add a separator, name one of its tokens the eos_token and save it "
            "(tokenizer.eos_token = '<|endoftext|>'; tokenizer.save_pretrained(DIR)).")
