"""Tokenised text: a ``.txt``/``.jsonl`` file tokenised once by a model's own (fast) tokenizer, cached beside the
data in a ``.npz`` named by a hash of the file and the tokenizer, so an edit of either misses.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memtrain.data.corpus import data_file, is_jsonl
from memtrain.data.documents import TokenDocuments, held_out_cut, jsonl_records, text_documents
from memtrain.errors import ConfigError
from memtrain.files import atomic_write, free_bytes, sha256_file
from memtrain.message import Message, words
from memtrain.report import format_bytes

TOKEN_CACHE_VERSION = 1  # bump when the tokenisation below changes: old caches then miss instead of lying
_PROGRESS_BYTES = 4 * 2**20  # files above this show a progress bar while tokenising


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
    key = hashlib.sha256((sha256_file(p) + tokenizer_fingerprint(tokenizer)).encode()).hexdigest()[:20]
    return Path(cache_dir or p.parent) / f".{p.name}.{key}.tokens.npz"


def tokenize_file(path: str | os.PathLike[str], tokenizer: Any, *, cache_dir: str | os.PathLike[str] | None = None,
                  batch_size: int = 1000, progress: bool | None = None,
                  hold_out: float | None = None) -> TokenDocuments:
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

    Args:
        hold_out: the share of the documents the caller will hold out (``TokenDocuments.split``): checked against
            the file's document count before tokenising, which takes minutes for a large file.

    Raises:
        ConfigError: a missing or non-UTF-8 file, no documents, or bad ``.jsonl`` lines (all listed, with
            their line numbers), a tokenizer that is not fast, too few documents to hold ``hold_out`` of them out.
    """
    p = data_file(path, "a .txt or .jsonl file")
    cache = token_cache_path(p, tokenizer, cache_dir=cache_dir)
    if cache.is_file():
        try:
            return _read_token_cache(cache)
        except _CACHE_DAMAGE as e:  # truncated, overwritten, or not memtrain's: tokenised again and rewritten
            warnings.warn(Message(f"the token cache {cache} is damaged ({type(e).__name__}: {str(e)[:120]}): "
                                  f"tokenising {p.name} again and rewriting it"), stacklevel=2)
    records = jsonl_records(p) if is_jsonl(p) else text_documents(p)
    if hold_out is not None:
        held_out_cut(len(records), hold_out)
    with_prompts = any(prompt for prompt, _ in records)
    eos = tokenizer.eos_token_id
    show = progress if progress is not None else p.stat().st_size > _PROGRESS_BYTES
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


# The advice to cache elsewhere, in the command's terms: it has no cache_dir, the cache is written beside the data.
_WRITABLE_FOLDER = "or copy the data to a writable folder (the cache is written beside it)"
# What reading a damaged cache raises: a bad zip or header, a missing array, arrays that disagree (ConfigError).
_CACHE_DAMAGE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)


def _read_token_cache(cache: Path) -> TokenDocuments:
    with np.load(cache, allow_pickle=False) as saved:  # arrays only: nothing is unpickled
        mask = saved["loss_mask"] if saved["has_mask"] else None
        return TokenDocuments(saved["tokens"], saved["starts"], saved["lengths"], mask)


def _write_token_cache(cache: Path, docs: TokenDocuments) -> None:
    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            np.savez(f, tokens=docs.tokens, starts=docs.starts, lengths=docs.lengths,
                     has_mask=np.array(docs.loss_mask is not None),
                     loss_mask=docs.loss_mask if docs.loss_mask is not None else np.zeros(0, bool))

    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(cache, write)
    except OSError as e:  # a read-only data folder, a full disk: the run goes on, only the next one tokenises again
        needed = docs.tokens.nbytes + docs.starts.nbytes + docs.lengths.nbytes + (
            docs.loss_mask.nbytes if docs.loss_mask is not None else 0)
        free = free_bytes(cache.parent)
        room = f"; it needs about {format_bytes(needed)}, {format_bytes(free)} free there" if free is not None else ""
        warnings.warn(Message(f"could not cache the tokenised data at {cache} ({e.strerror or e}{room}); the run goes "
                              "on, and the next one tokenises again. To keep the cache, free space there "
                              f"{words('or pass a writable cache_dir', _WRITABLE_FOLDER)}."), stacklevel=3)
