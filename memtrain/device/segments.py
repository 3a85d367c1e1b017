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

Two figures come out of a replay. ``peak_reserved`` is what a device with room to spare holds
(``torch.cuda.max_memory_reserved`` there): the allocator never gives a segment back until an allocation fails.
``least_capacity()`` is the least device memory the replay runs in, the figure a budget must hold: the recorded
allocations replayed on devices of bisected capacity whose failed allocations release and retry, as the simulated
device's do (``tests/test_segments.py`` bisects that device the same way). ``peak_needed``, kept as the replay goes
(at each growth, what a release would keep plus what the request takes then), is where the bisection starts: on a
training step it is within a page or two of the least capacity, but a sequence can fragment a released device so
that it needs more.

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
GRAIN = 2 << 20  # every segment and page is a multiple of it, so is what is reserved
_FREE, _RELEASE = -1, -2  # a recorded event's size for a free and for a release


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
    mapped: bool = True  # False: an expandable segment's pages a release unmapped (a hole a request may map again)


@dataclass(eq=False)
class _Segment:
    pool: _Pool
    base: int  # its address: segments never overlap
    size: int  # its bytes (an expandable segment's: the address range its blocks span, holes too)
    first: _Block | None = None
    # Hints that spare walking the blocks: a block at or before the last one (``_last``), and False where no hole
    # can be among them (set where a release makes one, cleared where a walk finds none).
    last: _Block | None = None
    holes: bool = False


@dataclass
class _Pool:
    small: bool
    expandable: bool = False
    segments: list[_Segment] = field(default_factory=list)
    free: list[tuple[int, int, int]] = field(default_factory=list)  # (size, address, id) sorted: best fit first
    blocks: dict[int, _Block] = field(default_factory=dict)  # id(block) -> block, for the free list's entries

    def should_split(self, block: _Block, size: int) -> bool:
        """``should_split``: a small pool's block, and any block of an expandable segment, splits where 512 bytes
        are left; a large fixed segment's only where more than 1 MiB is."""
        rest = block.size - size
        return rest >= MIN_BLOCK if self.small or self.expandable else rest > SMALL_SIZE

    @property
    def page(self) -> int:
        """An expandable segment's page."""
        return SMALL_BUFFER if self.small else LARGE_BUFFER


def _last(segment: _Segment) -> _Block | None:
    """The segment's last block, walked to from the last one found while that one is still in the segment (a block
    merged away or replaced is no longer its neighbour's neighbour)."""
    block = segment.last
    if block is None or (block.prev.next if block.prev is not None else segment.first) is not block:
        block = segment.first
    while block is not None and block.next is not None:
        block = block.next
    segment.last = block
    return block


