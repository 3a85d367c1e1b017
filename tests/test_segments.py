"""The caching allocator's segments (memtrain.device.segments): the bytes reserved for a sequence of allocations,
with and without expandable segments, by the rules of c10/cuda/CUDACachingAllocator.cpp."""

from __future__ import annotations

import random
from typing import Any

import pytest

from memtrain.device.segments import GRAIN, LARGE_BUFFER, SMALL_BUFFER, SegmentModel, round_size, segment_size
from memtrain.device.segments import _last as segments_last

MIB = 2**20


def test_requests_round_to_512_and_take_the_segment_their_size_calls_for():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(MIB) == SMALL_BUFFER and segment_size(MIB + 512) == LARGE_BUFFER
    assert segment_size(10 * MIB - 512) == LARGE_BUFFER and segment_size(10 * MIB) == 10 * MIB
    assert segment_size(11 * MIB + 1) == 12 * MIB  # rounded up to 2 MiB


def test_small_blocks_share_a_segment_and_a_freed_one_is_reused():
    m = SegmentModel(expandable=False)
    for key in range(4096):  # 4096 x 512 bytes: one 2 MiB segment
        m.malloc(key, 100)
    assert m.reserved == SMALL_BUFFER
    m.malloc(-1, 100)
    assert m.reserved == 2 * SMALL_BUFFER
    m.free(7)
    m.malloc(-2, 300)  # fits the freed block
    assert m.reserved == 2 * SMALL_BUFFER


def test_growing_requests_fragment_fixed_segments_and_not_expandable_ones():
    """A request a little larger each time (sequence lengths growing between steps): a freed block cannot hold the
    next, so fixed segments pile up; an expandable segment extends its free tail."""
    def reserved(expandable: bool) -> int:
        m = SegmentModel(expandable=expandable)
        for step, size in enumerate(range(30 * MIB, 60 * MIB, 3 * MIB)):
            m.malloc(step, size)
            m.free(step)
        return m.peak_reserved

    fixed, expandable = reserved(False), reserved(True)
    assert fixed == sum(range(30 * MIB, 60 * MIB, 3 * MIB)) + 5 * MIB  # each its own segment (odd MiB rounded up)
    assert expandable == 60 * MIB, expandable  # one segment: the largest request in 20 MiB pages
    assert expandable < fixed / 5


@pytest.mark.parametrize("expandable", [False, True])
def test_the_least_memory_a_replay_runs_in_counts_what_a_release_gives_back(expandable):
    """Freed segments are given back when an allocation fails, so growing requests one at a time need the largest
    one's segment (or pages), not the sum that a device with room to spare reserves."""
    m = SegmentModel(expandable=expandable)
    for step, size in enumerate(range(30 * MIB, 60 * MIB, 3 * MIB)):
        m.malloc(step, size)
        m.free(step)
    assert m.peak_needed == (60 if expandable else 58) * MIB  # 57 MiB in 2 MiB rounding, or three 20 MiB pages
    assert m.peak_needed <= m.peak_reserved


def test_the_least_memory_counts_a_kept_segment_that_a_later_request_reuses():
    m = SegmentModel(expandable=False)
    m.malloc(1, 12 * MIB)
    m.free(1)  # a free 12 MiB segment: a release would give it back
    m.malloc(2, 30 * MIB)
    assert m.peak_needed == 30 * MIB
    m.malloc(3, 12 * MIB)  # the cached segment, taken again: both are held now
    assert m.peak_needed == 42 * MIB == m.peak_reserved


def test_a_failed_allocation_releases_the_free_segments():
    m = SegmentModel(expandable=False)
    m.malloc(1, 12 * MIB)
    m.malloc(2, 12 * MIB)
    m.free(1)
    m.release()
    assert m.reserved == 12 * MIB and m.peak_reserved == 24 * MIB


@pytest.mark.parametrize("expandable", [False, True])
def test_random_allocations_keep_the_segments_whole(expandable):
    """Every segment is tiled by its blocks, the free list holds exactly the free blocks, what is reserved is never
    less than what is allocated, and the hints that spare walking the blocks hold, checked as the calls go."""
    rng = random.Random(0)
    m = SegmentModel(expandable=expandable)
    sizes: dict[int, int] = {}
    for key in range(3000):
        if sizes and rng.random() < 0.45:
            gone = rng.choice(list(sizes))
            m.free(gone)
            del sizes[gone]
        else:
            sizes[key] = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MIB), rng.randrange(1, 40 * MIB)])
            m.malloc(key, sizes[key])
        if key % 500 == 0:
            m.release()
        allocated = sum(round_size(n) for n in sizes.values())
        assert m.reserved >= allocated
        if key % 250 == 0:
            _assert_whole(m)
    _assert_whole(m)


