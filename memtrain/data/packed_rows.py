"""Packed rows: documents packed once (best-fit decreasing) into rows of exactly ``seq_len`` positions with
shifted labels and per-document positions, the Hugging Face batch they stack to, and a file's rows in one call.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from memtrain.data.documents import TokenDocuments
from memtrain.data.token_cache import tokenize_file
from memtrain.errors import ConfigError
from memtrain.message import arg


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
    pairs, overlapping by one token so no pair is lost; each piece is its own document; a piece with no target (of
    a prompt longer than ``seq_len``) would add nothing but a window of zero items, so it is skipped and counted
    in ``skipped_pieces``. Packing is deterministic (ties keep the dataset order); shuffle with the loader.

    Example:
        >>> rows = PackedRows(TokenDocuments.from_texts(["abcd", "xyz", "pq"]), seq_len=4)
        >>> len(rows), rows[0].labels.tolist(), rows[0].position_ids.tolist()
        (2, [98, 99, 100, 113], [0, 1, 2, 0])
    """

    def __init__(self, documents: TokenDocuments, seq_len: int, *, pad_id: int = 0, ignore_index: int = -100):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"PackedRows(seq_len={seq_len!r}): {arg('seq_len')} must be an integer >= 1, the model's "
                              f"sequence length. To resolve this error, pass e.g. {arg('seq_len', 256)}.")
        self.documents, self.seq_len, self.pad_id, self.ignore_index = documents, seq_len, pad_id, ignore_index
        pieces = TokenDocuments.from_spans(documents.tokens, documents.starts, documents.starts + documents.lengths,
                                           max_len=seq_len + 1, loss_mask=documents.loss_mask)
        self.piece_starts, pairs = pieces.starts, pieces.lengths - 1
        self.skipped_pieces = 0  # pieces of prompts longer than seq_len: no target in them, so no loss
        if documents.loss_mask is not None:
            targets = np.array([int(documents.loss_mask[s + 1: s + 1 + n].sum())
                                for s, n in zip(self.piece_starts, pairs, strict=True)], dtype=np.int64)
            keep = targets > 0
            self.skipped_pieces = int((~keep).sum())
            if not keep.any():
                raise ConfigError(f"every one of the {len(keep)} pieces of at most {arg('seq_len', seq_len)} tokens "
                                  f"holds only prompt tokens (the prompts are longer than {arg('seq_len')}): there is "
                                  "no completion token to learn. To resolve this error, pass a longer "
                                  f"{arg('seq_len')} (up to the model's positions), or shorten the prompts.")
            self.piece_starts, pairs = self.piece_starts[keep], pairs[keep]
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
        self.real_tokens = int(targets[keep].sum()) if documents.loss_mask is not None else int(pairs.sum())

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
                   cache_dir: str | os.PathLike[str] | None = None,
                   progress: bool | None = None) -> tuple[PackedRows, PackedRows]:
    """(training, validation) packed rows of a ``.txt``/``.jsonl`` file: ``tokenize_file`` (``progress``: its
    bar; None: for files over 4 MiB) then ``PackedRows``, the last ``val_fraction`` of the documents held out
    (before packing, so no document is in both)."""
    documents = tokenize_file(path, tokenizer, cache_dir=cache_dir, progress=progress, hold_out=val_fraction)
    train, val = documents.split(val_fraction)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return PackedRows(train, seq_len, pad_id=pad), PackedRows(val, seq_len, pad_id=pad)


def file_rows(path: str | os.PathLike[str], tokenizer: Any, seq_len: int, *,
              cache_dir: str | os.PathLike[str] | None = None, progress: bool | None = None) -> PackedRows:
    """Every document of a ``.txt``/``.jsonl`` file packed into rows, none held out: a held-out file of its own
    (``memtrain train --eval-data``), or the training file when that one evaluates; read as ``tokenized_rows``
    reads the training file."""
    documents = tokenize_file(path, tokenizer, cache_dir=cache_dir, progress=progress)
    return PackedRows(documents, seq_len, pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
