"""What autograd holds for an offloaded tensor (a ``Record`` per storage, a ``Handle`` per saved tensor), the
offloader's counters (``OffloadStats``), and which saved tensors stay on the device: casts and views of parameters
(``derived_from_leaf``) and everything from the model's output head on (``find_output_head``)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memtrain.offload.host_pool import Extent


class Record:
    """One storage offloaded: its host block, and while they exist its device copies."""

    __slots__ = ("epoch", "index", "nbytes", "extent", "src", "d2h_event", "data", "h2d_event", "handles",
                 "unpacked", "passes", "done", "released")

    def __init__(self, epoch: int, index: int, nbytes: int, extent: Extent):
        self.epoch, self.index, self.nbytes, self.extent = epoch, index, nbytes, extent
        self.src: torch.Tensor | None = None  # the device storage, held until its copy to the host is done
        self.d2h_event: Any = None
        self.data: torch.Tensor | None = None  # the restored device bytes (prefetched or fetched)
        self.h2d_event: Any = None  # the copy's event, until the compute stream waited for it
        self.handles = 0  # live Handles: the saved tensors (views, duplicates) backed by this record
        self.unpacked = 0  # live handles unpacked in the current backward pass
        self.passes = 0  # backward passes that used every handle (more than one with retain_graph)
        self.done = False  # every handle unpacked once in this backward: no prefetch wanted until the next one
        self.released = False


class Handle:
    """What autograd stores instead of a saved tensor: the record plus the tensor's view of the storage."""

    __slots__ = ("record", "dtype", "size", "stride", "offset", "unpacked_pass", "_dead")

    def __init__(self, record: Record, t: torch.Tensor, dead: collections.deque[tuple[Record, int]]):
        self.record = record
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.unpacked_pass = -1  # the record's pass in which this handle was last unpacked
        self._dead = dead

    def __del__(self) -> None:
        # Autograd drops the handle when its node has run (or the graph is freed), from whatever thread: queue
        # it, and let the next pack or unpack update the record under the lock.
        self._dead.append((self.record, self.unpacked_pass))


@dataclass(frozen=True)
class OffloadStats:
    """Counters since the offloader was built. Bytes are the host copies (each storage once)."""

    offloaded_tensors: int  # saved tensors handed to the host (views and duplicates of one storage included)
    offloaded_bytes: int  # bytes copied device -> host
    deduplicated: int  # saved tensors whose storage was already on its way to the host
    kept: tuple[tuple[str, int], ...]  # (reason, count) for saved tensors left where they were
    over_budget_bytes: int  # bytes kept on the device because the host budget was full or could not be pinned
    prefetched: int  # host -> device copies started ahead of use
    fetched_on_demand: int  # host -> device copies started when backward already needed the tensor
    served_from_device: int  # records used in backward while their device copy still existed (no copy back)
    learned_order_used: int  # backward passes prefetching in the order recorded in an earlier step
    host_reserved_bytes: int
    host_used_bytes: int
    host_peak_used_bytes: int


_VIEW_OR_CAST = frozenset({
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
    "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "AliasBackward0",
})


def derived_from_leaf(t: torch.Tensor) -> bool:
    """True for casts and views of a leaf that requires grad (autocast's bf16 copy of a weight, ``w.t()``)."""
    fn = t.grad_fn
    for _ in range(4):
        if fn is None:
            return False
        if fn.name() == "torch::autograd::AccumulateGrad":
            return True
        if fn.name() not in _VIEW_OR_CAST:
            return False
        parents = [f for f, _ in fn.next_functions if f is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
    return False


def find_output_head(model: nn.Module) -> nn.Module | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module):
        return head
    for name in ("lm_head", "head", "output"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module) and next(head.parameters(), None) is not None:
            return head
    return None