def _assert_whole(m: SegmentModel) -> None:
    mapped = gives_back = 0
    for pool in m.pools:
        free = set()
        for segment in pool.segments:
            block, end, last = segment.first, 0, None
            while block is not None:
                assert block.start == end and block.segment is segment
                end += block.size
                mapped += block.size if block.mapped else 0
                if block.key is None and block.mapped:
                    free.add(id(block))
                    assert block.next is None or block.next.key is not None or not block.next.mapped  # merged
                    gives_back += m._gives_back(pool, block)
                if not block.mapped:  # a hole: whole pages, never beside another hole
                    assert block.key is None and block.start % pool.page == 0 and block.size % pool.page == 0
                    assert block.next is None or block.next.mapped
                last, block = block, block.next
            assert end == segment.size
            # The hints that spare walking the blocks: the last block found from the one last found (the hint put
            # back, so that the checks do not refresh it), and a hole only where a release may have made one.
            hint = segment.last
            assert segments_last(segment) is last
            segment.last = hint
            assert segment.holes or all(b.mapped for b in _blocks(segment))
        assert free == set(pool.blocks) and len(pool.free) == len(free)
    assert m.reserved == mapped and m.releasable() == gives_back


def _blocks(segment):
    block = segment.first
    while block is not None:
        yield block
        block = block.next


def _fragmenting(seed: int, expandable: bool, releases: float = 0.0) -> SegmentModel:
    """A recorded sequence of 60 random allocations and frees, small and large (up to 40 MiB), with a release after
    a call at the rate ``releases`` (as a failed allocation on a real device makes)."""
    rng = random.Random(seed)
    m = SegmentModel(expandable=expandable, record=True)
    sizes: dict[int, int] = {}
    for key in range(60):
        if sizes and rng.random() < 0.45:
            gone = rng.choice(list(sizes))
            m.free(gone)
            del sizes[gone]
        else:
            sizes[key] = rng.choice([rng.randrange(1, 2 * MIB), rng.randrange(1, 40 * MIB)])
            m.malloc(key, sizes[key])
        if releases and rng.random() < releases:
            m.release()
    return m


@pytest.mark.parametrize("expandable", [False, True])
def test_the_least_capacity_runs_the_recorded_calls_and_so_does_every_larger_device(expandable):
    """``least_capacity`` replays the calls on devices of bisected capacity, releasing where an allocation would
    not fit: the figure it gives runs, and so does every larger capacity up to the reserved peak (each tried). With
    expandable segments 2 MiB less does not run; with fixed ones, where a larger device can fail (seed 278: the
    bisection gives 84 MiB and 92 MiB fails), it is at least the running guess ``peak_needed``. That guess is under
    the figure on some sequences (a released device fragments otherwise), which is why the report bisects."""
    under = 0
    for seed in range(300):
        m = _fragmenting(seed, expandable)
        least = m.least_capacity()
        assert least % GRAIN == 0 and m.peak_held <= least <= m.peak_reserved, seed
        assert all(m.runs_in(c) for c in range(least, m.peak_reserved + 1, GRAIN)), seed
        assert not m.runs_in(least - GRAIN) if expandable else least >= m.peak_needed, seed
        under += m.peak_needed < least
    assert under > 0  # the sequences that need more than the guess are among these


