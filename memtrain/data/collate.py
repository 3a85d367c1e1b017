"""Collation: documents into a batch, padded to the batch's longest example (``PadCollate``) or packed into
rows of ``seq_len`` positions (``PackCollate``), each batch with the count of targets that carry a loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from memtrain.data.documents import Document
from memtrain.errors import ConfigError
from memtrain.message import arg


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
            raise ConfigError(f"PackCollate(seq_len={self.seq_len!r}): {arg('seq_len')} must be an integer >= 1, the "
                              f"model's sequence length. To resolve this error, pass e.g. {arg('seq_len', 256)}.")

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