def _pages(nbytes: int, page: int) -> int:
    return -(-nbytes // page) * page


def _link(before: _Block | None, after: _Block | None, segment: _Segment) -> None:
    if before is not None:
        before.next = after
    else:
        segment.first = after
    if after is not None:
        after.prev = before


class SegmentModel:
    """The bytes a CUDA caching allocator reserves for a sequence of ``malloc(key, nbytes)`` and ``free(key)``."""

    def __init__(self, *, expandable: bool, record: bool = False):
        self.expandable = expandable
        self.pools = (_Pool(small=True, expandable=expandable), _Pool(small=False, expandable=expandable))
        self.live: dict[int, _Block] = {}
        self.reserved = self.peak_reserved = 0
        self.peak_needed = 0  # where ``least_capacity`` starts (see the module's docstring)
        self.held = self.peak_held = 0  # the bytes of the blocks holding allocations
        self._releasable = 0  # what ``release`` would give back now, kept as free blocks are listed and unlisted
        self._segments = 0
        # ``record``: the calls, (key, nbytes) or (key, _FREE) or (0, _RELEASE), for ``least_capacity``; and for
        # each, the most reserved a malloc could take the device to (0 for the others): a replay on a device of a
        # capacity no call before reached runs as the recording did up to there (``_replay_from``).
        self.events: list[tuple[int, int]] | None = [] if record else None
        self._reach: list[int] = []
        self._prefix: tuple[int, SegmentModel] | None = None  # a replay's state after that many calls

    def malloc(self, key: int, nbytes: int) -> None:
        """An allocation of ``nbytes`` identified by ``key`` (freed with ``free(key)``)."""
        if self.events is not None:
            self.events.append((key, nbytes))
            self._reach.append(self.reserved + self._most(nbytes))
        size = round_size(nbytes)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        block = self._best_fit(pool, size)
        if block is None:
            self._need(pool, size)
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
        self.held += block.size
        self.peak_held = max(self.peak_held, self.held)
        # Free room a release would have given back, taken: held from now on.
        self.peak_needed = max(self.peak_needed, self.reserved - self._releasable)

    def free(self, key: int) -> None:
        """Frees ``key``'s block, merging it with its free neighbours (an unknown key: nothing)."""
        if self.events is not None:
            self.events.append((key, _FREE))
            self._reach.append(0)
        block = self.live.pop(key, None)
        if block is None:
            return
        self.held -= block.size
        pool = block.segment.pool
        block.key = None
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.key is None and id(neighbour) in pool.blocks:
                self._unlist(pool, neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    _link(neighbour, block.next, block.segment)
                    block = neighbour
                else:
                    block.size += neighbour.size
                    _link(block, neighbour.next, block.segment)
        self._list(pool, block)

    def growth(self, nbytes: int) -> int:
        """The bytes ``malloc`` of ``nbytes`` would take from the driver now (0: a free block holds it)."""
        size = round_size(nbytes)
        pool = self.pools[0] if size <= SMALL_SIZE else self.pools[1]
        if self._best_fit(pool, size) is not None:
            return 0
        if not self.expandable:
            return segment_size(size)
        return self._run(pool, size)[1]

    def releasable(self) -> int:
        """The bytes ``release`` would give back now."""
        return self._releasable

    def _need(self, pool: _Pool, size: int) -> None:
        """A request of ``size`` that no free block holds: the least capacity that serves it, with or without the
        release a failed allocation makes (after which the request maps all its pages, or takes its own segment)."""
        after = _pages(size, pool.page) if self.expandable else segment_size(size)
        need = min(self.reserved + self.growth(size), self.reserved - self._releasable + after)
        self.peak_needed = max(self.peak_needed, need)

    def release(self) -> None:
        """What a failed allocation does before it retries (``release_blocks``): every segment with no allocation
        goes back to the driver; an expandable segment unmaps the whole pages inside each free block."""
        if self.events is not None:
            self.events.append((0, _RELEASE))
            self._reach.append(0)
        for pool in self.pools:
            for segment in list(pool.segments):
                if self.expandable:
                    self._unmap_free(pool, segment)
                elif segment.first is not None and segment.first.key is None and segment.first.next is None:
                    self._unlist(pool, segment.first)
                    pool.segments.remove(segment)
                    self.reserved -= segment.size

    def least_capacity(self) -> int:
        """The device memory the recorded calls run in (``record=True``): a capacity, in the 2 MiB steps everything
        reserved comes in, at which a replay whose allocations release before they would take the device past it
        never runs out (``runs_in``), where 2 MiB less does. Bisected between a capacity under the peak of held
        blocks and ``peak_reserved`` (where nothing is ever released), from ``peak_needed``: two or three replays
        where that guess is right.

        Running out is not monotone in the capacity: releases come at other moments on a larger device, which may
        then fragment worse, and a smaller one may run. With expandable segments (memtrain's default) no capacity
        above this figure was seen to fail (0 of 400 random sequences, each capacity tried; 2 ran below it). With
        fixed segments 3 of 400 failed above the bisected capacity, so there the figure is at least the running
        guess ``peak_needed`` (the figure before the bisection): none failed above that, 109 ran below it."""
        self._check_recorded()
        if not self.events:
            return 0
        guess = self.peak_needed
        fails = _pages(self.peak_held, GRAIN) - GRAIN  # under the held blocks: fails
        runs = self.peak_reserved
        self._share_prefix(fails + GRAIN)  # every capacity tried is above ``fails``
        if guess < runs:
            if not self.runs_in(guess):
                fails = max(fails, guess)
            elif guess - GRAIN <= fails or not self.runs_in(guess - GRAIN):
                return guess
            else:
                runs = guess - GRAIN
        while runs - fails > GRAIN:
            middle = fails + (runs - fails) // GRAIN // 2 * GRAIN
            fails, runs = (fails, middle) if self.runs_in(middle) else (middle, runs)
        return runs if self.expandable else max(runs, guess)

    def runs_in(self, capacity: int) -> bool:
        """Whether the recorded calls run on a device of ``capacity`` bytes: where an allocation would take more
        than it holds, the free segments (pages) are released and the allocation retried, as a failed ``cudaMalloc``
        makes the caching allocator (and the simulated device) do; False where the retry fails too."""
        self._check_recorded()
        assert self.events is not None
        start, replay = self._replay_from(capacity)
        for key, nbytes in self.events[start:]:
            if nbytes == _FREE:
                replay.free(key)
            elif nbytes == _RELEASE:
                replay.release()
            else:
                # The most a request can take first: the exact growth walks the blocks, needed only near the capacity.
                if (replay.reserved + self._most(nbytes) > capacity
                        and replay.reserved + replay.growth(nbytes) > capacity):
                    replay.release()
                    if replay.reserved + replay.growth(nbytes) > capacity:
                        return False
                replay.malloc(key, nbytes)
        return True

    def _most(self, nbytes: int) -> int:
        """The most a request can take from the driver: a segment, or its pages and a page of a hole's rounding."""
        return _pages(nbytes, LARGE_BUFFER) + LARGE_BUFFER if self.expandable else segment_size(round_size(nbytes))

    def _replay_from(self, capacity: int) -> tuple[int, SegmentModel]:
        """Where a replay on ``capacity`` starts: up to the first call that could take the recording past it, the
        replay is the recording (nothing released that the recording kept), so it starts from the state the
        bisection's lowest capacity shares with every capacity above it, kept once (``_share_prefix``)."""
        if self._prefix is not None and self._prefix[0] <= self._calls_within(capacity):
            return self._prefix[0], self._prefix[1]._copy()
        return 0, SegmentModel(expandable=self.expandable)

    def _calls_within(self, capacity: int) -> int:
        """How many calls from the first the recording makes before one could take it past ``capacity``."""
        return next((i for i, reach in enumerate(self._reach) if reach > capacity), len(self._reach))

    def _share_prefix(self, lowest: int) -> None:
        """Keeps the state of a replay (the recording's) up to the calls that every capacity from ``lowest`` runs
        as the recording did."""
        assert self.events is not None
        calls, state = self._calls_within(lowest), SegmentModel(expandable=self.expandable)
        for key, nbytes in self.events[:calls]:
            if nbytes == _FREE:
                state.free(key)
            elif nbytes == _RELEASE:
                state.release()
            else:
                state.malloc(key, nbytes)
        self._prefix = calls, state

    def _copy(self) -> SegmentModel:
        """A model in the same state (not recording): its segments' blocks copied, its free lists keyed anew."""
        other = SegmentModel(expandable=self.expandable)
        other.reserved, other.peak_reserved, other.peak_needed = self.reserved, self.peak_reserved, self.peak_needed
        other.held, other.peak_held, other._releasable = self.held, self.peak_held, self._releasable
        other._segments = self._segments
        copies: dict[int, _Block] = {}  # id(block) -> its copy
        for pool, copied in zip(self.pools, other.pools, strict=True):
            for segment in pool.segments:
                twin = _Segment(copied, segment.base, segment.size, holes=segment.holes)
                block, before = segment.first, None
                while block is not None:
                    copy = _Block(twin, block.start, block.size, block.key, before, None, block.mapped)
                    _link(before, copy, twin)
                    copies[id(block)] = before = copy
                    block = block.next
                copied.segments.append(twin)
            copied.blocks = {id(copies[i]): copies[i] for i in pool.blocks}
            # Each entry's size and address order the list; a block's address is its own.
            copied.free = [(size, address, id(copies[i])) for size, address, i in pool.free]
        other.live = {key: copies[id(block)] for key, block in self.live.items()}
        return other

    def _check_recorded(self) -> None:
        if self.events is None:
            raise ValueError("least_capacity and runs_in replay the calls: build the model with "
                             "SegmentModel(record=True)")

    def _unmap_free(self, pool: _Pool, segment: _Segment) -> None:
        """``unmap_block`` of each free block: its whole pages become a hole, merged with a hole beside it; the
        bytes before and after them stay free and mapped."""
        block = segment.first
        while block is not None:
            following = block.next
            if block.key is None and block.mapped:
                low, high = _pages(block.start, pool.page), (block.start + block.size) // pool.page * pool.page
                if high > low:
                    self._unlist(pool, block)
                    self.reserved -= high - low
                    hole = _Block(segment, low, high - low, None, mapped=False)
                    segment.holes = True
                    if low > block.start:  # the free bytes before the hole
                        before = _Block(segment, block.start, low - block.start, None)
                        _link(block.prev, before, segment)
                        _link(before, hole, segment)
                        self._list(pool, before)
                    else:
                        _link(block.prev, hole, segment)
                    if block.start + block.size > high:
                        after = _Block(segment, high, block.start + block.size - high, None)
                        _link(hole, after, segment)
                        _link(after, following, segment)
                        self._list(pool, after)
                    else:
                        _link(hole, following, segment)
                    self._merge_holes(hole)
            block = following
        last = _last(segment)
        if last is not None and not last.mapped:  # a hole at the end: the address range ends before it
            segment.size -= last.size
            _link(last.prev, None, segment)

    @staticmethod
    def _merge_holes(hole: _Block) -> None:
        for neighbour in (hole.prev, hole.next):
            if neighbour is not None and not neighbour.mapped:
                first, second = (neighbour, hole) if neighbour is hole.prev else (hole, neighbour)
                first.size += second.size
                _link(first, second.next, first.segment)
                hole = first

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1, -1))
        return pool.blocks[pool.free[i][2]] if i < len(pool.free) else None

    def _run(self, pool: _Pool, size: int) -> tuple[_Block | None, int]:
        """Where an expandable segment serves ``size`` that no free block holds (``find_expandable_block``): the
        lowest hole, or the end, that with the free block before it and the free blocks and holes after it spans
        ``size``; and the bytes mapping it takes. The block the run starts at: None for fresh pages at the end."""
        segment = pool.segments[0] if pool.segments else None
        block = segment.first if segment is not None and segment.holes else None
        holes = False
        while block is not None:
            if not block.mapped:
                holes = True
                start = block.prev if block.prev is not None and block.prev.key is None else block
                mapped, spanned, b = 0, 0, start
                while b is not None and b.key is None and spanned < size:
                    mapped += b.size if b.mapped else 0
                    spanned += b.size
                    b = b.next
                if spanned >= size or b is None:  # the run reaches the end: more pages there
                    return start, self._mapping(start, size, pool.page)
            block = block.next
        if segment is not None:
            segment.holes = holes  # a walk that found none: none until a release makes one
        last = _last(segment) if segment is not None else None
        start = last if last is not None and last.key is None else None
        return start, self._mapping(start, size, pool.page)

    @staticmethod
    def _mapping(start: _Block | None, size: int, page: int) -> int:
        """The bytes a run from ``start`` maps for ``size``: each hole's pages as far as the request reaches, then
        pages at the end."""
        mapped, block, left = 0, start, size
        while block is not None and left > 0:
            take = block.size if block.mapped else min(block.size, _pages(left, page))
            mapped += 0 if block.mapped else take
            left -= take
            block = block.next
        return mapped + (_pages(left, page) if left > 0 else 0)

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A block of at least ``size`` from the driver: a new segment, or an expandable segment's holes and end
        mapped (``try_allocate_expandable_block``), one free block."""
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
        block, _ = self._run(pool, size)
        run: _Block | None = None
        left = size
        while left > 0:
            if block is None:  # fresh pages at the end
                more = _pages(left, pool.page)
                block = _Block(segment, segment.size, more, None, mapped=False)
                _link(run if run is not None else _last(segment), block, segment)
                segment.size += more
            if block.mapped:
                self._unlist(pool, block)
            else:
                take = min(block.size, _pages(left, pool.page))
                if take < block.size:  # the hole's rest stays a hole
                    rest = _Block(segment, block.start + take, block.size - take, None, mapped=False)
                    _link(rest, block.next, segment)
                    _link(block, rest, segment)
                    block.size = take
                block.mapped = True
                self._map(take)
            left -= block.size
            if run is None:
                run = block
            else:
                run.size += block.size
                _link(run, block.next, segment)
            block = run.next
        assert run is not None
        following = run.next
        if following is not None and id(following) in pool.blocks:  # ``map_block`` merges a free neighbour
            self._unlist(pool, following)
            run.size += following.size
            _link(run, following.next, segment)
        self._list(pool, run)
        return run

    def _gives_back(self, pool: _Pool, block: _Block) -> int:
        """What ``release`` gives back of a free block: its whole pages (expandable), its segment when it is the
        whole of one (fixed). Fixed while the block is listed: a listed block's neighbours do not change."""
        if self.expandable:
            return max(0, (block.start + block.size) // pool.page * pool.page - _pages(block.start, pool.page))
        return block.size if block.prev is None and block.next is None else 0

    def _segment(self, pool: _Pool, size: int) -> _Segment:
        self._segments += 1
        return _Segment(pool, self._segments << 48, size)

    def _map(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _list(self, pool: _Pool, block: _Block) -> None:
        # Best fit as the allocator's free set orders blocks: by size, then by address.
        pool.blocks[id(block)] = block
        bisect.insort(pool.free, (block.size, block.segment.base + block.start, id(block)))
        self._releasable += self._gives_back(pool, block)

    def _unlist(self, pool: _Pool, block: _Block) -> None:
        if pool.blocks.pop(id(block), None) is None:
            return
        self._releasable -= self._gives_back(pool, block)
        i = bisect.bisect_left(pool.free, (block.size, block.segment.base + block.start, id(block)))
        del pool.free[i]