@pytest.mark.parametrize("expandable", [False, True])
def test_a_replay_from_the_shared_prefix_runs_as_one_from_the_first_call(expandable):
    """``runs_in`` starts from the state every capacity from the bisection's lowest shares with the recording (up
    to the first call that could take it past that capacity): on each capacity, from below the held blocks' peak
    (where it replays from the first call) to the reserved peak, it says what a replay from the first call says,
    recorded releases among the calls; the state kept is copied whole, and a copy goes on as the original."""
    shared_calls = 0
    for seed in range(100):
        m = _fragmenting(seed, expandable, releases=0.1)
        m.least_capacity()  # keeps the prefix
        assert m._prefix is not None, seed
        shared_calls += m._prefix[0]
        for capacity in range(max(0, m.peak_held // GRAIN - 4) * GRAIN, m.peak_reserved + GRAIN, GRAIN):
            shared = m.runs_in(capacity)
            kept, m._prefix = m._prefix, None
            assert shared == m.runs_in(capacity), (seed, capacity)
            m._prefix = kept
        state = m._prefix[1]
        _assert_same(state._copy(), state)
        copy = m._copy()
        _assert_whole(copy)
        for key, nbytes in [(1000, 3 * MIB), (1001, 100), (1002, 30 * MIB)]:
            m.malloc(key, nbytes), copy.malloc(key, nbytes)
            m.free(key - 1), copy.free(key - 1)
            m.release(), copy.release()
            _assert_same(copy, m)
        _assert_whole(copy)
    assert shared_calls > 100 * 10  # the replays share a prefix (the speed-up is there)


def _assert_same(copy: SegmentModel, m: SegmentModel) -> None:
    """The same state: every figure, and in each pool every segment's blocks and hints and the free list's order."""
    figures = ("reserved", "peak_reserved", "peak_needed", "held", "peak_held", "_releasable", "_segments")
    assert [getattr(copy, f) for f in figures] == [getattr(m, f) for f in figures]
    for pool, twin in zip(m.pools, copy.pools, strict=True):
        assert [(seg.base, seg.size, seg.holes) for seg in pool.segments] == [
            (seg.base, seg.size, seg.holes) for seg in twin.segments]
        for seg, other in zip(pool.segments, twin.segments, strict=True):
            assert [(b.start, b.size, b.key, b.mapped) for b in _blocks(seg)] == [
                (b.start, b.size, b.key, b.mapped) for b in _blocks(other)]
        assert [entry[:2] for entry in pool.free] == [entry[:2] for entry in twin.free]
        assert sorted((b.start, b.size) for b in pool.blocks.values()) == sorted(
            (b.start, b.size) for b in twin.blocks.values())
    assert {k: (b.segment.base, b.start) for k, b in m.live.items()} == {
        k: (b.segment.base, b.start) for k, b in copy.live.items()}


def test_the_least_capacity_needs_the_recorded_calls():
    m = SegmentModel(expandable=True)
    m.malloc(1, MIB)
    for replay in (m.least_capacity, lambda: m.runs_in(4 * MIB)):
        with pytest.raises(ValueError, match="record=True"):
            replay()
    recorded = SegmentModel(expandable=False, record=True)
    assert recorded.least_capacity() == 0
    recorded.malloc(1, 30 * MIB)
    recorded.free(1)
    recorded.malloc(2, 50 * MIB)  # the free 30 MiB segment released first: 50 MiB, not 80
    assert recorded.least_capacity() == 50 * MIB < recorded.peak_reserved == 80 * MIB


def test_an_expandable_segments_large_block_splits_where_512_bytes_are_left():
    """``should_split``: with expandable segments a large block splits down to 512 bytes left, where a fixed
    segment's keeps up to 1 MiB of slack inside the block."""
    request = 20 * MIB - 512 * 1024  # a 20 MiB page with half a MiB left
    fixed, expandable = SegmentModel(expandable=False), SegmentModel(expandable=True)
    for m in (fixed, expandable):
        m.malloc(1, request)
    assert fixed.live[1].size == 20 * MIB
    assert expandable.live[1].size == request and expandable.held == request


def test_a_release_unmaps_the_whole_pages_of_free_blocks_and_a_request_maps_a_hole_again():
    """``unmap_block``: an expandable segment gives back the whole pages inside each free block, not only its free
    end; a later request that no free block holds maps pages in the lowest hole it fits
    (``find_expandable_block``), not at the end."""
    m = SegmentModel(expandable=True)
    m.malloc(1, 40 * MIB)  # pages 0-1
    m.malloc(2, 5 * MIB)  # page 2 (with 15 MiB free after it)
    m.malloc(3, 40 * MIB)  # pages 3-4: the 15 MiB free block is too small
    assert m.reserved == 100 * MIB
    m.free(1)
    assert m.releasable() == 40 * MIB  # pages 0-1; page 2's free 15 MiB is part of a mapped page
    m.release()
    assert m.reserved == 60 * MIB and m.releasable() == 0
    m.malloc(4, 30 * MIB)  # the hole's pages, mapped again: the address range does not grow
    assert m.reserved == 100 * MIB and m.pools[1].segments[0].size == 100 * MIB
    assert m.peak_needed == 100 * MIB


@pytest.mark.parametrize("expandable", [False, True])
def test_the_estimates_reserved_peak_is_within_5_percent_of_the_simulated_allocators(monkeypatch, expandable):
    """A GPT's training step (fused AdamW) on the simulated device, whose reserved memory is the caching allocator's
    segments, against ``estimate``'s prediction of the same step: the allocated peaks agree within 0.1%, the
    reserved ones within 5% (measured: 2.1% and 3.1% over; the estimate gives the optimizer's state two blocks per
    parameter, as AdamW allocates it, from its total)."""
    import torch

    from memtrain import estimate
    from memtrain.device import simulate
    from memtrain.models import GPT, GPTConfig

    if expandable:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    else:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, seq_len=512))
    x = torch.randint(0, 256, (4, 512), generator=torch.Generator().manual_seed(0))
    with simulate("4GiB", segments=True) as acc:
        assert acc.ledger.segments.expandable is expandable
        model, on_device = acc.place(model), acc.place(x)
        optimizer = torch.optim.AdamW(model.parameters(), fused=True)

        def step() -> None:
            model(on_device, on_device).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # the optimizer's state allocated: the steady state the estimate predicts
        acc.reset_peak_memory_stats()
        step()
        allocated, reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        predicted = estimate(model, x, device="cuda")
    assert abs(predicted.peak_bytes - allocated) <= 1e-3 * allocated, (predicted.peak_bytes, allocated)
    assert reserved > allocated  # the segments' free room
    assert abs(predicted.reserved_bytes - reserved) <= 0.05 * reserved, (predicted.reserved_bytes, reserved)
    assert "peak reserved" in predicted.summary()


