"""The pinned host pool of activation offload: fixed-size slabs allocated once under a host-RAM budget, carved by
a bump pointer that works like a stack (forward takes blocks in order, backward frees them in reverse)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memtrain.offload.transport import Segments, Transport

SLAB_BYTES_DEFAULT = 2**27  # 128 MiB: few pinned allocations, little waste at the end of the last slab
_ALIGN = 512  # block starts aligned for efficient DMA


@dataclass(frozen=True)
class Extent:
    start: int
    nbytes: int


class HostPool:
    """Host memory for offloaded tensors: fixed-size slabs allocated once, carved by a bump pointer.

    Forward takes blocks in order and backward frees them in reverse, so the pointer works like a stack: it
    falls back as the top blocks are freed, and every step reuses the slabs of the first one. A block may span
    two slabs (it is copied in pieces), so no slab space is wasted on sizes that do not fit.
    """

    def __init__(self, transport: Transport, *, budget_bytes: int, slab_bytes: int):
        self.transport = transport
        self.slab_bytes = slab_bytes
        self.capacity_bytes = budget_bytes // slab_bytes * slab_bytes
        self.slabs: list[torch.Tensor] = []
        self._live: dict[int, int] = {}  # start -> end
        self._top = 0
        self.peak_used_bytes = 0
        self.pin_error: str | None = None  # why the last slab could not be allocated; the capacity stopped there

    @property
    def reserved_bytes(self) -> int:
        return len(self.slabs) * self.slab_bytes

    @property
    def used_bytes(self) -> int:
        return sum(end - start for start, end in self._live.items())

    def alloc(self, nbytes: int) -> Extent | None:
        """A block of ``nbytes``, or None when the budget has no room left for it."""
        start = self._top
        end = start + -(-nbytes // _ALIGN) * _ALIGN
        if end > self.capacity_bytes:
            return None
        while self.reserved_bytes < end:
            try:
                self.slabs.append(self.transport.allocate_host(self.slab_bytes))
            except RuntimeError as e:
                # Host memory ran out after the up-front check (other processes pin and allocate too): what is
                # pinned is all there will be, rather than a failed step or a retry at every tensor.
                self.pin_error = str(e).splitlines()[0] if str(e) else type(e).__name__
                self.capacity_bytes = self.reserved_bytes
                return None
        self._live[start] = end
        self._top = end
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        return Extent(start, nbytes)

    def free(self, extent: Extent) -> None:
        # NOTE: no wait for the copies reading or writing this block: they are all on the transport's one side
        # stream, so a later copy into the block runs after them.
        end = self._live.pop(extent.start)
        if end == self._top:
            self._top = max(self._live.values(), default=0)

    def segments(self, extent: Extent) -> Segments:
        """(offset in the tensor's bytes, host view) pieces of ``extent``, split at slab boundaries."""
        pieces = []
        done = 0
        while done < extent.nbytes:
            slab, at = divmod(extent.start + done, self.slab_bytes)
            n = min(extent.nbytes - done, self.slab_bytes - at)
            pieces.append((done, self.slabs[slab][at:at + n]))
            done += n
        return pieces
