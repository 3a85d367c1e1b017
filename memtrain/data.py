"""Data: the built-in corpus, text datasets, validated loaders, a device prefetcher and length bucketing.

The corpus is real text present on every machine with Python, so the main job needs no download. Tokens are
held in one numpy array (not Python lists), so DataLoader workers share it instead of copying it on access
(Python objects grow in every worker by copy-on-access: pytorch issue 13246).

Read in this order: the corpus (fixed windows), documents (variable-length examples), ``make_loader`` (worker,
pinning and prefetch settings checked against the machine, automatic choices with their reasons),
``LengthBucketSampler`` + ``PadCollate`` (less padding) or ``PackCollate`` (documents packed into full rows),
``DevicePrefetcher`` (the host->device copy hidden behind compute).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import hashlib
import json
import os
import re
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Sampler

from memtrain.errors import ConfigError

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
    raise ConfigError(f"path={str(path)!r}: {what}. To resolve this error, pass the path of {kind}.")


def text_file_tokens(path: str | os.PathLike[str]) -> np.ndarray:
    """The bytes of a text file as ``uint8`` tokens."""
    p = data_file(path, "a text file")
    tokens = np.fromfile(p, dtype=np.uint8)
    if tokens.size < 2:
        raise ConfigError(f"path={str(path)!r} holds {tokens.size} bytes; at least two windows of text are needed. "
                          "To resolve this error, pass a longer text file.")
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
            raise ConfigError(f"seq_len={seq_len} must be >= 1. To resolve this error, pass the model's sequence "
                              "length, e.g. seq_len=256.")
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
                          f"{seq_len} tokens. To resolve this error, use more text or a shorter seq_len.")
    return train, val


def builtin_corpus(seq_len: int, *, max_bytes: int = 8 * 2**20, val_fraction: float = 0.05) -> tuple[ByteWindows, ByteWindows]:
    """The built-in corpus as (train, validation) windows of ``seq_len`` byte tokens."""
    return split_windows(stdlib_corpus(max_bytes), seq_len, val_fraction=val_fraction)


# -- documents: variable-length examples ---------------------------------------------------------------------
# A blank line: a newline, then lines holding only whitespace, then a newline.
# What separates two documents of a text file: a blank line (or several; spaces and tabs count as blank). One
# pattern for byte tokens (TokenDocuments.from_tokens) and for text (tokenize_file).
_BLANK_LINE = r"\n(?:[ \t\r\f\v]*\n)+"
_BLANK_LINES = re.compile(_BLANK_LINE.encode())


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
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive). To resolve this "
                          "error, pass e.g. val_fraction=0.05.")
        cut = int(len(self) * (1.0 - val_fraction))
        if cut == 0 or cut == len(self):
            raise ConfigError(f"{len(self)} documents make {cut} training and {len(self) - cut} validation "
                              "documents. To resolve this error, use more documents or another val_fraction.")
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
        if p.suffix.lower() != ".jsonl":
            return cls.from_tokens(text_file_tokens(p), max_len=max_len, min_len=min_len)
        records = _jsonl_records(data_file(p, "a .jsonl file"))
        prompted = sum(bool(prompt) for prompt, _ in records)
        if prompted:
            # Bytes have no loss mask here: the prompt would be trained on as text, silently.
            raise ConfigError(f"{p} holds {prompted} prompt/completion record(s), whose loss belongs on the "
                              "completion only. To resolve this error, tokenise it with tokenize_file(path, "
                              'tokenizer) (a loss mask on the prompt), or write {"text": ...} records.')
        return cls.from_texts([text for _, text in records], max_len=max_len, min_len=min_len)


def stdlib_documents(max_len: int, *, max_bytes: int = 8 * 2**20) -> TokenDocuments:
    """The built-in corpus split on blank lines (functions, classes, paragraphs): mixed-length documents."""
    return TokenDocuments.from_tokens(stdlib_corpus(max_bytes), max_len=max_len)


# -- tokenised text: a model's own tokenizer, cached beside the data --------------------------------------------
TOKEN_CACHE_VERSION = 1  # bump when the tokenisation below changes: old caches then miss instead of lying
_PROGRESS_BYTES = 4 * 2**20  # files above this show a progress bar while tokenising
_MAX_LISTED_PROBLEMS = 20


def _jsonl_records(path: Path) -> list[tuple[str, str]]:
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
            else:
                records.append((record["prompt"], record["completion"]))
        elif not isinstance(record.get("text"), str):
            problems.append(f'line {number}: "text" is ' + ("missing" if "text" not in record else
                                                          f"{type(record['text']).__name__}, not a string"))
        else:
            records.append(("", record["text"]))
    if problems:
        listed = problems[:_MAX_LISTED_PROBLEMS]
        more = len(problems) - len(listed)
        raise ConfigError(f"{path}: {len(problems)} bad line(s): " + "; ".join(listed) +
                          (f"; and {more} more" if more else "") + '. To resolve this error, write one JSON '
                          'object per line with a "text" string, or "prompt" and "completion" strings (the loss '
                          "is then on the completion only).")
    if not records:
        raise ConfigError(f"{path} holds no records. To resolve this error, write one JSON object per line, "
                          'e.g. {"text": "..."}.')
    return records


def _text_documents(path: Path) -> list[tuple[str, str]]:
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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides a tokenizer's ids here: its full definition and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"{type(tokenizer).__name__} is not a fast tokenizer (no backend_tokenizer). To resolve "
                          "this error, load the model folder's tokenizer.json (memtrain.hf.load_tokenizer).")
    h = hashlib.sha256(backend.to_str().encode())
    h.update(json.dumps([TOKEN_CACHE_VERSION, tokenizer.eos_token_id, tokenizer.bos_token_id]).encode())
    return h.hexdigest()


def token_cache_path(path: str | os.PathLike[str], tokenizer: Any, *, cache_dir: str | os.PathLike[str] | None = None
                     ) -> Path:
    """Where ``tokenize_file`` caches ``path`` tokenised by ``tokenizer``: a hidden ``.npz`` beside the data (or
    in ``cache_dir``), named by a hash of the file's bytes and the tokenizer, so an edit of either misses."""
    p = Path(path)
    from memtrain.files import sha256_file

    key = hashlib.sha256((sha256_file(p) + tokenizer_fingerprint(tokenizer)).encode()).hexdigest()[:20]
    return Path(cache_dir or p.parent) / f".{p.name}.{key}.tokens.npz"