def _least_capacity(expandable: bool) -> tuple[int, int, int, Any]:
    """The GPT step of the test above on simulated devices of bisected capacity: the least capacity (to 1 MiB) that
    runs three steps, which fail on a smaller one with ``torch.OutOfMemoryError``; with the allocated and reserved
    peaks on a device with room to spare, and ``estimate``'s report of the step there."""
    import torch

    from memtrain import estimate
    from memtrain.device import simulate
    from memtrain.models import GPT, GPTConfig

    x = torch.randint(0, 256, (4, 512), generator=torch.Generator().manual_seed(0))

    def runs(capacity: int, predict: bool = False) -> tuple[int, int, Any] | None:
        torch.manual_seed(0)
        try:
            with simulate(capacity, segments=True) as acc:
                assert acc.ledger.segments.expandable is expandable
                model, on_device = acc.place(GPT(GPTConfig(n_layer=4, n_head=4, n_embd=256, seq_len=512))), acc.place(x)
                optimizer = torch.optim.AdamW(model.parameters(), fused=True)
                for _ in range(3):
                    model(on_device, on_device).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                report = estimate(model, x, device="cuda") if predict else None
                return acc.max_memory_allocated(), acc.max_memory_reserved(), report
        except torch.OutOfMemoryError:
            return None

    allocated, reserved, predicted = runs(4 << 30, predict=True)
    low, high = allocated, reserved  # fails below the allocated peak; runs where every segment was kept
    while high - low > MIB:
        middle = (low + high) // 2
        low, high = (low, middle) if runs(middle) else (middle, high)
    return high, allocated, reserved, predicted


@pytest.mark.parametrize("expandable", [False, True])
def test_the_estimates_least_memory_is_within_5_percent_of_the_least_simulated_capacity(monkeypatch, expandable):
    """What a budget must hold: the least capacity of the simulated device (its allocator gives free segments back
    and retries where an allocation fails) that runs the GPT step, against ``estimate``'s ``needed_bytes``
    (measured: 2.1% over with fixed segments and 1.0% over with expandable ones, where the reserved peak is 7.5% and
    6.4% over). Neither is under it by more than the bisection's 1 MiB."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", f"expandable_segments:{expandable}")
    least, allocated, reserved, predicted = _least_capacity(expandable)
    assert allocated < least <= reserved
    assert least - MIB <= predicted.needed_bytes <= 1.05 * least, (predicted.needed_bytes, least)
    assert predicted.needed_bytes <= predicted.reserved_bytes
    assert "least memory it runs in" in predicted.summary()
