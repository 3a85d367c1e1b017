"""The CUDA caching allocator's segments: how many bytes it reserves from the driver for a sequence of allocations.

What runs out on a GPU is reserved memory: the allocator takes segments from the driver (2 MiB for requests up to
1 MiB; 20 MiB for requests under 10 MiB; the request rounded up to 2 MiB above), carves blocks out of them (best
fit, a block split where the rest is worth keeping), merges a freed block with its free neighbours, and gives a
segment back only when an allocation fails (``release``). A freed block is reused only by a request it holds, so
freed memory of one size may not serve another: fragmentation. With ``expandable_segments:True`` each pool is one
segment that maps pages (2 MiB small, 20 MiB large) at its end as it grows, so a request that fits no free block
extends the free tail instead of taking a segment of its own.

``SegmentModel`` replays allocations and frees with those rules (c10/cuda/CUDACachingAllocator.cpp's constants:
``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``, ``kLargeBuffer``, ``kMinLargeAlloc``, ``kRoundLarge``), one
stream, no ``max_split_size_mb`` or power-of-two rounding: the simulated device's reserved bytes, and the
estimator's prediction of them.

Example:
    >>> m = SegmentModel(expandable=False)
    >>> m.malloc(1, 100); m.reserved  # a small request: a 2 MiB segment
    2097152
    >>> m.malloc(2, 5 << 20); m.reserved  # under 10 MiB: a 20 MiB segment
    23068672
    >>> m.free(2); m.malloc(3, 12 << 20); m.reserved  # 12 MiB fits the free 20 MiB block: no new segment
    23068672
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to it
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this size come from the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small pool's segment (an expandable one's page)
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large pool's segment for requests under MIN_LARGE_ALLOC (and a page)
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests' segments are rounded up to it


def round_size(nbytes: int) -> int:
    """A request's block size: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment the allocator takes from the driver for a block of ``size`` that fits no free block."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    segment: _Segment
    start: int
    size: int
    key: int | None = None  # the allocation it holds; None: free
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(eq=False)
class _Segment:
    pool: _Pool
    base: int  # its address: segments never overlap
    size: int  # mapped bytes (an expandable segment's grow)
    first: _Block | None = None


@dataclass
class _Pool:
    small: bool
    segments: list[_Segment] = field(default_factory=list)
    free: list[tuple[int, int, int]] = field(default_factory=list)  # (size, address, id) sorted: best fit first
    blocks: dict[int, _Block] = field(default_factory=dict)  # id(block) -> block, for the free list's entries

    def should_split(self, block: _Block, size: int) -> bool:
        rest = block.size - size
        return rest >= MIN_BLOCK if self.small else rest > SMALL_SIZE


class SegmentModel:
    """The bytes a CUDA caching allocator reserves for a sequence of ``malloc(key, nbytes)`` and ``free(key)``."""

    def __init__(self, *, expandable: bool):
        self.expandable = expandable
        self.pools = (_Pool(small=True), _Pool(small=False))
        self.live: dict[int, _Block] = {}
        self.reserved = self.peak_reserved = 0
        self._segments = 0

    def malloc(self, key: int, nbytes: int) -> None:
        """An allocation of ``nbytes`` identified by ``key`` (freed with ``free(key)``)."""
        size = round_size(nbytes)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
        self._unlist(pool, block)
        if pool.should_split(block, size):
            rest = _Block(block.segment, block.start + size, block.size - size, None, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._list(pool, rest)
        block.key = key
        self.live[key] = block

    def free(self, key: int) -> None:
        """Frees ``key``'s block, merging it with its free neighbours (an unknown key: nothing)."""
        block = self.live.pop(key, None)
        if block is None:
            return
        pool = block.segment.pool
        block.key = None
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.key is None and id(neighbour) in pool.blocks:
                self._unlist(pool, neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._list(pool, block)

    def growth(self, nbytes: int) -> int:
        """The bytes ``malloc`` of ``nbytes`` would take from the driver now (0: a free block holds it)."""
        size = round_size(nbytes)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        if self._best_fit(pool, size) is not None:
            return 0
        if not self.expandable:
            return segment_size(size)
        last = pool.segments[0].first if pool.segments else None
        while last is not None and last.next is not None:
            last = last.next
        tail = last.size if last is not None and last.key is None else 0
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        return -(-(size - tail) // page) * page

    def release(self) -> None:
        """What a failed allocation does before it retries: every segment with no allocation goes back to the
        driver (an expandable segment unmaps its free tail)."""
        for pool in self.pools:
            for segment in list(pool.segments):
                if self.expandable:
                    last = segment.first
                    while last is not None and last.next is not None:
                        last = last.next
                    if last is not None and last.key is None:
                        self._unlist(pool, last)
                        self.reserved -= last.size
                        segment.size -= last.size
                        if last.prev is not None:
                            last.prev.next = None
                        else:
                            segment.first = None
                elif segment.first is not None and segment.first.key is None and segment.first.next is None:
                    self._unlist(pool, segment.first)
                    pool.segments.remove(segment)
                    self.reserved -= segment.size

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        return pool.blocks[pool.free[i][2]] if i < len(pool.free) else None

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A block of at least ``size`` from the driver: a new segment, or an expandable segment's end mapped."""
        if not self.expandable:
            segment = self._segment(pool, segment_size(size))
            segment.first = _Block(segment, 0, segment.size)
            pool.segments.append(segment)
            self._map(segment.size)
            self._list(pool, segment.first)
            return segment.first
        if not pool.segments:
            pool.segments.append(self._segment(pool, 0))
        segment = pool.segments[0]
        last = segment.first
        while last is not None and last.next is not None:
            last = last.next
        tail = last if last is not None and last.key is None else None
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        more = -(-(size - (tail.size if tail else 0)) // page) * page
        segment.size += more
        self._map(more)
        if tail is not None:
            self._unlist(pool, tail)
            tail.size += more
        else:
            tail = _Block(segment, segment.size - more, more, None, last, None)
            if last is not None:
                last.next = tail
            else:
                segment.first = tail
        self._list(pool, tail)
        return tail

    def _segment(self, pool: _Pool, size: int) -> _Segment:
        self._segments += 1
        return _Segment(pool, self._segments << 48, size)

    def _map(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    @staticmethod
    def _list(pool: _Pool, block: _Block) -> None:
        # Best fit as the allocator's free set orders blocks: by size, then by address.
        pool.blocks[id(block)] = block
        bisect.insort(pool.free, (block.size, block.segment.base + block.start, id(block)))

    @staticmethod
    def _unlist(pool: _Pool, block: _Block) -> None:
        if pool.blocks.pop(id(block), None) is None:
            return
        i = bisect.bisect_left(pool.free, (block.size, block.segment.base + block.start, id(block)))
        del pool.free[i]