def tokenize_file(path: str | os.PathLike[str], tokenizer: Any, *, cache_dir: str | os.PathLike[str] | None = None,
                  batch_size: int = 1000, progress: bool | None = None) -> TokenDocuments:
    """Tokenises a ``.txt`` or ``.jsonl`` file with a fast tokenizer, once: later calls read the cache.

    ``.jsonl``: one object per line, ``{"text": ...}`` or ``{"prompt": ..., "completion": ...}``; other files are
    UTF-8 text whose documents are separated by blank lines. Each document is ``tokenizer(text)`` (its special
    tokens, e.g. a BOS, as the tokenizer adds them) followed by the EOS token, so packed documents are
    delimited. A prompt/completion record is the prompt's ids then the completion's (no special tokens between)
    and the EOS; its loss mask is False on the prompt, so training predicts the completion and the EOS only.
    Texts are tokenised ``batch_size`` at a time (the fast tokenizer's batched, multi-threaded path), with a
    progress bar for files over 4 MiB.

    Returns:
        ``TokenDocuments`` with int32 tokens and, for files with prompts, a ``loss_mask`` (items are then
        ``Document``s).

    Raises:
        ConfigError: a missing or non-UTF-8 file, no documents, or bad ``.jsonl`` lines (all listed, with
            their line numbers), a tokenizer that is not fast.
    """
    p = data_file(path, "a .txt or .jsonl file")
    cache = token_cache_path(p, tokenizer, cache_dir=cache_dir)
    if cache.is_file():
        with np.load(cache, allow_pickle=False) as saved:  # arrays only: nothing is unpickled
            mask = saved["loss_mask"] if saved["has_mask"] else None
            return TokenDocuments(saved["tokens"], saved["starts"], saved["lengths"], mask)
    records = _jsonl_records(p) if p.suffix.lower() == ".jsonl" else _text_documents(p)
    with_prompts = any(prompt for prompt, _ in records)
    eos = tokenizer.eos_token_id
    show = progress if progress is not None else p.stat().st_size > _PROGRESS_BYTES
    from tqdm.auto import tqdm

    pieces: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    for start in tqdm(range(0, len(records), batch_size), desc=f"tokenising {p.name}", unit="batch",
                      disable=not show):
        batch = records[start: start + batch_size]
        if with_prompts:
            prompts = tokenizer([r[0] for r in batch], add_special_tokens=True)["input_ids"]
            texts = tokenizer([r[1] for r in batch], add_special_tokens=False)["input_ids"]
        else:
            prompts, texts = [[] for _ in batch], tokenizer([r[1] for r in batch], add_special_tokens=True)["input_ids"]
        for prompt, text in zip(prompts, texts, strict=True):
            ids = prompt + text + ([eos] if eos is not None and (not text or text[-1] != eos) else [])
            pieces.append(np.asarray(ids, dtype=np.int32))
            if with_prompts:
                mask = np.ones(len(ids), dtype=bool)
                mask[: len(prompt)] = False
                masks.append(mask)
    lengths = np.array([len(x) for x in pieces], dtype=np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    starts = np.cumsum(lengths) - lengths
    keep = lengths >= 2  # a document of one token holds no (input, target) pair
    loss_mask = np.concatenate(masks) if with_prompts else None
    docs = TokenDocuments(tokens, starts[keep], lengths[keep], loss_mask)
    _write_token_cache(cache, docs)
    return docs


def _write_token_cache(cache: Path, docs: TokenDocuments) -> None:
    from memtrain.files import atomic_write

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            np.savez(f, tokens=docs.tokens, starts=docs.starts, lengths=docs.lengths,
                     has_mask=np.array(docs.loss_mask is not None),
                     loss_mask=docs.loss_mask if docs.loss_mask is not None else np.zeros(0, bool))

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, write)
    except OSError as e:  # a read-only data folder: the run goes on, only the next one tokenises again
        warnings.warn(f"could not cache the tokenised data at {cache} ({e}); pass a writable cache_dir to keep "
                      "it.", stacklevel=3)


class PackedRow(NamedTuple):
    """One row of ``PackedRows``: ``seq_len`` positions of one or more documents back to back."""

    input_ids: torch.Tensor  # (seq_len,) int64; pad_id after the last document
    labels: torch.Tensor  # (seq_len,) int64: the token that follows each position; -100 on padding and prompts
    position_ids: torch.Tensor  # (seq_len,) int64: restarts at 0 at each document's start


class PackedRows(Dataset):
    """Documents packed once, best-fit decreasing, into rows of exactly ``seq_len`` positions: fixed-shape
    batches with little padding, at the price of several documents per row.

    Item ``i`` is a ``PackedRow(input_ids, labels, position_ids)`` of ``seq_len`` int64 each: ``labels[t]`` is
    already the target of position ``t`` (shifted: do not shift again), ``-100`` (``ignore_index``) at padding and
    on prompt tokens. ``DataLoader(rows, batch_size=B)`` (the default collate) stacks them to three (B, seq_len)
    tensors; the loss is summed over the labels that are not -100 (``real_tokens``). ``position_ids`` restart at
    every document, which Hugging Face models (transformers >= 4.54 without an attention mask) read as packed
    sequences: attention stays inside each document. Without them a document attends to the ones before it in
    its row. A document with more than ``seq_len`` (input, target) pairs is cut into pieces of ``seq_len``
    pairs, overlapping by one token so no pair is lost; each piece is its own document. Packing is deterministic
    (ties keep the dataset order); shuffle with the loader.

    Example:
        >>> rows = PackedRows(TokenDocuments.from_texts(["abcd", "xyz", "pq"]), seq_len=4)
        >>> len(rows), rows[0].labels.tolist(), rows[0].position_ids.tolist()
        (2, [98, 99, 100, 113], [0, 1, 2, 0])
    """

    def __init__(self, documents: TokenDocuments, seq_len: int, *, pad_id: int = 0, ignore_index: int = -100):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"PackedRows(seq_len={seq_len!r}): seq_len must be an integer >= 1, the model's "
                              "sequence length. To resolve this error, pass e.g. seq_len=256.")
        self.documents, self.seq_len, self.pad_id, self.ignore_index = documents, seq_len, pad_id, ignore_index
        pieces = TokenDocuments.from_spans(documents.tokens, documents.starts, documents.starts + documents.lengths,
                                           max_len=seq_len + 1, loss_mask=documents.loss_mask)
        self.piece_starts, pairs = pieces.starts, pieces.lengths - 1
        # Best-fit decreasing: each piece, longest first, into the fullest row it fits (bisect over free space).
        order = np.argsort(-pairs, kind="stable")
        free: list[tuple[int, int]] = []  # (free positions, row), sorted
        row_of = np.empty(len(pairs), dtype=np.int64)
        rows = 0
        for piece in order:
            n = int(pairs[piece])
            at = bisect.bisect_left(free, (n, -1))
            if at == len(free):
                row, space = rows, seq_len
                rows += 1
            else:
                space, row = free.pop(at)
            row_of[piece] = row
            if space - n > 0:
                bisect.insort(free, (space - n, row))
        # Rows as ranges of a piece list sorted by row (pieces of a row keep their dataset order).
        self.row_pieces = np.argsort(row_of, kind="stable")
        self.row_ptr = np.concatenate([[0], np.cumsum(np.bincount(row_of, minlength=rows))])
        self.piece_pairs = pairs
        self.real_tokens = int(self._target_count(pieces))

    def _target_count(self, pieces: TokenDocuments) -> int:
        if pieces.loss_mask is None:
            return int(self.piece_pairs.sum())
        return sum(int(pieces.loss_mask[s + 1: s + 1 + n].sum()) for s, n in zip(pieces.starts, self.piece_pairs,
                                                                                   strict=True))

    def __len__(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def padding_fraction(self) -> float:
        """The share of all positions that carry no target (padding and prompts)."""
        return 1.0 - self.real_tokens / max(1, len(self) * self.seq_len)

    def __getitem__(self, i: int) -> PackedRow:
        if not 0 <= i < len(self):
            raise IndexError(i)
        n = self.seq_len
        x = torch.full((n,), self.pad_id, dtype=torch.long)
        y = torch.full((n,), self.ignore_index, dtype=torch.long)
        positions = torch.arange(n, dtype=torch.long)
        tokens, mask, at = self.documents.tokens, self.documents.loss_mask, 0
        for piece in self.row_pieces[self.row_ptr[i]: self.row_ptr[i + 1]]:
            start, pairs = int(self.piece_starts[piece]), int(self.piece_pairs[piece])
            ids = torch.from_numpy(tokens[start: start + pairs + 1].astype(np.int64))
            x[at: at + pairs] = ids[:-1]
            targets = ids[1:]
            if mask is not None:
                targets = targets.masked_fill(torch.from_numpy(~mask[start + 1: start + pairs + 1]), self.ignore_index)
            y[at: at + pairs] = targets
            positions[at: at + pairs] = torch.arange(pairs)
            at += pairs
        positions[at:] = torch.arange(n - at)
        return PackedRow(x, y, positions)


def hf_collate(rows: Sequence[PackedRow]) -> dict[str, torch.Tensor]:
    """Stacks ``PackedRow``s into a Hugging Face batch (for ``transformers.Trainer``'s ``data_collator``).

    Returns ``input_ids``, ``position_ids`` and the already shifted targets as ``shift_labels`` (the model then
    shifts nothing: no target is lost at a row's end) and as ``labels`` (the model needs labels to compute a
    loss; with ``shift_labels`` given, Hugging Face's loss and memtrain's chunked loss read only those, and the
    Trainer counts ``shift_labels`` for ``num_items_in_batch``).
    """
    input_ids, labels, positions = (torch.stack(column) for column in zip(*rows, strict=True))
    return {"input_ids": input_ids, "labels": labels, "shift_labels": labels, "position_ids": positions}


def tokenized_rows(path: str | os.PathLike[str], tokenizer: Any, seq_len: int, *, val_fraction: float = 0.05,
                   cache_dir: str | os.PathLike[str] | None = None) -> tuple[PackedRows, PackedRows]:
    """(training, validation) packed rows of a ``.txt``/``.jsonl`` file: ``tokenize_file`` then ``PackedRows``,
    the last ``val_fraction`` of the documents held out (before packing, so no document is in both)."""
    train, val = tokenize_file(path, tokenizer, cache_dir=cache_dir).split(val_fraction)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return PackedRows(train, seq_len, pad_id=pad), PackedRows(val, seq_len, pad_id=pad)


# -- collate: pad to the batch's longest example ---------------------------------------------------------------
class TokenBatch(NamedTuple):
    """A padded batch of next-token examples. ``y`` holds ``ignore_index`` wherever ``x`` is padding.

    ``real_tokens`` is the number of targets that count in the loss: the right divisor for a summed loss.
    """

    x: torch.Tensor  # (batch, time) input tokens, int64
    y: torch.Tensor  # (batch, time) target tokens, int64; ignore_index at padded positions
    real_tokens: int

    @property
    def padding_fraction(self) -> float:
        """The share of the batch's positions that are padding (computed work and memory that carry no loss)."""
        return 1.0 - self.real_tokens / max(1, self.y.numel())


@dataclass(frozen=True)
class PadCollate:
    """Collates documents (1-D token tensors) into a ``TokenBatch`` padded to the batch's longest example.

    Padding goes on the right, so a causal model needs no attention mask: a real position never attends to a
    later (padded) one, and padded targets are ``ignore_index`` (-100: ignored by ``F.cross_entropy``, memtrain's
    GPT and Hugging Face models). A document of ``L`` tokens gives ``L - 1`` (input, target) pairs.

    Args:
        pad_id: the input token at padded positions (never a target).
        ignore_index: the target at padded positions.
        pad_to_multiple_of: rounds the padded length up (e.g. 8 for tensor cores); 1 pads to the longest only.

    Example:
        >>> batch = PadCollate()([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
        >>> batch.x.tolist(), batch.y.tolist(), batch.real_tokens
        ([[1, 2], [4, 0]], [[2, 3], [5, -100]], 3)
    """

    pad_id: int = 0
    ignore_index: int = -100
    pad_to_multiple_of: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.pad_to_multiple_of, bool) or not isinstance(self.pad_to_multiple_of, int) \
                or self.pad_to_multiple_of < 1:
            raise ConfigError(f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be an integer >= 1. To resolve "
                              "this error, pass e.g. 8, or 1 for no rounding.")

    def __call__(self, examples: Sequence[torch.Tensor | np.ndarray | Document]) -> TokenBatch:
        docs, labels = _tokens_and_labels(examples)
        pairs = [len(d) - 1 for d in docs]
        if not docs or min(pairs) < 1:
            raise ConfigError(f"PadCollate got documents of lengths {[len(d) for d in docs]}; each needs >= 2 "
                              "tokens. To resolve this error, build the dataset with min_len=2 (the default).")
        m = self.pad_to_multiple_of
        time = -(-max(pairs) // m) * m
        x = torch.full((len(docs), time), self.pad_id, dtype=torch.long)
        y = torch.full((len(docs), time), self.ignore_index, dtype=torch.long)
        for row, (doc, label, n) in enumerate(zip(docs, labels, pairs, strict=True)):
            x[row, :n] = doc[:-1]
            y[row, :n] = label[1:]
        return TokenBatch(x, y, int((y != self.ignore_index).sum()))


class PackedBatch(NamedTuple):
    """Documents packed back to back into rows of ``seq_len`` positions.

    ``segments`` holds each position's document id within its row (padding at a row's end is its own segment), for
    a model that keeps attention inside each document (memtrain's ``GPT(x, y, segments=...)``); ``positions``
    restarts at each document's start (Hugging Face's ``position_ids``). A model given neither lets a document
    attend to the ones before it in its row: cheaper, but no longer what each document computes alone.
    """

    x: torch.Tensor  # (rows, seq_len) input tokens, int64
    y: torch.Tensor  # (rows, seq_len) targets, int64; ignore_index at padded positions
    real_tokens: int
    segments: torch.Tensor  # (rows, seq_len) document index within the row, int64
    positions: torch.Tensor  # (rows, seq_len) position within the document, int64

    @property
    def padding_fraction(self) -> float:
        """The share of the batch's positions that are padding."""
        return 1.0 - self.real_tokens / max(1, self.y.numel())


@dataclass(frozen=True)
class PackCollate:
    """Collates documents into as few rows of ``seq_len`` positions as first-fit-decreasing packing allows.

    Where ``PadCollate`` pads every document to the batch's longest, packing fills each row with several
    documents, so only the rows' tails are padding. A document of ``L`` tokens gives ``L - 1`` (input, target)
    pairs, none of them across a document boundary. One longer than ``seq_len`` pairs is cut into pieces of
    ``seq_len``; each piece is its own document (it does not attend to the piece before). The number of rows varies
    from batch to batch: normalise a summed loss by ``real_tokens`` (``GradientAccumulator`` does).

    Args:
        seq_len: positions per row (the model's sequence length).
        pad_id, ignore_index: the input token and target at padded positions.

    Example:
        >>> batch = PackCollate(seq_len=4)([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7]), torch.tensor([8, 9])])
        >>> batch.x.tolist(), batch.y.tolist(), batch.segments.tolist(), batch.real_tokens
        ([[4, 5, 6, 8], [1, 2, 0, 0]], [[5, 6, 7, 9], [2, 3, -100, -100]], [[0, 0, 0, 1], [0, 0, 1, 1]], 6)
    """

    seq_len: int
    pad_id: int = 0
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if isinstance(self.seq_len, bool) or not isinstance(self.seq_len, int) or self.seq_len < 1:
            raise ConfigError(f"PackCollate(seq_len={self.seq_len!r}): seq_len must be an integer >= 1, the "
                              "model's sequence length. To resolve this error, pass e.g. seq_len=256.")

    def __call__(self, examples: Sequence[torch.Tensor | np.ndarray | Document]) -> PackedBatch:
        docs, labels = _tokens_and_labels(examples)
        if not docs:
            raise ConfigError("PackCollate got an empty batch. To resolve this error, give the loader a batch "
                              "size or batch sampler that yields at least one document per batch.")
        if min(len(d) for d in docs) < 2:
            raise ConfigError(f"PackCollate got documents of lengths {[len(d) for d in docs]}; each needs >= 2 "
                              "tokens. To resolve this error, build the dataset with min_len=2 (the default).")
        n = self.seq_len
        # (inputs, targets) pieces of at most seq_len pairs, longest first: first-fit decreasing.
        pieces = [(d[:-1][i:i + n], t[1:][i:i + n]) for d, t in zip(docs, labels, strict=True)
                  for i in range(0, len(d) - 1, n)]
        pieces.sort(key=lambda piece: -len(piece[0]))
        rows: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        free: list[int] = []
        for piece in pieces:
            row = next((r for r, space in enumerate(free) if space >= len(piece[0])), None)
            if row is None:
                rows.append([])
                free.append(n)
                row = len(rows) - 1
            rows[row].append(piece)
            free[row] -= len(piece[0])
        x = torch.full((len(rows), n), self.pad_id, dtype=torch.long)
        y = torch.full((len(rows), n), self.ignore_index, dtype=torch.long)
        segments = torch.empty((len(rows), n), dtype=torch.long)
        positions = torch.empty((len(rows), n), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for s, (inputs, targets) in enumerate(row):
                x[r, at:at + len(inputs)] = inputs
                y[r, at:at + len(inputs)] = targets
                segments[r, at:at + len(inputs)] = s
                positions[r, at:at + len(inputs)] = torch.arange(len(inputs))
                at += len(inputs)
            segments[r, at:] = len(row)  # the tail's padding: a segment of its own
            positions[r, at:] = torch.arange(n - at)
        return PackedBatch(x, y, int((y != self.ignore_index).sum()), segments, positions)


def _tokens_and_labels(examples: Sequence[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each example's tokens, and its labels: its own tokens, or a ``Document``'s (ignore_index on prompts)."""
    docs, labels = [], []
    for e in examples:
        if isinstance(e, Document):
            docs.append(torch.as_tensor(e.tokens, dtype=torch.long))
            labels.append(torch.as_tensor(e.labels, dtype=torch.long))
        else:
            docs.append(torch.as_tensor(e, dtype=torch.long))
            labels.append(docs[-1])
    return docs, labels


# -- length bucketing -----------------------------------------------------------------------------------------
def _distributed_rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of similar lengths: much less padding than random batches, at the price of some randomness.

    Each epoch: shuffle the examples (seed, epoch), cut them into mega-batches of ``mega_batch_factor`` global
    batches, sort each mega-batch by length, cut it into global batches, and shuffle the order of those batches.
    The global batch with the most padded tokens comes first, so an out-of-memory error shows at step 1, not hours
    in. With ``world_size`` ranks, a global batch of ``batch_size * world_size`` similar lengths is dealt out so
    each rank gets ``batch_size`` of them: ranks see disjoint examples and step the same number of times, with
    similar shapes at each step (no rank waits for a much longer batch).

    Every example is yielded exactly once per epoch on one rank. With ``world_size > 1`` and a dataset size that
    is not a multiple of ``world_size``, ``drop_last=False`` repeats up to ``world_size - 1`` examples (as
    ``DistributedSampler`` does) so that every rank steps the same number of times; ``drop_last=True`` instead
    drops the examples that do not fill a whole global batch (different ones each epoch).

    Args:
        lengths: each example's length in tokens (e.g. ``TokenDocuments.lengths``).
        batch_size: examples per batch on each rank.
        mega_batch_factor: global batches per sorted mega-batch; larger pads less and shuffles less.
        shuffle: False keeps the dataset order apart from sorting within mega-batches.
        seed: with ``set_epoch``, fixes the order: same seed and epoch, same batches.
        drop_last: drop (rather than pad out) examples that do not fill a whole global batch.
        rank, world_size: this process's share; default from ``torch.distributed`` when it is initialised.

    Example:
        >>> sampler = LengthBucketSampler([5, 1, 4, 2, 3, 6], batch_size=2, seed=0)
        >>> batches = list(sampler)
        >>> sorted(i for b in batches for i in b), batches[0]
        ([0, 1, 2, 3, 4, 5], [5, 0])
    """

    def __init__(self, lengths: Sequence[int] | np.ndarray, batch_size: int, *, mega_batch_factor: int = 50,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None):
        if rank is None or world_size is None:
            default_rank, default_size = _distributed_rank_and_size()
            rank = default_rank if rank is None else rank
            world_size = default_size if world_size is None else world_size
        self.lengths = np.asarray(lengths, dtype=np.int64)
        problems = []
        for name, value, low in (("batch_size", batch_size, 1), ("mega_batch_factor", mega_batch_factor, 1),
                                 ("world_size", world_size, 1), ("rank", rank, 0), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                problems.append(f"{name}={value!r} must be an integer >= {low}. To resolve this error, pass e.g. "
                                f"{name}={max(low, 1)}.")
        if not problems and rank >= world_size:
            problems.append(f"rank={rank} must be below world_size={world_size}. To resolve this error, pass the "
                            "rank and world size of torch.distributed (or leave both None to read them).")
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            problems.append(f"lengths has shape {self.lengths.shape}; it must list one length per example. To "
                            "resolve this error, pass a flat array of len(dataset) lengths.")
        elif not problems and drop_last and len(self.lengths) < batch_size * world_size:
            problems.append(f"{len(self.lengths)} examples fill no global batch of {batch_size} x {world_size} "
                            "ranks with drop_last=True. To resolve this error, lower batch_size or pass "
                            "drop_last=False.")
        ConfigError.raise_if(problems)
        self.batch_size, self.mega_batch_factor, self.shuffle = batch_size, mega_batch_factor, shuffle
        self.seed, self.drop_last, self.rank, self.world_size = seed, drop_last, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch (as with ``DistributedSampler``): a new order, the same on every rank."""
        self.epoch = epoch

    def _epoch_order(self) -> np.ndarray:
        n, group = len(self.lengths), self.batch_size * self.world_size
        rng = np.random.default_rng([self.seed, self.epoch])
        order = rng.permutation(n) if self.shuffle else np.arange(n)
        if self.drop_last:
            return order[: n // group * group]
        return np.concatenate([order, np.resize(order, (-n) % self.world_size)])

    def global_batches(self) -> list[np.ndarray]:
        """This epoch's global batches (all ranks' examples), in order; rank ``r`` takes ``batch[r::world_size]``."""
        order, group = self._epoch_order(), self.batch_size * self.world_size
        mega = self.mega_batch_factor * group  # a multiple of the global batch, so batches never straddle two
        batches = []
        for start in range(0, len(order), mega):
            chunk = order[start: start + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            batches += [chunk[i: i + group] for i in range(0, len(chunk), group)]
        # The costliest batch (rows per rank x longest example) first: an out-of-memory error shows at step 1.
        cost = [-(-len(b) // self.world_size) * int(self.lengths[b].max()) for b in batches]
        first = int(np.argmax(cost))
        rest = batches[:first] + batches[first + 1:]
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, 1])
            rest = [rest[i] for i in rng.permutation(len(rest))]
        return [batches[first], *rest]

    def __iter__(self) -> Iterator[list[int]]:
        # Sorted descending within a global batch, so dealing every world_size-th example gives each rank
        # similar lengths at the same step.
        for batch in self.global_batches():
            yield batch[self.rank:: self.world_size].tolist()

    def __len__(self) -> int:
        return -(-len(self._epoch_order()) // (self.batch_size * self.world_size))


# -- loader settings: checked against the machine, automatic choices with reasons ------------------------------
Auto = Literal["auto"]
MAX_AUTO_WORKERS = 8  # beyond this, workers mostly add memory (a copy of the process each) and start-up time


@dataclass(frozen=True)
class Machine:
    """What the loader's automatic choices depend on. ``Machine.detect()`` reads it; tests pass their own."""

    cpus: int  # CPUs this process may run on (its affinity mask, not the machine's total)
    accelerator: str | None  # "cuda", "xpu", "mps", ... or None
    local_world_size: int = 1  # training processes sharing these CPUs (torchrun's LOCAL_WORLD_SIZE)

    @classmethod
    def detect(cls) -> Machine:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # macOS and Windows have no affinity mask
            cpus = os.cpu_count() or 1
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        if not local.isdigit() or int(local) < 1:
            raise ConfigError(f"LOCAL_WORLD_SIZE={local!r} is not a positive integer. To resolve this error, launch "
                              "with torchrun (which sets it) or unset it.")
        return cls(cpus, accelerator.type if accelerator is not None else None, int(local))


@dataclass(frozen=True)
class LoaderSettings:
    """The resolved DataLoader settings, why each was chosen, and hints about valid but poor choices."""

    num_workers: int
    pin_memory: bool
    prefetch_factor: int | None  # batches each worker keeps ready; None without workers
    persistent_workers: bool
    reasons: tuple[str, ...]
    hints: tuple[str, ...] = ()

    def summary(self) -> str:
        """One line per choice and hint, for a start-up log (returned, not printed)."""
        return "\n".join([*self.reasons, *(f"Hint: {h}" for h in self.hints)])

    def dataloader_kwargs(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                "prefetch_factor": self.prefetch_factor, "persistent_workers": self.persistent_workers}


def _parse_device(device: torch.device | str, problems: list[str]) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        problems.append(f"device={device!r} is not a torch device. To resolve this error, pass e.g. 'cuda', "
                        "'cuda:0' or 'cpu'.")
        return torch.device("cpu")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_loader_settings(*, num_workers: int | Auto = "auto", pin_memory: bool | Auto = "auto",
                            prefetch_factor: int | Auto = "auto", persistent_workers: bool | Auto = "auto",
                            device: torch.device | str | None = None, machine: Machine | None = None) -> LoaderSettings:
    """Resolves the "auto" settings for this machine and checks the explicit ones. Pure given ``machine``.

    Choices:
        num_workers "auto": one worker per CPU of this process (per training process under torchrun) but one,
            kept for the training loop, at most 8; 0 with one CPU.
        pin_memory "auto": True exactly when batches go to an accelerator (``device``, or the machine's
            accelerator when ``device`` is None): pinned memory makes the copy asynchronous; on CPU it is only
            an extra copy.
        prefetch_factor "auto": 2 (torch's default) with workers, None without.
        persistent_workers "auto": True with workers (no worker restart, dataset re-copy, each epoch).

    Raises:
        ConfigError: every contradictory or invalid explicit setting, at once: ``persistent_workers=True`` or a
            ``prefetch_factor`` with ``num_workers=0``, ``pin_memory=True`` when batches stay on the CPU or no
            accelerator exists, negative or non-integer counts. An explicit ``persistent_workers``/
            ``prefetch_factor`` that cannot apply because "auto" chose 0 workers (a 1-CPU machine) is not an
            error, so a script stays portable; it is reported in ``hints``.
    """
    machine = machine or Machine.detect()
    problems: list[str] = []
    reasons: list[str] = []
    hints: list[str] = []

    # num_workers
    per_process = max(1, machine.cpus // machine.local_world_size)
    auto_workers = min(MAX_AUTO_WORKERS, per_process - 1)
    share = (f"{machine.cpus} usable CPUs / {machine.local_world_size} local processes = {per_process} each"
             if machine.local_world_size > 1 else f"{machine.cpus} usable CPUs")
    if num_workers == "auto":
        workers = auto_workers
        reasons.append(f"num_workers={workers}, because: {share}" + (
            "; a worker would compete with the training loop for the only CPU" if workers == 0 else
            ", one kept for the training loop" + (f", capped at {MAX_AUTO_WORKERS}"
                                                   if per_process - 1 > MAX_AUTO_WORKERS else "")))
    elif not _is_int(num_workers) or num_workers < 0:
        problems.append(f"num_workers={num_workers!r} must be 'auto' or an integer >= 0. To resolve this error, "
                        f"pass num_workers='auto' ({auto_workers} here) or a count such as 0 or 2.")
        workers = 0
    else:
        workers = num_workers
        reasons.append(f"num_workers={workers} (as given)")
        if workers > per_process:
            hints.append(f"num_workers={workers} exceeds the {share}: extra workers only take turns and each holds "
                         f"a copy of the process. Try num_workers='auto' ({auto_workers}).")
    explicit_zero = num_workers == 0

    # prefetch_factor
    if prefetch_factor == "auto":
        prefetch = 2 if workers else None
        if workers:
            reasons.append("prefetch_factor=2, because: each worker keeps two batches ready (torch's default)")
    elif not _is_int(prefetch_factor) or prefetch_factor < 1:
        problems.append(f"prefetch_factor={prefetch_factor!r} must be 'auto' or an integer >= 1. To resolve this "
                        "error, pass prefetch_factor='auto' (2 with workers).")
        prefetch = None
    elif workers == 0 and explicit_zero:
        problems.append(f"prefetch_factor={prefetch_factor} needs worker processes, but num_workers=0 loads in the "
                        "training process. To resolve this error, pass num_workers >= 1, or drop prefetch_factor.")
        prefetch = None
    elif workers == 0:
        hints.append(f"prefetch_factor={prefetch_factor} does not apply: num_workers='auto' chose 0 workers.")
        prefetch = None
    else:
        prefetch = prefetch_factor
        reasons.append(f"prefetch_factor={prefetch} (as given)")

    # persistent_workers
    if persistent_workers == "auto":
        persistent = workers > 0
        if persistent:
            reasons.append("persistent_workers=True, because: workers then survive the epoch instead of "
                           "restarting (and re-copying the dataset)")
    elif not isinstance(persistent_workers, bool):
        problems.append(f"persistent_workers={persistent_workers!r} must be 'auto', True or False. To resolve "
                        "this error, pass persistent_workers='auto'.")
        persistent = False
    elif persistent_workers and workers == 0 and explicit_zero:
        problems.append("persistent_workers=True needs worker processes, but num_workers=0 loads in the training "
                        "process. To resolve this error, pass num_workers >= 1, or persistent_workers=False.")
        persistent = False
    elif persistent_workers and workers == 0:
        hints.append("persistent_workers=True does not apply: num_workers='auto' chose 0 workers.")
        persistent = False
    else:
        persistent = persistent_workers

    # pin_memory: it only helps a host -> accelerator copy.
    target = _parse_device(device, problems) if device is not None else None
    if target is not None and target.type not in ("cpu", "meta") and target.type != machine.accelerator:
        problems.append(f"device={str(target)!r}, but this machine's accelerator is {machine.accelerator}. To "
                        "resolve this error, pass a device that exists here, e.g. 'cpu'.")
    to_accelerator = machine.accelerator is not None and (target is None or target.type == machine.accelerator)
    where = (f"batches go to {target}" if target is not None else
             f"a {machine.accelerator} accelerator is present" if machine.accelerator else "no accelerator is present")
    if pin_memory == "auto":
        pin = to_accelerator
        reasons.append(f"pin_memory={pin}, because: {where}" + (
            " (pinned memory makes the host->device copy asynchronous)" if pin else
            " (pinning would only add a copy per batch)"))
    elif not isinstance(pin_memory, bool):
        problems.append(f"pin_memory={pin_memory!r} must be 'auto', True or False. To resolve this error, pass "
                        "pin_memory='auto'.")
        pin = False
    elif pin_memory and not to_accelerator:
        problems.append(f"pin_memory=True, but {where}: pinned memory only speeds host->accelerator copies, and "
                        "pinning costs a copy per batch. To resolve this error, pass pin_memory='auto' (pins "
                        "exactly when batches go to an accelerator) or pin_memory=False.")
        pin = False
    else:
        pin = pin_memory
        reasons.append(f"pin_memory={pin} (as given)")
        if not pin and to_accelerator:
            hints.append("pin_memory=False with an accelerator: each host->device copy blocks the CPU, so "
                         "DevicePrefetcher cannot overlap it with compute. Try pin_memory='auto'.")

    ConfigError.raise_if(problems)
    return LoaderSettings(workers, pin, prefetch, persistent, tuple(reasons), tuple(hints))


def make_loader(dataset: Dataset, *, batch_size: int | None = None, num_workers: int | Auto = "auto",
                pin_memory: bool | Auto = "auto", prefetch_factor: int | Auto = "auto",
                persistent_workers: bool | Auto = "auto", shuffle: bool = False, drop_last: bool = False,
                sampler: Sampler | None = None, batch_sampler: Sampler[list[int]] | None = None,
                collate_fn: Callable[[list[Any]], Any] | None = None, seed: int | None = None,
                device: torch.device | str | None = None, machine: Machine | None = None) -> DataLoader:
    """A ``torch.utils.data.DataLoader`` whose worker, pinning and prefetch settings suit this machine.

    Workers overlap loading with training at the cost of one process (and its memory) each; pinned memory makes
    the host->device copy asynchronous at the cost of page-locked host memory. The settings, with the reason for
    each automatic choice, are on ``loader.memtrain_settings`` (a ``LoaderSettings``; print its ``summary()``).
    See ``resolve_loader_settings`` for the choices and the errors.

    Args:
        dataset: a map-style or iterable dataset.
        batch_size: examples per batch; leave None when passing ``batch_sampler``.
        num_workers, pin_memory, prefetch_factor, persistent_workers: "auto" or an explicit value.
        shuffle, drop_last, sampler, batch_sampler, collate_fn: as for ``DataLoader``.
        seed: seeds the shuffle and the workers' base seed, so a run repeats exactly; the shuffle order depends
            on the seed only, not on the worker settings (so not on the machine).
        device: where the batches go (decides pinning); None means the machine's accelerator, if any.
        machine: the CPUs and accelerator to plan for (default ``Machine.detect()``).

    Raises:
        ConfigError: every bad or contradictory setting, at once, each with its fix.

    Example:
        >>> loader = make_loader(list(range(10)), batch_size=4, num_workers=0, machine=Machine(2, None))
        >>> [b.tolist() for b in loader], loader.memtrain_settings.pin_memory
        ([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], False)
    """
    problems: list[str] = []
    iterable = isinstance(dataset, IterableDataset)
    if batch_sampler is not None:
        given = [name for name, value in (("batch_size", batch_size), ("shuffle", shuffle),
                                          ("drop_last", drop_last), ("sampler", sampler)) if value]
        if given:
            problems.append(f"batch_sampler decides the batches, so {', '.join(given)} cannot apply. To resolve "
                            "this error, drop them (set them on the batch sampler instead).")
    elif batch_size is None:
        problems.append("no batch_size. To resolve this error, pass batch_size=N or a batch_sampler.")
    elif not _is_int(batch_size) or batch_size < 1:
        problems.append(f"batch_size={batch_size!r} must be an integer >= 1. To resolve this error, pass e.g. "
                            "batch_size=8.")
    elif hasattr(dataset, "__len__") and sampler is None and drop_last and len(dataset) < batch_size:
        problems.append(f"the dataset holds {len(dataset)} examples, fewer than one batch of {batch_size} with "
                        "drop_last=True. To resolve this error, lower batch_size or pass drop_last=False.")
    if sampler is not None and shuffle:
        problems.append("shuffle=True with a sampler: the sampler decides the order. To resolve this error, pass "
                        "shuffle=False (shuffle in the sampler).")
    if iterable and (shuffle or sampler is not None or batch_sampler is not None):
        problems.append("an IterableDataset decides its own order, so shuffle, sampler and batch_sampler cannot "
                        "apply. To resolve this error, drop them, or use a map-style Dataset.")
    if seed is not None and (not _is_int(seed) or seed < 0):
        problems.append(f"seed={seed!r} must be an integer >= 0, or None. To resolve this error, pass e.g. "
                            "seed=0.")
    try:
        settings = resolve_loader_settings(num_workers=num_workers, pin_memory=pin_memory,
                                           prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                                           device=device, machine=machine)
    except ConfigError as e:
        problems += e.problems
    ConfigError.raise_if(problems)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    if shuffle and seed is not None:
        # NOTE: a shuffle drawing from the DataLoader's generator would also share it with the workers' base
        # seed, drawn once per new iterator: the order of epoch 2 on would then depend on num_workers and
        # persistent_workers (and so on the machine, through "auto"). Its own generator keeps one order per seed.
        sampler, shuffle = RandomSampler(dataset, generator=torch.Generator().manual_seed(seed)), False
    loader = DataLoader(dataset, batch_size=batch_size if batch_sampler is None else 1, shuffle=shuffle,
                        sampler=sampler, batch_sampler=batch_sampler, drop_last=drop_last, collate_fn=collate_fn,
                        generator=generator, **settings.dataloader_kwargs())
    loader.memtrain_settings = settings
    return loader


# -- device prefetch: the host->device copy of batch n+1 runs during the compute of batch n ------------------
def map_tensors(fn: Callable[[torch.Tensor], Any], batch: Any) -> Any:
    """Applies ``fn`` to every tensor in ``batch`` (nested tuples, named tuples, lists, mappings, dataclasses)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple such as TokenBatch
        return type(batch)(*(map_tensors(fn, v) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(fn, v) for v in batch)
    if isinstance(batch, MutableMapping):
        mapped = copy.copy(batch)  # keeps the mapping's own type (e.g. a Hugging Face BatchEncoding)
        mapped.update({k: map_tensors(fn, v) for k, v in batch.items()})
        return mapped
    if isinstance(batch, Mapping):
        return {k: map_tensors(fn, v) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: map_tensors(fn, getattr(batch, f.name))
                                             for f in dataclasses.fields(batch) if f.init})
    return batch


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    map_tensors(lambda t: t.record_stream(stream), batch)


class DevicePrefetcher:
    """Iterates ``loader`` with every batch already on ``device``: hides the copy behind compute, at the price of
    one more batch resident on the device.

    On CUDA, batch n+1 is copied on a side stream while the caller computes on batch n; the copy is asynchronous
    only from pinned memory (``make_loader`` pins when batches go to an accelerator). The compute stream waits
    for the copy before using a batch (``wait_stream``), and each batch's memory is marked as used on the compute
    stream (``record_stream``) so the allocator does not hand it to a later copy while compute still reads it. On
    the CPU it is a plain pass-through; on other devices it copies synchronously. The batches and their order
    are the loader's. Tensors nested in tuples, named tuples, lists, mappings and dataclasses are moved; other
    values pass through.

    Example:
        >>> prefetcher = DevicePrefetcher(make_loader(list(range(4)), batch_size=2, num_workers=0,
        ...                               machine=Machine(1, None)), "cpu")
        >>> [b.tolist() for b in prefetcher]
        [[0, 1], [2, 3]]
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str):
        self.loader = loader
        problems: list[str] = []
        self.device = _parse_device(device, problems)
        ConfigError.raise_if(problems)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.device.type == "cpu":
            yield from self.loader
        elif self.stream is None:
            for batch in self.loader:
                yield map_tensors(lambda t: t.to(self.device), batch)
        else:
            yield from self._cuda_batches()

    def _copy_next(self, batches: Iterator[Any]) -> tuple[bool, Any]:
        try:
            host = next(batches)
        except StopIteration:
            return False, None
        with torch.cuda.stream(self.stream):
            # non_blocking only from pinned memory: from pageable memory it would copy synchronously anyway.
            return True, map_tensors(lambda t: t.to(self.device, non_blocking=t.is_pinned()), host)

    def _cuda_batches(self) -> Iterator[Any]:
        batches = iter(self.loader)
        ready, upcoming = self._copy_next(batches)
        while ready:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)  # compute must not read the batch before its copy has landed
            batch = upcoming
            # Allocated on the side stream, used on the compute stream: without this the allocator could reuse
            # the memory for the next copy as soon as the caller drops the batch, while kernels still read it.
            _record_stream(batch, compute)
            ready, upcoming = self._copy_next(batches)  # queued now, so it runs during this batch's compute
            yield batch
